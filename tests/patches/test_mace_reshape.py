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
