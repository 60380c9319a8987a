"""MACE's edge harmonics by cgforge's kernel (``KernelTuning(harmonics=True)``, the default): e3nn's energies, forces,
stress and second derivatives in FP64 (the CPU runs the kernel's torch reference; the CUDA kernel's own tests are in
tests/kernels/test_harmonics.py), and a patch that goes back out cleanly."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from e3nn import o3
from mace_helpers import assert_same_outputs, batch_for, build_model, evaluate, water_dimer

from cgforge.kernels import KernelTuning
from cgforge.patches import mace as pm
from cgforge.patches.harmonics import KernelHarmonics

HARMONICS = KernelTuning(harmonics=True)


@pytest.mark.slow
def test_patched_with_the_kernel_harmonics_gives_e3nns_outputs_fp64() -> None:
    model = build_model(hidden="8x0e+8x1o+8x2e", max_ell=3)
    ref = evaluate(model, water_dimer())
    patched = pm.patch(copy.deepcopy(model), tuning=HARMONICS)
    assert isinstance(patched.spherical_harmonics, KernelHarmonics)
    assert patched.spherical_harmonics.irreps_out == model.spherical_harmonics.irreps_out
    assert list(patched.state_dict()) == list(model.state_dict())
    assert_same_outputs(evaluate(patched, water_dimer()), ref, tol=1e-10)
    assert isinstance(pm.patch(copy.deepcopy(model)).spherical_harmonics, KernelHarmonics)  # on by default
    e3nn_kept = pm.patch(copy.deepcopy(model), tuning=KernelTuning(harmonics=False))
    assert type(e3nn_kept.spherical_harmonics) is o3.SphericalHarmonics


def test_second_derivatives_follow_e3nn() -> None:
    """Forces made with create_graph (training=True), then the gradient of sum(F^2): through the harmonics' second
    derivative."""
    model = build_model(hidden="8x0e+8x1o", max_ell=2)
    results = []
    for m in (model, pm.patch(copy.deepcopy(model), tuning=HARMONICS)):
        batch = batch_for(m, water_dimer())
        forces = m(batch, training=True)["forces"]
        (grad,) = torch.autograd.grad(forces.square().sum(), batch["positions"])
        results.append((forces.detach(), grad))
    for ours, theirs in zip(results[1], results[0]):
        torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-10)


def test_a_loaded_model_registers_its_harmonics_for_the_ops(monkeypatch) -> None:
    """The custom ops know the polynomials by a key registered in the process; a model saved and loaded in another
    (here: the registry emptied) registers them again on load, so its forward (which torch.compile traces, and so
    must not register) finds them."""
    from cgforge.kernels import harmonics as kh

    patched = pm.patch(build_model(), tuning=HARMONICS)
    key = patched.spherical_harmonics.key
    buf = io.BytesIO()
    torch.save(patched, buf)
    monkeypatch.setattr(kh, "_REGISTERED", {})
    kh.register.cache_clear()
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert loaded.spherical_harmonics.key == key and kh._REGISTERED[key] == loaded.spherical_harmonics.polys


def test_unpatch_gives_e3nns_module_back() -> None:
    model = pm.unpatch(pm.patch(build_model(), tuning=HARMONICS))
    assert type(model.spherical_harmonics) is o3.SphericalHarmonics
    buf = io.BytesIO()
    torch.save(model, buf)
    assert b"cgforge" not in buf.getvalue()


def test_harmonics_it_cannot_compute_stay_e3nns_and_say_why(caplog) -> None:
    """The kernel computes normalised harmonics only: another module stays e3nn's (right values, the reason logged),
    and the rest of the model is patched."""
    model = build_model()
    model.spherical_harmonics = o3.SphericalHarmonics(model.spherical_harmonics.irreps_out, normalize=False,
                                                      normalization="component")
    ref = evaluate(model, water_dimer())
    with caplog.at_level("INFO", logger="cgforge"):
        patched = pm.patch(copy.deepcopy(model), tuning=HARMONICS)
    assert type(patched.spherical_harmonics) is o3.SphericalHarmonics
    assert "spherical_harmonics keeps e3nn's spherical harmonics" in caplog.text
    assert_same_outputs(evaluate(patched, water_dimer()), ref, tol=1e-10)


def test_the_tuning_reads_and_names_the_switch() -> None:
    assert KernelTuning.from_dict({"harmonics": True}) == HARMONICS
    assert KernelTuning.from_dict({}) == KernelTuning() == HARMONICS  # on by default (measured on an H100)
    assert not KernelTuning.from_dict({"harmonics": False}).harmonics
    assert "harmonics=True" in HARMONICS.describe()
    with pytest.raises(ValueError, match="harmonics"):
        KernelTuning.from_dict({"harmonics": 1})
    with pytest.raises(ValueError, match="harmonics"):
        KernelTuning(harmonics="yes")


def test_the_bundled_nequip_model_takes_the_kernel_harmonics_too() -> None:
    """nequip's packaged model carries its own copy of e3nn: its SphericalHarmonics (``spharm.sh``) is found by name
    and stood in for; energies and forces unchanged (FP64 on the CPU: the reference inside)."""
    from cgforge.plugin import Calculator
    from cgforge.plugin.water import water_box

    atoms = water_box(8, seed=0)
    results = []
    # None: patched with no tuning given, the defaults (the kernel on), as MACE's patch reads them (it was e3nn's
    # module: the GPU's default path ran e3nn's harmonics in NequIP models)
    for tuning in (KernelTuning(harmonics=False), HARMONICS, None):
        calc = Calculator("nequip", device="cpu", **({"patch": True} if tuning is None else {"tuning": tuning}))
        stand_ins = sum(isinstance(m, KernelHarmonics) for m in calc.potential.model.modules())
        assert stand_ins == (1 if (tuning or KernelTuning()).harmonics else 0)
        a = atoms.copy()
        a.calc = calc
        results.append((a.get_potential_energy(), a.get_forces()))
    (e_off, f_off), *on = results
    for e_on, f_on in on:
        assert abs(e_on - e_off) <= 1e-10 * abs(e_off)
        assert abs(f_on - f_off).max() <= 1e-10 * abs(f_off).max()
