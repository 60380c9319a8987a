"""The model runtime's public API (``plugin.runtime.potential``): ``load`` builds a ``Potential`` whose
``evaluate`` gives the calculator's numbers, and which the MD engine drives directly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cgforge.plugin import Calculator
from cgforge.plugin.md.engine import Engine
from cgforge.plugin.md.forces import ModelForces
from cgforge.plugin.md.integrators import VelocityVerlet
from cgforge.plugin.runtime.capture import room
from cgforge.plugin.runtime.options import RuntimeOptions
from cgforge.plugin.runtime.potential import load, load_module
from cgforge.plugin.water import water_box


@pytest.fixture(scope="module")
def potential():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield load("mace", device="cpu", dtype="float64", patch=True, warmup=False, skin=0.5)
    torch.set_default_dtype(previous)


def test_evaluate_gives_the_calculators_results(potential) -> None:
    atoms = water_box(8, seed=1)
    atoms.rattle(0.05, seed=2)
    pbc = tuple(bool(p) for p in atoms.pbc)
    system = potential.system(atoms.numbers, atoms.positions, np.asarray(atoms.cell), pbc)
    assert system.n_atoms == len(atoms) and system.order is None  # small systems keep the order given
    out = potential.evaluate(atoms.positions, np.asarray(atoms.cell), pbc, system, stress=True, per_atom=True)
    atoms.calc = Calculator("mace", device="cpu", dtype="float64", patch=True, warmup=False)
    np.testing.assert_allclose(out.forces, atoms.get_forces(), atol=1e-10)
    np.testing.assert_allclose(out.virial / atoms.get_volume(), atoms.get_stress(voigt=False), atol=1e-10)
    np.testing.assert_allclose(out.energies, atoms.get_potential_energies(), atol=1e-10)
    assert out.energy == pytest.approx(atoms.get_potential_energy(), abs=1e-10)
    energy_only = potential.evaluate(atoms.positions, np.asarray(atoms.cell), pbc, system, forces=False)
    assert energy_only.forces is None and energy_only.virial is None and energy_only.energies is None
    with pytest.raises(ValueError, match="atoms: positions of shape \\(3, 3\\) for a system of 24 atoms"):
        potential.evaluate(atoms.positions[:3], np.asarray(atoms.cell), pbc, system)


def test_options_are_checked_and_reach_the_potential(potential) -> None:
    assert potential.options == RuntimeOptions()
    with pytest.raises(TypeError, match="options: expected a RuntimeOptions"):
        load("mace", device="cpu", warmup=False, options={"order_above_atoms": None})
    atoms = water_box(2, seed=3)
    ordered = load("mace", device="cpu", patch=True, warmup=False, options=RuntimeOptions(order_above_atoms=0))
    system = ordered.system(atoms.numbers, atoms.positions, np.asarray(atoms.cell), (True,) * 3)
    assert system.order is not None and sorted(system.order) == list(range(len(atoms)))


def test_the_engine_runs_on_a_potential(potential) -> None:
    atoms = water_box(4, seed=4)
    engine = Engine(potential, atoms, VelocityVerlet(0.5), block=2)
    engine.run(2)
    assert engine.step == 2 and np.isfinite(engine.sync_atoms().positions).all()
    provider = ModelForces(potential)
    assert Engine(provider, atoms, VelocityVerlet(0.5)).provider is provider  # a provider is taken as it is


def test_load_names_what_it_cannot_load(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="model: .*missing.model not found"):
        load(tmp_path / "missing.model", device="cpu")
    with pytest.raises(TypeError, match="model: expected a checkpoint path or a MACE/NequIP torch module, got int"):
        load_module(42, "cpu")
    with pytest.raises(ValueError, match="radial_table=True and radial_precision='tf32'"):
        load("mace", device="cpu", radial_table=True, radial_precision="tf32")  # before the model loads


def test_one_capacity_rounding() -> None:
    assert room(0, 0.1) == 64 and room(64, 0.0) == 128 and room(1000, 0.01) == 1088
