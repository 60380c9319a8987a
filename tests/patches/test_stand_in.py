"""The one stand-in protocol: the self-check policy, the walker, restore, and the audited torch internals."""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest
import torch
from e3nn import o3
from e3nn.nn import FullyConnectedNet
from mace_helpers import build_model

from cgforge.patches import e3nn_layers, stand_in
from cgforge.patches import mace as pm
from cgforge.patches.common import UnsupportedModelError
from cgforge.patches.e3nn_layers import FoldedMLP, SplitLinear
from cgforge.patches.radial_precision import RadialLinear
from cgforge.patches.species_linear import SpeciesSelfConnection
from cgforge.patches.stand_in import StandIn

ROOT = Path(__file__).resolve().parents[2]


def small_model() -> torch.nn.Module:
    torch.manual_seed(3)
    block = torch.nn.Module()
    block.linear = o3.Linear("4x0e+4x1o", "4x0e+4x1o")
    block.mlp = FullyConnectedNet([5, 8, 6], torch.nn.functional.silu)
    return torch.nn.Sequential(block).double()


def test_every_module_replacement_is_a_stand_in() -> None:
    from cgforge.patches.nequip.conv import CgforgeTensorProductScatter

    kinds = (SplitLinear, FoldedMLP, RadialLinear, SpeciesSelfConnection, pm.FusedConvTP,
             pm.FusedSymmetricContraction, CgforgeTensorProductScatter)
    for kind in kinds:
        assert issubclass(kind, StandIn) and issubclass(kind, torch.nn.Module), kind
        assert kind.self_check is not StandIn.self_check, f"{kind.__name__} has no self_check"
        assert kind.restore is StandIn.restore, f"{kind.__name__} restores its own way"


def test_a_wrong_stand_in_is_refused_with_a_warning_naming_module_and_error(monkeypatch) -> None:
    model = small_model()
    linear = model[0].linear
    monkeypatch.setattr(SplitLinear, "forward", lambda self, x: x + 1.0)  # deliberately wrong numbers
    with pytest.warns(UserWarning) as record:
        assert e3nn_layers.swap_in(model) == 1
    assert model[0].linear is linear and isinstance(model[0].mlp, FoldedMLP)  # the original kept
    (message,) = [str(w.message) for w in record]
    assert "kept the original 0.linear (Linear)" in message and "SplitLinear" in message
    assert "failed the check at patch time: output differs by" in message and "tolerance 1e-10" in message

    def broken(self, x):
        raise RuntimeError("a broken stand-in")

    monkeypatch.setattr(FoldedMLP, "forward", broken)
    model = small_model()
    with pytest.warns(UserWarning, match=r"0\.mlp \(FullyConnectedNet\).*RuntimeError: a broken stand-in"):
        assert FoldedMLP.wrap(model[0].mlp, "0.mlp") is None
    assert type(model[0].mlp) is FullyConnectedNet


def test_a_nan_or_a_wrong_shape_is_a_mismatch(monkeypatch) -> None:
    model = small_model()
    monkeypatch.setattr(SplitLinear, "forward", lambda self, x: x * float("nan"))
    with pytest.warns(UserWarning, match="output differs by nan"):
        assert SplitLinear.wrap(model[0].linear) is None
    monkeypatch.setattr(SplitLinear, "forward", lambda self, x: x[:, :3])
    with pytest.warns(UserWarning, match=r"output shape \[7, 3\], the original's \[7, 16\]"):
        assert SplitLinear.wrap(model[0].linear) is None


def test_the_check_passes_silently_and_leaves_the_global_rng_alone() -> None:
    model = small_model()
    torch.manual_seed(11)
    state = torch.random.get_rng_state()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert e3nn_layers.swap_in(model) == 2
    assert torch.equal(torch.random.get_rng_state(), state)


def test_a_maker_that_raises_changes_nothing() -> None:
    model = small_model()
    before = [m for m in model.modules()]

    def make(where: str, child: torch.nn.Module):
        if where == "0.linear":
            return SplitLinear(child)
        if where == "0.mlp":
            raise UnsupportedModelError("0.mlp: not this one")
        return None

    with pytest.raises(UnsupportedModelError, match="0.mlp: not this one"):
        stand_in.swap_in(model, make)
    assert [m for m in model.modules()] == before


def test_patch_then_restore_gives_back_the_original_modules_and_the_same_state_dict() -> None:
    torch.set_default_dtype(torch.float64)
    model = build_model()
    modules = dict(model.named_modules())
    keys = list(model.state_dict())
    pm.patch(model)
    assert list(model.state_dict()) == keys
    swapped = {path for path, m in model.named_modules() if isinstance(m, StandIn)}
    assert {"interactions.0.conv_tp", "products.0.symmetric_contractions", "interactions.0.linear"} <= swapped
    model.float()  # .to() replaces the tensors in the stand-ins only: restore must hand them back
    pm.unpatch(model)
    assert list(model.state_dict()) == keys
    assert all(model.get_submodule(path) is module for path, module in modules.items())
    assert all(t.dtype == torch.float32 for t in model.state_dict().values() if t.is_floating_point())
    assert not any(hasattr(block, "conv_fusion") for block in model.interactions)


def _private_torch_attributes(path: Path) -> list[str]:
    names = {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "_forward_pre_hooks",
             "_forward_hooks", "_version", "_base"}
    return [f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}" for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute) and node.attr in names]


def test_torch_internals_are_touched_in_one_audited_module() -> None:
    offenders = []
    for path in sorted((ROOT / "cgforge" / "patches").rglob("*.py")):
        if path.name != "torch_internals.py":
            offenders += _private_torch_attributes(path)
    assert not offenders, offenders
    assert _private_torch_attributes(ROOT / "cgforge" / "patches" / "torch_internals.py")  # the test can fail


def test_a_mace_convolution_that_fails_its_check_stays_e3nn_and_unfused(monkeypatch) -> None:
    from mace_helpers import assert_same_outputs, evaluate, water_dimer

    torch.set_default_dtype(torch.float64)
    plain = build_model()
    ref = evaluate(plain, water_dimer())
    original = pm.FusedConvTP.self_check
    monkeypatch.setattr(pm.FusedConvTP, "self_check", lambda self, g: (lambda got, want: (got + 1, want))(
        *original(self, g)))
    with pytest.warns(UserWarning) as record:
        model = pm.patch(build_model())
    kept = sorted(str(w.message).split(" (")[0] for w in record if "kept the original" in str(w.message))
    assert kept == [f"cgforge: kept the original interactions.{i}.conv_tp" for i in range(len(model.interactions))]
    assert all(type(b.conv_tp) is o3.TensorProduct and not hasattr(b, "conv_fusion") for b in model.interactions)
    assert isinstance(model.products[0].symmetric_contractions, pm.FusedSymmetricContraction)
    assert_same_outputs(evaluate(model, water_dimer()), ref, tol=1e-10)
