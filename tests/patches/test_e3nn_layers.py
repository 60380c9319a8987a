"""The plain-torch stand-ins for e3nn's Linear and FullyConnectedNet against e3nn, in FP64."""

from __future__ import annotations

import pytest
import torch
from e3nn import o3
from e3nn.nn import FullyConnectedNet

from cgforge.kernels import RowPolicy
from cgforge.patches.e3nn_layers import (
    FoldedMLP,
    Segments,
    SplitLinear,
    from_segments,
    swap_in,
    swap_out,
    to_segments,
)

LINEARS = [
    ("8x0e+8x1o+4x2e", "8x0e+8x1o+4x3o"),  # 4x3o has no input: zeros
    ("16x0e", "4x0e"),  # one input irrep: no split
    ("3x0e+5x1o+2x1o+3x2e+1x3o", "4x1o+2x0e+3x2e+2x1o"),  # repeated irreps, shuffled order
    ("128x0e+128x1o+128x1e+128x2e", "128x0e+128x1o+128x2e"),
]


def _inputs(dim: int, batch: int = 11, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, dim, generator=g, dtype=torch.float64, requires_grad=True)


def _backward_node_names(output: torch.Tensor) -> list[str]:
    """The class names of every autograd node in ``output``'s graph."""
    seen, stack, names = set(), [output.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        stack.extend(child for child, _ in node.next_functions)
    return names


@pytest.mark.parametrize("irreps_in, irreps_out", LINEARS)
def test_split_linear_equals_e3nn(irreps_in: str, irreps_out: str) -> None:
    torch.manual_seed(1)
    linear = o3.Linear(irreps_in, irreps_out).double()
    stand_in = SplitLinear.wrap(linear)
    assert stand_in is not None
    assert list(stand_in.state_dict()) == list(linear.state_dict())
    x = _inputs(o3.Irreps(irreps_in).dim)
    want, got = linear(x), stand_in(x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(want)
    gx_want, gw_want = torch.autograd.grad(want, [x, linear.weight], grad)
    gx_got, gw_got = torch.autograd.grad(got, [x, stand_in.weight], grad)
    torch.testing.assert_close(gx_got, gx_want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gw_got, gw_want, rtol=1e-12, atol=1e-12)
    # Batch dimensions pass through, as e3nn's
    x3 = x.detach().reshape(1, 11, -1)
    torch.testing.assert_close(stand_in(x3), linear(x3), rtol=1e-12, atol=1e-12)


def test_split_linear_reads_its_input_through_one_backward_node() -> None:
    """e3nn's narrow-per-irrep makes one full-width gradient per irrep; the stand-in has one split."""
    linear = o3.Linear("8x0e+8x1o+8x2e+8x3o", "8x0e+8x1o+8x2e+8x3o").double().requires_grad_(False)
    x = _inputs(o3.Irreps("8x0e+8x1o+8x2e+8x3o").dim)  # only x needs a gradient: every slice is of x
    def slices(names: list[str]) -> int:
        return sum(name.startswith(("SliceBackward", "NarrowBackward")) for name in names)

    assert slices(_backward_node_names(linear(x).sum())) >= 4  # the pattern replaced (if e3nn changes: look again)
    names = _backward_node_names(SplitLinear.wrap(linear)(x).sum())
    assert slices(names) == 0 and sum(name.startswith("SplitWithSizesBackward") for name in names) == 1


@pytest.mark.parametrize("irreps_in, irreps_out", LINEARS)
def test_split_linear_kernel_plan_is_the_map_and_its_transpose(irreps_in: str, irreps_out: str) -> None:
    """The irreps_linear kernel's plan of a frozen SplitLinear, checked on the CPU by running its launches as
    map_reference: the forward is e3nn's Linear, the backward launch autograd's grad x."""
    from cgforge.kernels.irreps_linear import map_reference

    torch.manual_seed(2)
    linear = o3.Linear(irreps_in, irreps_out).double()
    stand_in = SplitLinear.wrap(linear, kernel_max_channels=1 << 30).requires_grad_(False)  # every map of LINEARS
    m, forward, backward = stand_in.build_kernel_plan(torch.float64, torch.device("cpu"))
    assert forward.row_index is None and backward.row_index is None
    x = _inputs(o3.Irreps(irreps_in).dim).detach().requires_grad_()
    want = linear(x)
    torch.testing.assert_close(map_reference(x.detach(), m, forward.blocks), want, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(want)
    (gx_want,) = torch.autograd.grad(want, x, grad)
    torch.testing.assert_close(map_reference(grad, m.transpose(), backward.blocks), gx_want, rtol=1e-12, atol=1e-12)
    assert stand_in.kernel_plan(x) is None  # off CUDA: the GEMMs


def test_split_linear_keeps_gemms_for_large_maps() -> None:
    """The tuning's rule, passed down by value: blocks 8 x 8 and 12 x 4 take the kernel from 12 channels on; the
    default rule (KernelTuning's) is the modules' default, and patching a model passes the tuning's to its linears."""
    from cgforge.kernels import KernelTuning
    from cgforge.patches import e3nn_layers

    linear = o3.Linear("8x0e+12x1o", "8x0e+4x1o")
    for channels, plan in ((11, False), (12, True), (0, False)):
        stand_in = SplitLinear.wrap(linear, kernel_max_channels=channels)
        assert (stand_in.build_kernel_plan(torch.float32, torch.device("cpu")) is not None) == plan
    assert SplitLinear.wrap(linear).kernel_max_channels == KernelTuning().linear_kernel_max_channels == 32
    model = torch.nn.Sequential(o3.Linear("8x0e+12x1o", "8x0e+4x1o"))
    assert e3nn_layers.swap_in(model, kernel_max_channels=7) == 1 and model[0].kernel_max_channels == 7


def test_split_linear_scales_frozen_weights_once_not_per_call() -> None:
    """Frozen weights: the path blocks times their path weights are made once per weight version (each multiply
    was a kernel in every MD step); a weight changed in place is seen; trainable weights keep the multiply."""
    import torch.utils._python_dispatch as dispatch

    class Multiplies(dispatch.TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
            Multiplies.count += func is torch.ops.aten.mul.Tensor
            return func(*args, **(kwargs or {}))

    irreps = "4x0e+4x1o+4x2e"
    linear = o3.Linear(irreps, irreps).double()
    stand_in = SplitLinear.wrap(linear)
    x = _inputs(o3.Irreps(irreps).dim).detach()
    stand_in.requires_grad_(False)
    stand_in(x)  # makes the blocks
    with Multiplies():
        got = stand_in(x)
    assert Multiplies.count == 0
    torch.testing.assert_close(got, linear(x), rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        stand_in.weight.mul_(2.0)  # in place: a new version
    torch.testing.assert_close(stand_in(x), 2 * got, rtol=1e-12, atol=1e-12)
    stand_in.requires_grad_(True)
    Multiplies.count = 0
    with Multiplies():
        stand_in(x)
    assert Multiplies.count == 3  # one per path


@pytest.mark.parametrize("irreps_in, irreps_out", [  # gradgradcheck: small ones; 7-11 s but for the smallest
    case if case == LINEARS[1] else pytest.param(*case, marks=pytest.mark.slow) for case in LINEARS[:3]])
def test_split_linear_in_row_chunks_equals_one_pass(irreps_in: str, irreps_out: str) -> None:
    """Frozen weights and a wide input: rows in chunks (here 3 rows each, 11 rows), values and first and second
    derivatives as the one-pass map; a layer whose weights need a gradient is never chunked."""
    torch.manual_seed(2)
    linear = o3.Linear(irreps_in, irreps_out).double()
    stand_in = SplitLinear.wrap(linear)
    row_bytes = max(o3.Irreps(irreps_in).dim, o3.Irreps(irreps_out).dim) * 8
    x = _inputs(o3.Irreps(irreps_in).dim, seed=3)
    want = stand_in(x)  # weights need a gradient: one pass
    gx_want, gw_want = torch.autograd.grad(want, [x, stand_in.weight], torch.ones_like(want))
    stand_in.rows = RowPolicy(chunk_bytes=3 * row_bytes, chunked_above_bytes=0, map_into_above_bytes=0)
    assert stand_in.chunk_rows(x) is None  # still: the weights' gradient needs every row at once
    stand_in.requires_grad_(False)
    assert stand_in.chunk_rows(x) == 3
    got = stand_in(x)
    assert any("_RowChunkedMap" in name for name in _backward_node_names(got.sum()))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    (gx_got,) = torch.autograd.grad(got, [x], torch.ones_like(got))
    torch.testing.assert_close(gx_got, gx_want, rtol=1e-12, atol=1e-12)
    torch.autograd.gradcheck(stand_in, (x,))
    torch.autograd.gradgradcheck(stand_in, (x,))
    assert gw_want.abs().sum() > 0  # the unchunked weight gradient was a real one


def test_split_linear_takes_map_into_for_frozen_inputs_from_a_size_on() -> None:
    """The rule by input bytes (the layer's ``RowPolicy``): below map_into_above_bytes the autograd map, from it one
    map_into chunk of all rows (values and gradient as the map), above chunked_above_bytes chunks; weights that need
    a gradient, never."""
    torch.manual_seed(4)
    linear = o3.Linear("4x0e+4x1o", "4x0e+4x1o+4x2e").double()
    x = _inputs(o3.Irreps("4x0e+4x1o").dim, seed=5)  # 11 rows
    total = x.shape[0] * o3.Irreps("4x0e+4x1o+4x2e").dim * 8
    assert SplitLinear.wrap(linear).rows == RowPolicy() and total < RowPolicy().map_into_above_bytes  # the default
    stand_in = SplitLinear.wrap(linear, rows=RowPolicy(map_into_above_bytes=total))
    want = stand_in(x)
    (gx_want,) = torch.autograd.grad(want, [x], torch.ones_like(want))
    assert stand_in.chunk_rows(x) is None  # the weights need a gradient
    stand_in.requires_grad_(False)
    assert stand_in.chunk_rows(x) == x.shape[0]  # from the size on: one chunk of every row
    assert stand_in.chunk_rows(x[:-1]) is None  # below it: the map
    got = stand_in(x)
    assert any("_RowChunkedMap" in name for name in _backward_node_names(got.sum()))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    (gx_got,) = torch.autograd.grad(got, [x], torch.ones_like(got))
    torch.testing.assert_close(gx_got, gx_want, rtol=1e-12, atol=1e-12)
    stand_in.rows = RowPolicy(chunk_bytes=total // 2, chunked_above_bytes=total - 1, map_into_above_bytes=total)
    assert stand_in.chunk_rows(x) == x.shape[0] // 2  # above chunked_above_bytes: chunks


@pytest.mark.parametrize("irreps_in, irreps_out", LINEARS)
def test_split_linear_map_into_writes_the_map_and_its_transpose_in_place(irreps_in: str, irreps_out: str) -> None:
    """map_into (the row paths' frozen first-order pass) equals the map and its vector-Jacobian product, written
    into columns of a wider NaN-filled tensor: nothing outside them touched, no stale value read (beta 0)."""
    torch.manual_seed(4)
    linear = o3.Linear(irreps_in, irreps_out).double()
    stand_in = SplitLinear.wrap(linear).requires_grad_(False)
    d_in, d_out = o3.Irreps(irreps_in).dim, o3.Irreps(irreps_out).dim
    x = _inputs(d_in, seed=5).detach()
    wide = torch.full((11, d_out + 5), float("nan"), dtype=torch.float64)
    stand_in.map_into(x, wide[:, 2:2 + d_out])
    torch.testing.assert_close(wide[:, 2:2 + d_out], linear(x), rtol=1e-12, atol=1e-12)
    assert wide[:, :2].isnan().all() and wide[:, 2 + d_out:].isnan().all()
    g = _inputs(d_out, seed=6).detach()
    xg = x.clone().requires_grad_()
    (want,) = torch.autograd.grad(linear(xg), xg, g)
    got = torch.full((11, d_in), float("nan"), dtype=torch.float64)
    stand_in.map_into(g, got, transpose=True)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    with torch.no_grad():  # new weights (a new version): the cached scaled blocks follow
        stand_in.weight.mul_(-2.0)
    stand_in.map_into(x, wide[:, 2:2 + d_out])
    torch.testing.assert_close(wide[:, 2:2 + d_out], stand_in(x), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="map_into"):
        stand_in.map_into(x, torch.empty(11, d_out + 1, dtype=torch.float64))
    del stand_in.__dict__["_scaled"]  # as a SplitLinear pickled before the cache existed: the class default
    stand_in.map_into(x, wide[:, 2:2 + d_out])
    torch.testing.assert_close(wide[:, 2:2 + d_out], stand_in(x), rtol=1e-12, atol=1e-12)


# MACE's second linear's sides in small: 1o, 2e, 3o blocks of several muls at shuffled columns; columns 0-1, 36-39
# and 108-109 are no block's
SEGMENTS = Segments(((2, 3, 3), (11, 2, 5), (40, 4, 7), (68, 8, 5), (21, 5, 3)))
SEGMENT_WIDTH = 110


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_segments_move_each_block_to_its_component_major_matrix_and_back(dtype: torch.dtype) -> None:
    """to_segments: block k's [rows * d, mul] matrix holds x[n, c + u * d + i] at (n * d + i, u), in one buffer
    at rows * offsets[k]; from_segments puts every value back into strided rows and touches no other column."""
    rows = 6
    x = torch.randn(rows, SEGMENT_WIDTH + 3, dtype=dtype)[:, 2:2 + SEGMENT_WIDTH]  # strided rows
    buffer, views = to_segments(x, SEGMENTS)
    assert buffer.shape == (rows * SEGMENTS.width,) and SEGMENTS.width == 9 + 10 + 28 + 40 + 15
    for (c, m, d), v, o in zip(SEGMENTS.blocks, views, SEGMENTS.offsets, strict=True):
        assert v.data_ptr() == buffer[rows * o:].data_ptr() and v.shape == (rows * d, m)
        want = torch.stack([torch.stack([x[n, c + u * d + i] for u in range(m)]) for n in range(rows)
                            for i in range(d)])
        torch.testing.assert_close(v, want, rtol=0, atol=0)
    wide = torch.full((rows, SEGMENT_WIDTH + 3), float("nan"), dtype=dtype)
    from_segments(buffer, SEGMENTS, wide[:, 1:1 + SEGMENT_WIDTH])
    covered = torch.zeros(SEGMENT_WIDTH + 3, dtype=torch.bool)
    for c, m, d in SEGMENTS.blocks:
        covered[1 + c:1 + c + m * d] = True
    torch.testing.assert_close(wide[:, covered], x[:, covered[1:1 + SEGMENT_WIDTH]], rtol=0, atol=0)
    assert wide[:, ~covered].isnan().all() and Segments(()).width == 0


# MACE's interaction linear in small: the convolution's 10 irreps (several of each l > 0) -> one of each l
MACE_LIKE = ("4x0e+4x1o+4x2e+4x3o+4x1o+4x0e+4x2e+4x1o+4x3o+4x2e", "4x0e+4x1o+4x2e+4x3o")


def _map_into_derivatives(module: torch.nn.Module, x: torch.Tensor, weights: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, grad x, second derivative) of a loss quadratic in ``module(x)`` (grad x depends on x)."""
    out = module(x)
    (grad,) = torch.autograd.grad((out.square() * weights).sum(), x, create_graph=True)
    (second,) = torch.autograd.grad((grad * grad).sum(), x)
    return out.detach(), grad.detach(), second


def test_map_into_moves_each_vector_irrep_once_and_equals_e3nn_to_second_derivatives(monkeypatch) -> None:
    """Through map_into (every frozen input, rows in chunks) the MACE-shaped linear gives e3nn's values, grad x
    and second derivative in FP64; each side's l > 0 irreps move once per call, however many paths read them
    (the transposed map reads each of the 3 output vector irreps by 2-3 paths)."""
    import cgforge.patches.e3nn_layers as layers

    torch.manual_seed(8)
    linear = o3.Linear(*MACE_LIKE).double().requires_grad_(False)
    # 4 rows of 160 a chunk: 11 rows in 3 chunks
    stand_in = SplitLinear.wrap(linear, rows=RowPolicy(chunk_bytes=4 * 160 * 8, chunked_above_bytes=0,
                                                       map_into_above_bytes=0))
    moved: list[Segments] = []

    def recording(x: torch.Tensor, segments: Segments):  # noqa: ANN202
        moved.append(segments)
        return to_segments(x, segments)

    monkeypatch.setattr(layers, "to_segments", recording)
    x = _inputs(o3.Irreps(MACE_LIKE[0]).dim, seed=3)
    weights = torch.randn(11, o3.Irreps(MACE_LIKE[1]).dim, dtype=torch.float64)
    assert stand_in.chunk_rows(x) == 4
    got = _map_into_derivatives(stand_in, x, weights)
    assert any("_RowChunkedMap" in name for name in _backward_node_names(stand_in(x).sum()))
    want = _map_into_derivatives(linear, x, weights)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-11, atol=1e-11)
    sides = {len(m.blocks) for m in moved}
    assert sides == {8, 3}  # forward: the 8 vector inputs; transposed: the 3 vector outputs, each once
    assert all(len({c for c, _, _ in m.blocks}) == len(m.blocks) for m in moved)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_map_into_equals_e3nn(dtype: torch.dtype) -> None:
    """On CUDA a frozen 128-channel SplitLinear (GEMMs, not the irreps_linear kernel) above the map_into size
    (RowPolicy.map_into_above_bytes) moves its vector irreps through segments: e3nn's values, grad x and second
    derivative, also written into columns of a wider tensor."""

    torch.manual_seed(6)
    wide_irreps = tuple(" + ".join(f"128x{ir}" for ir in side.replace("4x", "").split("+")) for side in MACE_LIKE)
    linear = o3.Linear(*wide_irreps).to(device="cuda", dtype=dtype).requires_grad_(False)
    stand_in = SplitLinear.wrap(linear)
    d_in, d_out = o3.Irreps(wide_irreps[0]).dim, o3.Irreps(wide_irreps[1]).dim
    rows = -(-RowPolicy().map_into_above_bytes // (d_in * dtype.itemsize)) + 3
    x = torch.randn(rows, d_in, device="cuda", dtype=dtype, requires_grad=True)
    assert stand_in.kernel_plan(x) is None and stand_in.chunk_rows(x) is not None
    weights = torch.randn(rows, d_out, device="cuda", dtype=dtype)
    tol = 1e-10 if dtype == torch.float64 else 2e-4
    for got, want in zip(_map_into_derivatives(stand_in, x, weights), _map_into_derivatives(linear, x, weights),
                         strict=True):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    wide = torch.full((rows, d_out + 4), float("nan"), device="cuda", dtype=dtype)
    stand_in.map_into(x.detach(), wide[:, 1:1 + d_out])
    torch.testing.assert_close(wide[:, 1:1 + d_out], linear(x).detach(), rtol=tol, atol=tol)
    assert wide[:, 0].isnan().all() and wide[:, 1 + d_out:].isnan().all()


def test_row_map_transpose_of_a_linear_with_map_into_equals_autograds() -> None:
    """The row paths' backward through a map_into linear (its transpose applied directly) equals the generic
    vector-Jacobian product at zero rows, range by range; under grad mode (a double backward) it keeps autograd."""
    from cgforge.kernels.convolution.table_rows import map_rows, row_map_transpose

    torch.manual_seed(7)
    irreps_in, irreps_out = LINEARS[2]
    stand_in = SplitLinear.wrap(o3.Linear(irreps_in, irreps_out).double()).requires_grad_(False)
    d_in, d_out = o3.Irreps(irreps_in).dim, o3.Irreps(irreps_out).dim
    g = _inputs(d_out, seed=8).detach()
    ranges = [(0, 4), (4, 9), (9, 11)]
    want = row_map_transpose(lambda rows: stand_in(rows), g, d_in, ranges)  # no map_into: autograd's
    torch.testing.assert_close(row_map_transpose(stand_in, g, d_in, ranges), want, rtol=1e-12, atol=1e-12)
    gg = g.clone().requires_grad_()
    with torch.enable_grad():
        kept = row_map_transpose(stand_in, gg, d_in, ranges)
    assert kept.requires_grad  # a double backward's graph kept
    x = _inputs(d_in, seed=9).detach()
    out = None
    for r0, r1 in ranges:
        with torch.no_grad():
            out = map_rows(stand_in, x[r0:r1], out, r0, 11)
    torch.testing.assert_close(out, stand_in(x), rtol=1e-12, atol=1e-12)


def test_split_linear_declines_biases_and_external_weights() -> None:
    assert SplitLinear.wrap(o3.Linear("4x0e", "4x0e", biases=True)) is None
    assert SplitLinear.wrap(o3.Linear("4x0e", "4x0e", internal_weights=False, shared_weights=False)) is None


@pytest.mark.parametrize(
    "hs, act, kwargs",
    [
        ([8, 64, 64, 64, 40], torch.nn.functional.silu, {}),
        ([5, 16, 7], torch.tanh, {"variance_in": 2, "variance_out": 3}),
        ([5, 16, 7], torch.nn.functional.silu, {"out_act": True}),
        ([6, 4], None, {}),
    ],
)
def test_folded_mlp_equals_e3nn(hs: list[int], act, kwargs: dict) -> None:
    torch.manual_seed(2)
    net = FullyConnectedNet(hs, act, **kwargs).double()
    folded = FoldedMLP.wrap(net)
    assert folded is not None
    assert list(folded.state_dict()) == list(net.state_dict())
    x = _inputs(hs[0])
    want, got = net(x), folded(x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # first and second derivatives (training with forces differentiates the input gradient again)
    weights = [layer.weight for layer in net.children()]
    (gx_want,) = torch.autograd.grad(want.square().sum(), x, create_graph=True)
    (gx_got,) = torch.autograd.grad(got.square().sum(), x, create_graph=True)
    torch.testing.assert_close(gx_got, gx_want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        torch.autograd.grad(gx_got.sum(), weights), torch.autograd.grad(gx_want.sum(), weights), rtol=1e-12, atol=1e-12
    )


def test_swap_in_and_out_round_trip() -> None:
    torch.manual_seed(3)
    model = torch.nn.Sequential(
        o3.Linear("4x0e+4x1o", "4x0e+4x1o"),
        torch.nn.ModuleList([FullyConnectedNet([9, 8, 9], torch.nn.functional.silu)]),
        o3.Linear("4x0e+4x1o", "9x0e", biases=True),  # declined: stays e3nn's
    ).double()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    originals = [model[0], model[1][0], model[2]]
    assert swap_in(model) == 2
    assert isinstance(model[0], SplitLinear) and isinstance(model[1][0], FoldedMLP) and model[2] is originals[2]
    assert list(model.state_dict()) == list(state)
    model.float()
    assert swap_out(model) == 2
    assert [model[0], model[1][0], model[2]] == originals
    assert all(t.dtype == torch.float32 for t in model.state_dict().values() if t.is_floating_point())


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_frozen_split_linear_runs_the_kernel_equal_to_e3nn(dtype: torch.dtype) -> None:
    """On CUDA a frozen SplitLinear takes the irreps_linear kernel: e3nn's numbers, grad x and second derivative
    (the backward of the backward is the map again)."""
    torch.manual_seed(5)
    irreps_in, irreps_out = LINEARS[2]
    linear = o3.Linear(irreps_in, irreps_out).to(device="cuda", dtype=dtype).requires_grad_(False)
    stand_in = SplitLinear.wrap(linear)
    x = _inputs(o3.Irreps(irreps_in).dim, batch=300).detach().to(device="cuda", dtype=dtype).requires_grad_()
    assert stand_in.kernel_plan(x) is not None
    weights = torch.randn(300, o3.Irreps(irreps_out).dim, device="cuda", dtype=dtype)
    results = []
    for module in (stand_in, linear):
        out = module(x)  # a loss quadratic in out: grad x depends on x
        (grad,) = torch.autograd.grad((out.square() * weights).sum(), x, create_graph=True)
        (second,) = torch.autograd.grad((grad * grad).sum(), x)
        results.append((out.detach(), grad.detach(), second))
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
