"""The step's edge layout kernels (cgforge.kernels.edge_layout): the CUDA source compiles (NVRTC, no GPU needed) and
runs on the CPU as C++ (``host_cuda``) equal to the torch expression it replaces (``edges_within`` and
``layout_edges`` with a topology, cgforge.plugin.runtime): the same mask, slots, padding, row pointers and
transpose, with room to spare, with none and on overflow, on a list padded past its pairs; on a GPU the same. And
``layout_listed`` (a receiver-sorted list cut to a device count, no reverses: LAMMPS's pairs) equal to
``layout_edges`` without a topology: its ``edge_place`` without reverses as C++, on the CPU and on a GPU."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from host_cuda import assert_compiles_without_spills, build, call

from cgforge.kernels import edge_layout as el
from cgforge.kernels.edge_layout import EDGE_LAYOUT_SOURCE, edges_within, padded_layout_cuda
from cgforge.plugin.runtime.neighbours import neighbour_list
from cgforge.plugin.water import water_box

CUTOFF, SKIN = 3.2, 0.8

_DRIVER = r"""
template <typename F> static void threads(long long items, F body) {
    blockDim.x = 64;
    for (long long b = 0; b * 64 < items; ++b)
        for (int t = 0; t < 64; ++t) { blockIdx.x = b; threadIdx.x = t; body(); }
}
extern "C" void keep_SUFFIX(const T* pos, const T* cell, const long long* sender, const long long* receiver,
                            const T* shifts, const unsigned char* valid, T cutoff, long long pairs, int* keep) {
    threads(pairs, [&] { edge_keep_SUFFIX(pos, cell, sender, receiver, shifts, valid, cutoff, pairs, keep); });
}
extern "C" void place_SUFFIX(const int* keep, const long long* rank, const long long* sender,
        const long long* receiver, const T* shifts, const long long* list_rowptr, const long long* reverse,
        const T* pad_vector, long long pairs, long long n, long long capacity, int with_graph, long long* out_sender,
        long long* out_receiver, T* out_shifts, T* out_pad, long long* slot, int* sender32, int* receiver32,
        long long* rowptr, int* perm_t) {
    const long long items = std::max(std::max(pairs, capacity), n + 1);
    threads(items, [&] {
        edge_place_SUFFIX(keep, rank, sender, receiver, shifts, list_rowptr, reverse, pad_vector, pairs, n,
                          capacity, with_graph, out_sender, out_receiver, out_shifts, out_pad, slot, sender32,
                          receiver32, rowptr, perm_t);
    });
}
"""


def _list(dtype: torch.dtype, spare: int, seed: int = 3):
    """A skin list of a rattled 24-atom water box (several images per pair), padded with ``spare`` invalid entries
    as the MD runtime pads it; the positions moved a little since, so some pairs left the cutoff."""
    atoms = water_box(8, seed=seed)
    atoms.rattle(0.05, seed=seed)
    pos = torch.tensor(atoms.positions, dtype=torch.float64)
    cell = torch.tensor(np.array(atoms.cell), dtype=torch.float64)
    sender, receiver, shifts = neighbour_list(pos, cell, True, CUTOFF + SKIN)
    n, v = len(atoms), sender.shape[0]
    topology = el.edge_topology(sender, receiver, shifts, n, capacity=v + spare)
    zeros = torch.zeros(spare, dtype=torch.int64)
    sender, receiver = torch.cat([sender, zeros]), torch.cat([receiver, zeros])
    shifts = torch.cat([shifts, torch.zeros(spare, 3, dtype=shifts.dtype)]).to(dtype)
    valid = torch.arange(v + spare) < v
    moved = (pos + 0.1 * torch.randn(pos.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    return moved.to(dtype), cell.to(dtype), sender, receiver, shifts, valid, topology


def _reference(pos, cell, sender, receiver, shifts, valid, topology, capacity, pad, with_graph):
    _, _, inside = edges_within(pos, cell, sender, receiver, shifts, CUTOFF)
    return el.layout_edges(inside & valid, sender, receiver, shifts, pos.shape[0], capacity, pad, with_graph,
                           topology)


def _outputs(layout: el.EdgeLayout) -> list[torch.Tensor]:
    graph = [] if layout.graph is None else [layout.graph[i] for i in (0, 1, 2, 5)]
    return [layout.sender, layout.receiver, layout.unit_shifts, layout.pad_offset, layout.count, layout.slot, *graph]


def _assert_equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    names = ["sender", "receiver", "shifts", "pad", "count", "slot", "sender32", "receiver32", "rowptr", "perm_t"]
    assert len(got) == len(want)
    for name, a, b in zip(names[:len(got)], got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a.cpu(), b.cpu()), name


def test_kernels_compile_without_spills() -> None:
    names = [f"edge_{kind}_{suffix}" for kind in ("keep", "place") for suffix in ("f32", "f64")]
    assert_compiles_without_spills(EDGE_LAYOUT_SOURCE, "edge_layout.cu", names)


@pytest.fixture(scope="module")
def libraries(tmp_path_factory):
    folder = tmp_path_factory.mktemp("edge_layout")
    out = {}
    for dtype, scalar, suffix in ((torch.float64, "double", "f64"), (torch.float32, "float", "f32")):
        driver = f"typedef {scalar} T;\n" + _DRIVER.replace("SUFFIX", suffix)
        out[dtype] = build(EDGE_LAYOUT_SOURCE, driver, folder, f"edge_layout_{suffix}")
    return out


def _host_layout(library, pos, cell, sender, receiver, shifts, valid, topology, capacity, pad, with_graph):
    dtype = pos.dtype
    scalar = ctypes.c_double if dtype == torch.float64 else ctypes.c_float
    suffix = "f64" if dtype == torch.float64 else "f32"
    pairs, n = sender.shape[0], pos.shape[0]
    keep = np.zeros(pairs, dtype=np.int32)
    valid8 = valid.to(torch.uint8).numpy()
    call(getattr(library, f"keep_{suffix}"), [pos.numpy(), cell.numpy(), sender.numpy(), receiver.numpy(),
                                               shifts.numpy(), valid8, scalar(CUTOFF), pairs, keep])
    rank = torch.cumsum(torch.from_numpy(keep), 0, dtype=torch.int64)
    np_dtype = pos.numpy().dtype
    outs = [np.zeros(capacity, np.int64), np.zeros(capacity, np.int64), np.zeros((capacity, 3), np_dtype),
            np.zeros((capacity, 3), np_dtype), np.zeros(pairs, np.int64)]
    graph = ([np.zeros(capacity, np.int32), np.zeros(capacity, np.int32), np.zeros(n + 1, np.int64),
              np.zeros(capacity, np.int32)] if with_graph else [None] * 4)
    call(getattr(library, f"place_{suffix}"), [keep, rank.numpy(), sender.numpy(), receiver.numpy(), shifts.numpy(),
                                                topology.rowptr.numpy(), topology.reverse.numpy(), pad.numpy(), pairs,
                                                n, capacity, ctypes.c_int(int(with_graph)), *outs, *graph])
    t = [torch.from_numpy(a) for a in outs]
    return [*t[:4], rank[-1], t[4], *([torch.from_numpy(a) for a in graph] if with_graph else [])], keep


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("room, with_graph", [(0, True), (41, True), (41, False), (-6, True)])
def test_cuda_source_run_as_cpp_equals_the_torch_expression(libraries, dtype, room, with_graph) -> None:
    pos, cell, sender, receiver, shifts, valid, topology = _list(dtype, spare=17)
    _, _, inside = edges_within(pos, cell, sender, receiver, shifts, CUTOFF)
    kept = inside & valid
    assert 0 < int(kept.sum()) < int(valid.sum()), "some pairs of the skin list are out of the cutoff"
    count = int((kept & kept[topology.reverse]).sum())
    capacity = count + room
    pad = torch.tensor([2 * CUTOFF + 1, 0.0, 0.0], dtype=dtype)
    args = (pos, cell, sender, receiver, shifts, valid, topology, capacity, pad, with_graph)
    got, keep = _host_layout(libraries[dtype], *args)
    assert np.array_equal(keep.astype(bool), kept.numpy()), "the kernel's mask is edges_within's"
    assert np.array_equal(keep, keep[topology.reverse.numpy()]), "a pair is kept with its reverse"
    _assert_equal(got, _outputs(_reference(*args)))


def test_the_cpu_path_is_the_torch_expression() -> None:
    pos, cell, sender, receiver, shifts, valid, topology = _list(torch.float64, spare=3)
    pad = torch.tensor([7.4, 0.0, 0.0], dtype=torch.float64)
    layout = el.layout_within(pos, cell, sender, receiver, shifts, valid, CUTOFF, pos.shape[0], 900, pad, True,
                              topology)
    _assert_equal(_outputs(layout), _outputs(_reference(pos, cell, sender, receiver, shifts, valid, topology, 900,
                                                        pad, True)))


def test_bad_inputs_are_named() -> None:
    pos, cell, sender, receiver, shifts, valid, topology = _list(torch.float64, spare=0)
    with pytest.raises(ValueError, match="CUDA device"):
        padded_layout_cuda(pos, cell, sender, receiver, shifts, valid, topology.rowptr, topology.reverse, CUTOFF,
                           100, torch.zeros(3, dtype=torch.float64), True)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("room, with_graph", [(0, True), (41, True), (41, False), (-6, True)])
def test_cuda_kernels_equal_the_torch_expression(dtype, room, with_graph) -> None:
    pos, cell, sender, receiver, shifts, valid, topology = _list(dtype, spare=17)
    _, _, inside = edges_within(pos, cell, sender, receiver, shifts, CUTOFF)
    kept = inside & valid
    capacity = int((kept & kept[topology.reverse]).sum()) + room
    pad = torch.tensor([2 * CUTOFF + 1, 0.0, 0.0], dtype=dtype)
    want = _outputs(_reference(pos, cell, sender, receiver, shifts, valid, topology, capacity, pad, with_graph))
    cuda = [t.cuda() for t in (pos, cell, sender, receiver, shifts, valid)]
    topo = el.EdgeTopology(topology.rowptr.cuda(), topology.reverse.cuda())
    layout = el.layout_within(*cuda, CUTOFF, pos.shape[0], capacity, pad.cuda(), with_graph, topo)
    _assert_equal(_outputs(layout), want)


LISTS = [(40, 23, 40), (40, 0, 40), (40, 40, 40), (40, 23, 61), (40, 30, 17), (0, 0, 6)]  # pairs, count, capacity


def _listed(pairs: int, count: int, dtype: torch.dtype, n: int = 13, seed: int = 5):
    """A receiver-ascending list of ``count`` pairs over ``n`` atoms (some rows empty, some repeated), then stale
    in-range entries up to ``pairs``, as LAMMPS's pair arrays hold them."""
    g = torch.Generator().manual_seed(seed)
    receiver = torch.randint(0, n, (pairs,), generator=g)
    receiver[:count] = receiver[:count].sort().values
    sender = torch.randint(0, n, (pairs,), generator=g)
    vectors = torch.randn(pairs, 3, generator=g, dtype=torch.float64).to(dtype)
    return sender, receiver, vectors, torch.tensor(count), n


def _listed_reference(sender, receiver, vectors, count, n, capacity, pad, with_graph, keep=None) -> el.EdgeLayout:
    selected = torch.arange(sender.shape[0]) < count
    return el.layout_edges(selected if keep is None else selected & keep, sender, receiver, vectors, n, capacity, pad,
                           with_graph)


def _mask(pairs: int, masked: bool) -> torch.Tensor | None:
    """None (every listed entry an edge), or a random selection of them (ghost mode's receptive field)."""
    return torch.rand(pairs, generator=torch.Generator().manual_seed(pairs)) < 0.6 if masked else None


def _full(layout: el.EdgeLayout) -> list[torch.Tensor]:
    """Every tensor of the layout, the graph's empty perm and rowptr_t included."""
    return [*_outputs(layout), *([] if layout.graph is None else [layout.graph.perm, layout.graph.rowptr_t])]


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("with_graph", [True, False])
@pytest.mark.parametrize("pairs, count, capacity", LISTS)
def test_cuda_source_without_reverses_run_as_cpp_equals_the_torch_expression(libraries, dtype, with_graph, pairs,
                                                                              count, capacity, masked) -> None:
    sender, receiver, vectors, count_t, n = _listed(pairs, count, dtype)
    pad = torch.tensor([2 * CUTOFF + 1, 0.0, 0.0], dtype=dtype)
    mask = _mask(pairs, masked)
    keep, rank, list_rowptr = el._listed_rank(receiver, count_t, n, mask)
    suffix = "f64" if dtype == torch.float64 else "f32"
    np_dtype = vectors.numpy().dtype
    # sentinels everywhere: a slot the kernel leaves unwritten fails the comparison
    outs = [np.full(capacity, -5, np.int64), np.full(capacity, -5, np.int64), np.full((capacity, 3), np.nan, np_dtype),
            np.full((capacity, 3), np.nan, np_dtype), np.full(pairs, -5, np.int64)]
    graph = ([np.full(capacity, -5, np.int32), np.full(capacity, -5, np.int32), np.full(n + 1, -5, np.int64)]
             if with_graph else [None] * 3)
    perm_t = np.full(capacity, -7, np.int32)
    call(getattr(libraries[dtype], f"place_{suffix}"),
         [keep.numpy(), rank.numpy(), sender.numpy(), receiver.numpy(), vectors.numpy(), list_rowptr.numpy(), None,
          pad.numpy(), pairs, n, capacity, ctypes.c_int(int(with_graph)), *outs, *graph,
          perm_t if with_graph else None])
    assert (perm_t == -7).all(), "without reverses edge_place leaves perm_t to the caller"
    t = [torch.from_numpy(a) for a in outs]
    got = [*t[:4], rank[-1] if pairs else torch.tensor(0), t[4]]
    if with_graph:
        sender32 = torch.from_numpy(graph[0])
        rowptr_t, perm = el._sender_transpose(sender32, n)
        got += [sender32, torch.from_numpy(graph[1]), torch.from_numpy(graph[2]), perm,
                torch.zeros(0, dtype=torch.int32), rowptr_t]
    _assert_full(got, _full(_listed_reference(sender, receiver, vectors, count_t, n, capacity, pad, with_graph, mask)))


def _assert_full(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    _assert_equal(got[:10], want[:10])
    assert len(got) == len(want)
    for name, a, b in zip(("perm", "rowptr_t"), got[10:], want[10:]):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu(), b.cpu()), name


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("with_graph", [True, False])
@pytest.mark.parametrize("pairs, count, capacity", LISTS)
def test_layout_listed_on_the_cpu_is_the_torch_expression(with_graph, pairs, count, capacity, masked) -> None:
    sender, receiver, vectors, count_t, n = _listed(pairs, count, torch.float64)
    pad = torch.tensor([7.4, 0.0, 0.0], dtype=torch.float64)
    mask = _mask(pairs, masked)
    layout = el.layout_listed(sender, receiver, vectors, count_t, n, capacity, pad, with_graph, mask)
    _assert_full(_full(layout), _full(_listed_reference(sender, receiver, vectors, count_t, n, capacity, pad,
                                                        with_graph, mask)))


@pytest.mark.cuda
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("with_graph", [True, False])
@pytest.mark.parametrize("pairs, count, capacity", LISTS)
def test_layout_listed_on_cuda_equals_the_torch_expression(dtype, with_graph, pairs, count, capacity, masked) -> None:
    sender, receiver, vectors, count_t, n = _listed(pairs, count, dtype)
    pad = torch.tensor([2 * CUTOFF + 1, 0.0, 0.0], dtype=dtype)
    mask = _mask(pairs, masked)
    want = _full(_listed_reference(sender, receiver, vectors, count_t, n, capacity, pad, with_graph, mask))
    cuda = [t.cuda() for t in (sender, receiver, vectors, count_t)]
    layout = el.layout_listed(*cuda, n, capacity, pad.cuda(), with_graph, None if mask is None else mask.cuda())
    assert layout.sender.is_cuda
    _assert_full(_full(layout), want)
    selected = torch.arange(pairs, device="cuda") < cuda[3]
    selected = selected if mask is None else selected & mask.cuda()
    _assert_full(_full(el.layout_edges(selected, cuda[0], cuda[1], cuda[2], n, capacity, pad.cuda(), with_graph)),
                 want)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_layout_listed_captures_in_a_cuda_graph(dtype) -> None:
    pairs, capacity = 300, 300
    sender, receiver, vectors, count_t, n = (t.cuda() if isinstance(t, torch.Tensor) else t
                                             for t in _listed(pairs, 200, dtype, n=57))
    pad = torch.tensor([2 * CUTOFF + 1, 0.0, 0.0], dtype=dtype, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture: the kernel loads, the allocator has its blocks
        el.layout_listed(sender, receiver, vectors, count_t, n, capacity, pad, True)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layout = el.layout_listed(sender, receiver, vectors, count_t, n, capacity, pad, True)
    for count, seed in ((250, 1), (0, 2), (300, 3), (120, 4)):
        new = _listed(pairs, count, dtype, n=57, seed=seed)
        for static, fresh in zip((sender, receiver, vectors, count_t), new[:4]):
            static.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        _assert_full(_full(layout), _full(_listed_reference(*new, capacity, pad.cpu(), True)))
