"""A kernel tuning (``KernelTuning``) given to the loading path reaches the kernels of the patched model:
``families.load``, the runtime's ``load`` / ``load_module`` and the ``Calculator`` (issue 36); what it
contradicts is refused before any model loads (CPU: the modules' tuning values are compared)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from mace_helpers import build_model, rel_err, water_dimer

from cgforge.kernels import KernelTuning, SCTuning, TPTuning
from cgforge.patches import families
from cgforge.patches.mace import FusedConvTP, FusedSymmetricContraction
from cgforge.plugin import Calculator
from cgforge.plugin.runtime import potential as runtime

TUNED = KernelTuning(tp=TPTuning(loop_order="edges", backward_min_blocks=0), sc=SCTuning(block=64, chunk=8))
PATCHED_FILE = Path(__file__).resolve().parents[1] / "data" / "water-mace-patched-c54a3be.model"


def _mace_tunings(model: torch.nn.Module) -> tuple[list, list]:
    """(the convolutions' TPTuning, the symmetric contractions' SCTuning) of a patched MACE model."""
    convs = [m.conv.tuning for m in model.modules() if isinstance(m, FusedConvTP)]
    contractions = [m.tuning for m in model.modules() if isinstance(m, FusedSymmetricContraction)]
    return convs, contractions


@pytest.fixture
def tiny() -> torch.nn.Module:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield build_model(r_max=4.0)
    finally:
        torch.set_default_dtype(previous)


def test_families_load_builds_a_modules_kernels_with_the_tuning(tiny) -> None:
    model = families.load(tiny, "cpu", tuning=TUNED)
    assert model is tiny
    assert _mace_tunings(model) == ([TUNED.tp] * 2, [TUNED.sc] * 2)
    again = families.load(build_model(r_max=4.0), "cpu")  # None: the defaults
    assert _mace_tunings(again) == ([TPTuning()] * 2, [SCTuning()] * 2)


def test_a_file_saved_patched_is_patched_again_with_the_tuning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kept = families.load(PATCHED_FILE)
        tuned = families.load(PATCHED_FILE, tuning=TUNED)
    convs, _ = _mace_tunings(kept)
    assert len(convs) == 2 and TUNED.tp not in convs  # saved before tunings existed: kept as saved
    assert _mace_tunings(tuned) == ([TUNED.tp] * 2, [TUNED.sc] * 2)


def test_calculator_patches_with_the_tuning_also_on_a_cpu(tiny) -> None:
    calc = Calculator(tiny, device="cpu", tuning=TUNED, warmup=False)
    assert calc.patched and calc.tuning is TUNED  # patch=None on a CPU: the model's own code, unless tuned
    assert _mace_tunings(calc.model) == ([TUNED.tp] * 2, [TUNED.sc] * 2)
    plain = Calculator(build_model(r_max=4.0), device="cpu", warmup=False)
    assert not plain.patched and plain.tuning is None
    atoms = water_dimer(0.3)
    tuned_forces = calc.get_forces(atoms)
    assert rel_err(tuned_forces, plain.get_forces(atoms)) < 1e-10  # the tuned kernels compute the same model


def test_runtime_load_and_load_module_pass_the_tuning_on() -> None:
    potential = runtime.load("mace", "cpu", tuning=TUNED, warmup=False)
    assert potential.patched and _mace_tunings(potential.model) == ([TUNED.tp] * 2, [TUNED.sc] * 2)
    module = runtime.load_module("mace", "cpu", tuning=KernelTuning(tp=TPTuning(loop_order="segments")))
    assert _mace_tunings(module)[0] == [TPTuning(loop_order="segments")] * 2


def test_nequip_kernels_take_the_tp_part(nequip_state) -> None:
    from cgforge.patches.nequip.conv import CgforgeTensorProductScatter

    module = runtime.load_module("nequip", "cpu", tuning=TUNED)
    convs = [m for m in module.modules() if isinstance(m, CgforgeTensorProductScatter)]
    assert convs and all(m.tuning == TUNED.tp and m.conv.tuning == TUNED.tp for m in convs)


@pytest.mark.parametrize("load", [
    lambda **kw: families.load("missing.model", "cpu", **kw),
    lambda **kw: runtime.load("missing.model", "cpu", **kw),
    lambda **kw: runtime.load_module("missing.model", "cpu", **kw),
    lambda **kw: Calculator("missing.model", device="cpu", **kw),
], ids=["families.load", "runtime.load", "runtime.load_module", "Calculator"])
def test_tuning_errors_come_before_the_file_is_looked_at(load) -> None:
    # a missing file would raise FileNotFoundError: these errors are raised first
    with pytest.raises(ValueError, match=r"tuning and patch=False"):
        load(patch=False, tuning=TUNED)
    with pytest.raises(TypeError, match=r"tuning: expected a cgforge.kernels.KernelTuning or None, got TPTuning "
                                        r"\(wrap it: KernelTuning\(tp=...\)\)"):
        load(tuning=TPTuning())
    with pytest.raises(TypeError, match=r"tuning: .* got dict$"):
        load(tuning={"tp": {}})


def test_a_module_patched_already_refuses_another_tuning(tiny) -> None:
    families.load(tiny, "cpu")  # patched with the defaults
    with pytest.raises(ValueError, match=r"the module was patched already \(its kernels carry the tuning"):
        families.load(tiny, "cpu", tuning=TUNED)
    with pytest.raises(ValueError, match=r"patched already"):
        Calculator(tiny, device="cpu", tuning=TUNED, warmup=False)
    assert _mace_tunings(tiny) == ([TPTuning()] * 2, [SCTuning()] * 2)  # untouched
    calc = Calculator(tiny, device="cpu", tuning=KernelTuning(), warmup=False)  # the defaults it has: fine
    assert calc.patched and calc.tuning == KernelTuning()
