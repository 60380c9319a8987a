"""Batched FIRE (``plugin.relax``): each structure follows ASE's FIRE on it alone, structures leave the batch
as they finish and the queue refills it, and a bad structure fails alone; batched NVE (``plugin.batch_md``)
follows ASE's velocity Verlet on each structure alone."""

from __future__ import annotations

import numpy as np
import pytest
import test_batch
from ase import units
from ase.build import molecule
from ase.optimize import FIRE

from cgforge.plugin import FireParameters, relax_batch
from cgforge.plugin.water import water_box

mace_calc = test_batch.mace_calc  # the fixture: the bundled MACE in FP64


def structures() -> list:
    stretched = molecule("H2")
    stretched.positions[1, 2] += 0.2  # converges in a few steps
    bent = molecule("H2O")
    bent.rattle(0.1, seed=5)
    box = water_box(2, seed=3)
    box.rattle(0.1, seed=4)
    return [bent, stretched, box]


def test_each_structure_relaxes_as_ases_fire_alone(mace_calc) -> None:
    inputs = structures()
    before = [a.positions.copy() for a in inputs]
    fmax, steps = 0.05, 10
    done = list(relax_batch(mace_calc, inputs, fmax=fmax, steps=steps, batch_size=2))
    assert sorted(d.index for d in done) == [0, 1, 2]
    assert done[0].index == 1  # the first to finish is handed back first; the box took its place
    for original, positions in zip(inputs, before, strict=True):
        np.testing.assert_array_equal(original.positions, positions)  # inputs untouched
    statuses = set()
    for d in done:
        reference = inputs[d.index].copy()
        reference.calc = mace_calc
        optimizer = FIRE(reference, logfile=None)
        converged = optimizer.run(fmax=fmax, steps=steps)
        assert d.steps == optimizer.nsteps
        assert d.status == ("converged" if converged else "unconverged")
        assert d.energy == pytest.approx(reference.get_potential_energy(), abs=1e-6)
        np.testing.assert_allclose(d.atoms.positions, reference.positions, atol=1e-8)
        assert d.fmax == pytest.approx(np.linalg.norm(reference.get_forces(), axis=1).max(), abs=1e-8)
        assert d.atoms.get_potential_energy() == d.energy  # results travel with the atoms
        if d.status == "converged":
            assert d.fmax < fmax
        statuses.add(d.status)
    assert statuses == {"converged", "unconverged"}


def torchsim_order_fire(atoms, calc, steps: int, p: FireParameters) -> np.ndarray:
    """The positions after ``steps`` FIRE steps in TorchSim's ``ase_fire`` order (alpha decayed and dt grown before
    the velocity mixing), written out here in numpy as that step is defined."""
    atoms = atoms.copy()
    atoms.calc = calc
    x, v, dt, a, downhill = atoms.positions.copy(), None, p.dt, p.a, 0
    for _ in range(steps):
        atoms.positions = x
        f = atoms.get_forces()
        if v is None:
            v = np.zeros_like(x)
        elif np.vdot(f, v) > 0.0:
            if downhill > p.Nmin:
                dt, a = min(dt * p.finc, p.dtmax), a * p.fa
            downhill += 1
            v = (1.0 - a) * v + a * f * np.linalg.norm(v) / np.linalg.norm(f)
        else:
            v, dt, a, downhill = np.zeros_like(x), dt * p.fdec, p.astart, 0
        v = v + dt * f
        dr = dt * v
        dr *= min(1.0, p.maxstep / np.linalg.norm(dr))
        x = x + dr
    return x


def test_the_torchsim_variant_steps_in_torchsims_order(mace_calc) -> None:
    """``variant="torchsim"`` follows TorchSim's FIRE order step for step; ASE's order (the default) leaves another
    path once alpha has decayed (after Nmin downhill steps), so the option is what differs."""
    inputs, steps = [structures()[i] for i in (0, 2)], 30  # the bent water and the box (H2 converges to 1e-9)
    torchsim = FireParameters(variant="torchsim")
    ours = {d.index: d for d in relax_batch(mace_calc, inputs, fmax=1e-9, steps=steps, batch_size=2, fire=torchsim)}
    default = {d.index: d for d in relax_batch(mace_calc, inputs, fmax=1e-9, steps=steps, batch_size=2)}
    apart = 0.0
    for i, atoms in enumerate(inputs):
        assert ours[i].status == "unconverged" and ours[i].steps == steps
        np.testing.assert_allclose(ours[i].atoms.positions, torchsim_order_fire(atoms, mace_calc, steps, torchsim),
                                   atol=1e-9)
        apart = max(apart, float(np.abs(default[i].atoms.positions - ours[i].atoms.positions).max()))
    assert apart > 1e-6, apart
    with pytest.raises(ValueError, match="FireParameters.variant: expected one of ase, torchsim"):
        FireParameters(variant="vv_fire")


def test_a_bad_structure_fails_alone_and_the_others_go_on(mace_calc) -> None:
    bad = molecule("H2O")
    bad.positions[2] = bad.positions[1] + 0.05
    unknown = molecule("CH4")
    inputs = [molecule("H2"), bad, unknown, molecule("H2"), "not a structure"]
    done = {d.index: d for d in relax_batch(mace_calc, inputs, fmax=0.5, steps=3, batch_size=3)}
    assert sorted(done) == [0, 1, 2, 3, 4]
    assert done[4].status == "failed" and "expected an ase.Atoms, got str" in done[4].error
    assert done[2].atoms is not unknown  # a copy: the input stays the caller's
    assert done[1].status == "failed" and "overlapping atoms" in done[1].error
    assert done[2].status == "failed" and "C" in done[2].error
    assert done[0].status != "failed" and done[3].status != "failed"
    assert done[0].energy == pytest.approx(done[3].energy, abs=1e-10)


def test_arguments_are_checked(mace_calc) -> None:
    with pytest.raises(ValueError, match="fmax: expected a finite number > 0"):
        next(relax_batch(mace_calc, [molecule("H2")], fmax=0))
    with pytest.raises(ValueError, match="batch_size: expected an integer >= 1"):
        next(relax_batch(mace_calc, [molecule("H2")], batch_size=0))
    with pytest.raises(ValueError, match="FireParameters.dt"):
        FireParameters(dt=-1.0)


def test_cells_relax_as_ases_fire_on_a_frechet_cell_filter(mace_calc) -> None:
    from ase.filters import FrechetCellFilter

    box = water_box(2, seed=3)
    box.rattle(0.05, seed=4)
    box.set_cell(box.cell * 1.05, scale_atoms=True)
    free = molecule("H2O")  # no cell: its positions relax alone
    free.rattle(0.1, seed=5)
    steps = 6
    done = {d.index: d for d in relax_batch(mace_calc, [box, free], fmax=0.05, steps=steps, cell_filter=True)}
    for index, atoms in enumerate([box, free]):
        reference = atoms.copy()
        reference.calc = mace_calc
        FIRE(FrechetCellFilter(reference) if index == 0 else reference, logfile=None).run(fmax=0.05, steps=steps)
        np.testing.assert_allclose(done[index].atoms.cell[:], reference.cell[:], atol=1e-9)
        np.testing.assert_allclose(done[index].atoms.positions, reference.positions, atol=1e-9)
        assert done[index].energy == pytest.approx(reference.get_potential_energy(), abs=1e-6)
    assert np.abs(done[0].atoms.cell[:] - box.cell[:]).max() > 0.05  # the cell did move


@pytest.mark.cuda
def test_the_device_relaxation_follows_ases_fire_on_cuda() -> None:
    from cgforge.plugin import Calculator

    calc = Calculator("mace", device="cuda", dtype="float64", skin=0.5)
    inputs = structures() * 2
    done = {d.index: d for d in relax_batch(calc, inputs, fmax=0.05, steps=10, batch_size=3)}
    for index, atoms in enumerate(inputs):
        reference = atoms.copy()
        reference.calc = calc
        optimizer = FIRE(reference, logfile=None)
        optimizer.run(fmax=0.05, steps=10)
        assert done[index].steps == optimizer.nsteps
        assert done[index].energy == pytest.approx(reference.get_potential_energy(), abs=1e-6)
        np.testing.assert_allclose(done[index].atoms.positions, reference.positions, atol=1e-7)


def test_batched_nve_equals_ases_velocity_verlet_on_each_structure(mace_calc) -> None:
    nve_matches_ase(mace_calc)


@pytest.mark.cuda
def test_batched_nve_on_cuda_equals_ases_velocity_verlet() -> None:
    from cgforge.plugin import Calculator

    nve_matches_ase(Calculator("mace", device="cuda", dtype="float64", skin=0.5))


def nve_matches_ase(calc) -> None:
    from ase.md.verlet import VelocityVerlet

    from cgforge.plugin import run_md_batch

    inputs = structures()
    for seed, atoms in enumerate(inputs):  # thermal-sized momenta (~300 K)
        noise = np.random.default_rng(seed).normal(size=(len(atoms), 3))
        atoms.set_momenta(noise * np.sqrt(atoms.get_masses() * units.kB * 300)[:, None])
    final = run_md_batch(calc, inputs, ensemble="nve", timestep_fs=0.5, steps=4)
    for atoms, got in zip(inputs, final, strict=True):
        reference = atoms.copy()
        reference.calc = calc
        VelocityVerlet(reference, timestep=0.5 * units.fs).run(4)
        np.testing.assert_allclose(got.positions, reference.positions, atol=1e-10)
        np.testing.assert_allclose(got.get_momenta(), reference.get_momenta(), atol=1e-10)
        assert got.get_potential_energy() == pytest.approx(reference.get_potential_energy(), abs=1e-9)
    assert not np.allclose(final[2].positions, inputs[2].positions)  # they moved
