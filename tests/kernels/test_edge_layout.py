"""The step's edge layout kernels (cgforge.kernels.edge_layout): the CUDA source compiles (NVRTC, no GPU needed) and
runs on the CPU as C++ (``host_cuda``) equal to the torch expression it replaces (``edges_within`` and
``layout_edges`` with a topology, cgforge.plugin.runtime): the same mask, slots, padding, row pointers and
transpose, with room to spare, with none and on overflow, on a list padded past its pairs; on a GPU the same."""

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
