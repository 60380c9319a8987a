"""The bundled water models (cgforge/models/): found by ``model_path``, load patched through cgforge, agree
with the unpatched models and with q-SPC/Fw, have conservative forces and conserve energy in a short NVE run.

One fresh box (32 molecules, a seed no training trajectory used, 150 fs of q-SPC/Fw Langevin MD from the
grid start) serves every test. Accuracy bounds come from the held-out test-set errors in cgforge/models/README.md.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

pytest.importorskip("mace")
pytest.importorskip("nequip")

import e3nn  # noqa: E402
from ase import units  # noqa: E402
from ase.md.langevin import Langevin  # noqa: E402
from ase.md.verlet import VelocityVerlet  # noqa: E402
from global_state import preserved_global_state  # noqa: E402
from mace.calculators import MACECalculator  # noqa: E402
from nequip.integrations.ase import NequIPCalculator  # noqa: E402
from oracles import central_difference, displaced  # noqa: E402

import cgforge.patches  # noqa: E402
from cgforge.patches import mace as mace_adapter  # noqa: E402
from cgforge.patches import nequip as nequip_adapter  # noqa: E402
from cgforge.patches.mace import load_mace  # noqa: E402
from cgforge.patches.nequip import load_nequip  # noqa: E402
from cgforge.plugin.runtime import bundled  # noqa: E402
from cgforge.plugin.runtime.bundled import model_path  # noqa: E402
from cgforge.plugin.water import QSPCFwCalculator, water_box  # noqa: E402

KINDS = ("mace", "nequip")

# Held-out test-set RMSEs against q-SPC/Fw (cgforge/models/README.md, "Metrics"): energy meV/atom, forces meV/Å.
# A single fresh box may sit in the tail of the test distribution: allow 3x the RMSE.
TEST_RMSE = {"mace": {"energy": 3.6, "forces": 58.9}, "nequip": {"energy": 1.9, "forces": 70.1}}
ACCURACY_FACTOR = 3.0


@pytest.fixture(scope="module", autouse=True)
def _restore_global_state():
    """nequip's loaders set process-wide state (default dtype, e3nn flags, seeds): undo it afterwards."""
    with preserved_global_state():
        yield


@pytest.fixture(scope="module", autouse=True)
def _restore_global_state():
    """nequip's loaders set process-wide state (default dtype, e3nn flags, seeds): undo it afterwards."""
    dtype = torch.get_default_dtype()
    flags = e3nn.get_optimization_defaults()
    rng = torch.get_rng_state(), np.random.get_state(), random.getstate()
    yield
    torch.set_default_dtype(dtype)
    e3nn.set_optimization_defaults(**flags)
    torch.set_rng_state(rng[0])
    np.random.set_state(rng[1])
    random.setstate(rng[2])


@pytest.fixture(scope="module")
def box():
    """32 q-SPC/Fw water molecules after 150 fs of 300 K Langevin MD from a fresh grid (seed unused in training)."""
    atoms = water_box(32, density=1.0, seed=2024)
    atoms.calc = QSPCFwCalculator()
    rng = np.random.default_rng(2024)
    Langevin(atoms, 0.5 * units.fs, temperature_K=300, friction=0.02 / units.fs, fixcm=False, rng=rng).run(300)
    atoms.calc = None
    return atoms


@pytest.fixture(scope="module")
def reference(box):
    atoms = box.copy()
    atoms.calc = QSPCFwCalculator()
    return {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces()}


@pytest.fixture(scope="module")
def calculators():
    """{kind: (unpatched calculator, patched calculator)}, each through MACE's or NequIP's own ASE calculator,
    in the model's own precision (float32)."""
    plain_nequip = NequIPCalculator._from_saved_model(str(model_path("nequip")), device="cpu",
                                                      chemical_species_to_atom_type_map=True)
    return {
        "mace": (
            MACECalculator(models=load_mace(model_path("mace"), patched=False), device="cpu"),
            MACECalculator(models=cgforge.patches.load(model_path("mace")), device="cpu"),
        ),
        "nequip": (
            plain_nequip,
            NequIPCalculator(load_nequip(model_path("nequip")), device="cpu", transforms=plain_nequip.transforms),
        ),
    }


def _evaluate(calc, atoms) -> dict[str, np.ndarray]:
    atoms = atoms.copy()
    atoms.calc = calc
    return {"energy": np.array(atoms.get_potential_energy()), "forces": atoms.get_forces(),
            "stress": atoms.get_stress()}


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# ---------------------------------------------------------------------------------------------
# model_path


def test_model_path_finds_both_files():
    for kind, name in (("mace", "water-mace.model"), ("nequip", "water-nequip.nequip.zip")):
        path = model_path(kind)
        assert path.name == name and path.parent.name == "models" and path.is_file()
        assert path.stat().st_size < 5e6, f"{path} should stay small (a few MB in total)"
    assert cgforge.patches.checkpoint_kind(model_path("mace")) == "mace"
    assert cgforge.patches.checkpoint_kind(model_path("nequip")) == "nequip"


@pytest.mark.parametrize("kind", ["allegro", "", "MACE-MP", None, 3])
def test_model_path_rejects_unknown_kind(kind):
    with pytest.raises(ValueError, match="kind.*'mace' or 'nequip'"):
        model_path(kind)


def test_model_path_missing_file_says_how_to_make_it(tmp_path, monkeypatch):
    monkeypatch.setattr(bundled, "MODELS_DIR", tmp_path)
    with pytest.raises(FileNotFoundError) as err:
        model_path("nequip")
    message = str(err.value)
    assert "scripts/train_bundled_models.py" in message and "reinstall cgforge" in message
    assert str(tmp_path / "water-nequip.nequip.zip") in message


# ---------------------------------------------------------------------------------------------
# Patched == unpatched


@pytest.mark.slow
def test_mace_patched_matches_unpatched_in_float64(box):
    """Converted to float64 both ways, patched and plain agree far below float32 precision.

    Not to 1e-12: the model was built in float32, so MACE's stored symmetric-contraction U tensors are
    float32-rounded (0.99999994 for 1, ...). MACE contracts with them as stored; cgforge's contraction of
    the l=1 output deviates from that by ~2e-8 relative (its scalar output matches to 1e-16), i.e. it does
    not reproduce the rounding of the stored U. Far below float32's 1.2e-7, the precision the model has.
    """
    plain = MACECalculator(models=load_mace(model_path("mace"), patched=False, dtype="float64"), device="cpu",
                           default_dtype="float64")
    patched = MACECalculator(models=cgforge.patches.load(model_path("mace"), dtype="float64"), device="cpu",
                             default_dtype="float64")
    want, got = _evaluate(plain, box), _evaluate(patched, box)
    for key in ("energy", "forces", "stress"):
        assert _rel(got[key], want[key]) < 1e-6, key


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.slow
def test_patched_matches_unpatched_in_float32(kind, box, calculators):
    plain, patched = calculators[kind]
    adapter = mace_adapter if kind == "mace" else nequip_adapter
    models = [calc.models[0] if kind == "mace" else calc.model for calc in (plain, patched)]
    assert [adapter.is_patched(m) for m in models] == [False, True]
    want, got = _evaluate(plain, box), _evaluate(patched, box)
    for key in ("energy", "forces", "stress"):
        assert np.linalg.norm(want[key]) > 0
        assert _rel(got[key], want[key]) < 1e-5, key


# ---------------------------------------------------------------------------------------------
# Physics: agreement with q-SPC/Fw, conservative forces, energy conservation


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.slow
def test_close_to_qspcfw_on_a_fresh_box(kind, box, reference, calculators):
    got = _evaluate(calculators[kind][1], box)
    energy_error = abs(float(got["energy"]) - reference["energy"]) / len(box) * 1000  # meV/atom
    forces_rmse = float(np.sqrt(np.mean((got["forces"] - reference["forces"]) ** 2))) * 1000  # meV/Å
    assert energy_error < ACCURACY_FACTOR * TEST_RMSE[kind]["energy"], energy_error
    assert forces_rmse < ACCURACY_FACTOR * TEST_RMSE[kind]["forces"], forces_rmse
    # and the model is not trivially right: the reference forces are an order of magnitude larger
    assert np.sqrt(np.mean(reference["forces"] ** 2)) * 1000 > 5 * forces_rmse


def _directional_check(calc, atoms, h: float, tolerance: float) -> None:
    """Central differences of the energy along unit directions in 3N-space equal -F.d.

    Directions: along the forces (a large derivative, ~|F|) and two random ones (~rms(F)). A unit step h in
    3N dimensions moves each atom by ~h/sqrt(3N), so the h^2 truncation error stays far below the tolerance.
    """
    rng = np.random.default_rng(5)
    forces = _evaluate(calc, atoms)["forces"]
    directions = [forces, rng.normal(size=forces.shape), rng.normal(size=forces.shape)]
    for direction in directions:
        direction = direction / np.linalg.norm(direction)
        numeric = central_difference(lambda t: float(_evaluate(calc, displaced(atoms, direction, t))["energy"]), h)  # noqa: B023
        analytic = -float((forces * direction).sum())
        assert abs(analytic) > 0.1
        assert abs(numeric - analytic) < tolerance * max(1.0, abs(analytic)), (numeric, analytic)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.slow
def test_forces_are_minus_the_energy_gradient(kind, box, calculators):
    """As shipped (float32): the energy carries ~2e-6 eV of rounding, i.e. ~1e-4 eV/Å of noise at h = 0.01 Å."""
    _directional_check(calculators[kind][1], box, h=1e-2, tolerance=1e-3)


@pytest.mark.slow
def test_mace_float64_forces_are_minus_the_energy_gradient(box):
    """Converted to float64 the check is tight: rounding ~1e-13 eV, truncation ~h^2 = 1e-8."""
    calc = MACECalculator(models=cgforge.patches.load(model_path("mace"), dtype="float64"), device="cpu",
                          default_dtype="float64")
    _directional_check(calc, box, h=1e-4, tolerance=1e-6)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.slow
def test_nve_conserves_energy(kind, box, calculators):
    """40 velocity-Verlet steps of 0.5 fs (20 fs, two O-H stretch periods) from 300 K velocities.

    Bound: total energy stays within 0.2 meV/atom of its start. With this time step q-SPC/Fw itself
    deviates by up to 0.05 meV/atom on this box and the two models by 0.03-0.04; a non-conservative force
    or a wrong sign drifts by many meV/atom.
    """
    atoms = box.copy()
    atoms.calc = calculators[kind][1]
    rng = np.random.default_rng(11)
    momenta = rng.normal(size=(len(atoms), 3)) * np.sqrt(atoms.get_masses() * units.kB * 300)[:, None]
    atoms.set_momenta(momenta - momenta.mean(0))
    energies, temperatures = [], []

    def record():
        energies.append(atoms.get_potential_energy() + atoms.get_kinetic_energy())
        temperatures.append(atoms.get_temperature())

    dynamics = VelocityVerlet(atoms, 0.5 * units.fs)
    dynamics.attach(record, interval=1)
    dynamics.run(40)
    deviation = np.max(np.abs(np.array(energies) - energies[0])) / len(atoms) * 1000  # meV/atom
    assert deviation < 0.2, deviation
    assert 100 < np.mean(temperatures) < 1000  # the atoms moved
