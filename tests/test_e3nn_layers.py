"""The plain-torch stand-ins for e3nn's Linear and FullyConnectedNet against e3nn, in FP64."""

from __future__ import annotations

import pytest
import torch
from e3nn import o3
from e3nn.nn import FullyConnectedNet

from cgforge.patches.e3nn_layers import FoldedMLP, SplitLinear, swap_in, swap_out

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


@pytest.mark.parametrize("irreps_in, irreps_out", LINEARS[:3])  # gradgradcheck: small ones
def test_split_linear_in_row_chunks_equals_one_pass(irreps_in: str, irreps_out: str, monkeypatch) -> None:
    """Frozen weights and a wide input: rows in chunks (here 3 rows each, 11 rows), values and first and second
    derivatives as the one-pass map; a layer whose weights need a gradient is never chunked."""
    import cgforge.patches.e3nn_layers as layers

    torch.manual_seed(2)
    linear = o3.Linear(irreps_in, irreps_out).double()
    stand_in = SplitLinear.wrap(linear)
    row_bytes = max(o3.Irreps(irreps_in).dim, o3.Irreps(irreps_out).dim) * 8
    x = _inputs(o3.Irreps(irreps_in).dim, seed=3)
    want = stand_in(x)  # weights need a gradient: one pass
    gx_want, gw_want = torch.autograd.grad(want, [x, stand_in.weight], torch.ones_like(want))
    monkeypatch.setattr(layers, "CHUNKED_ABOVE_BYTES", 0)
    monkeypatch.setattr(layers, "CHUNK_BYTES", 3 * row_bytes)
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
