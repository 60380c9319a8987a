"""MACE's reshape_irreps with a one-write backward: values and first and second derivatives equal MACE's in FP64, the
state_dict unchanged, swapped in by patch and out by unpatch."""

from __future__ import annotations

import pytest
import torch
from e3nn import o3

mace_tools = pytest.importorskip("mace.modules.irreps_tools")

from cgforge.patches.mace.reshape import BlockReshape  # noqa: E402

IRREPS = ["8x0e+8x1o+8x2e+8x3o", "4x0e+4x0e+4x1o+4x1e+4x2e", "16x0e", "3x2e+3x0e+3x1o"]


@pytest.mark.parametrize("irreps", IRREPS)
def test_block_reshape_equals_maces_to_second_order(irreps: str) -> None:
    original = mace_tools.reshape_irreps(o3.Irreps(irreps))
    stand_in = BlockReshape.wrap(original)
    assert stand_in is not None and dict(stand_in.state_dict()) == dict(original.state_dict())
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, o3.Irreps(irreps).dim, generator=g, dtype=torch.float64, requires_grad=True)
    want, got = original(x), stand_in(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # a permutation: exact
    v = torch.randn(want.shape, generator=g, dtype=torch.float64)
    (gw,) = torch.autograd.grad(want, x, v, create_graph=True)
    (gg,) = torch.autograd.grad(got, x, v, create_graph=True)
    torch.testing.assert_close(gg, gw, rtol=0, atol=0)
    torch.autograd.gradcheck(stand_in, (x,))
    torch.autograd.gradgradcheck(stand_in, (x,))
    strided = torch.randn(o3.Irreps(irreps).dim, 6, generator=g, dtype=torch.float64).t()  # not contiguous
    torch.testing.assert_close(stand_in(strided), original(strided), rtol=0, atol=0)


def test_block_reshape_declines_mixed_multiplicities() -> None:
    assert BlockReshape.wrap(mace_tools.reshape_irreps(o3.Irreps("4x0e+2x1o"))) is None


def test_patch_swaps_reshape_in_and_unpatch_out() -> None:

    from mace_helpers import build_model

    from cgforge.patches import mace as pm

    torch.manual_seed(0)
    model = build_model(r_max=4.0)
    keys = list(model.state_dict())
    pm.patch(model)
    kinds = [type(b.reshape).__name__ for b in model.interactions]
    assert kinds and all(k == "BlockReshape" for k in kinds)
    assert list(model.state_dict()) == keys
    pm.unpatch(model)
    assert all(type(b.reshape).__name__ == "reshape_irreps" for b in model.interactions)



@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_block_reshape_equals_maces_to_second_order(dtype: torch.dtype) -> None:
    """On CUDA, MACE-MP-medium's width: MACE's values and gradient exactly (a non-contiguous gradient and input
    too), and the gradient's derivative in the incoming gradient is the forward map again."""
    irreps = "128x0e+128x1o+128x2e+128x3o"  # MACE-MP-medium's message
    original = mace_tools.reshape_irreps(o3.Irreps(irreps))
    stand_in = BlockReshape.wrap(original)
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(300, o3.Irreps(irreps).dim, generator=g, device="cuda", dtype=dtype, requires_grad=True)
    want, got = original(x), stand_in(x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    v = torch.randn(want.shape, generator=g, device="cuda", dtype=dtype)
    v = v.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()  # strided, as autograd may hand it over
    (gw,) = torch.autograd.grad(want, x, v, create_graph=True)
    (gg,) = torch.autograd.grad(got, x, v, create_graph=True)
    torch.testing.assert_close(gg, gw, rtol=0, atol=0)
    u = torch.randn(gw.shape, generator=g, device="cuda", dtype=dtype)
    (second,) = torch.autograd.grad(gg, v, u)
    torch.testing.assert_close(second, original(u), rtol=0, atol=0)
    strided = x.detach().t().contiguous().t()
    torch.testing.assert_close(stand_in(strided), original(strided), rtol=0, atol=0)
