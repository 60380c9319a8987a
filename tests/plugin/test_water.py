"""Water boxes and the q-SPC/Fw calculator: geometry, an independent energy, conservation, sane dynamics."""

from __future__ import annotations

import contextlib
import itertools
import math

import numpy as np
import pytest
import torch
from ase import Atoms, units
from ase.calculators.calculator import PropertyNotImplementedError
from ase.md.langevin import Langevin
from ase.md.verlet import VelocityVerlet
from ase.optimize import FIRE
from oracles import central_difference, displaced, random_rotation, unit
from oracles import stress_by_finite_differences as stress_by_strain
from scipy.special import erfc

from cgforge.plugin.water import Q_SPC_FW, QSPCFwCalculator, check_water_order, water_box

try:  # ase >= 3.29
    from ase.md.velocitydistribution import thermalize_momenta
except ImportError:  # older ase
    from ase.md.velocitydistribution import MaxwellBoltzmannDistribution

    def thermalize_momenta(atoms, temperature_K, rng=None):
        MaxwellBoltzmannDistribution(atoms, temperature_K=temperature_K, rng=rng)


KCAL = units.kcal / units.mol


@contextlib.contextmanager
def one_torch_thread():
    # MD steps on 192 atoms are many small ops: on a shared 2-core machine, two threads fight and run
    # several times slower than one. Restored afterwards.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def oh_lengths(atoms: Atoms) -> np.ndarray:
    p = atoms.positions
    return np.linalg.norm(np.concatenate([p[1::3] - p[0::3], p[2::3] - p[0::3]]), axis=1)


def hoh_angles(atoms: Atoms) -> np.ndarray:
    p = atoms.positions
    a, b = p[1::3] - p[0::3], p[2::3] - p[0::3]
    cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    return np.degrees(np.arccos(cos))


def reference_energy(atoms: Atoms, cutoff=9.0, alpha=0.2) -> float:
    """q-SPC/Fw + DSF written out directly: every atom pair, every image in range, numpy, no neighbour list.

    Molecules are assumed whole as given.
    """
    p, prm = atoms.positions, Q_SPC_FW
    bonds = oh_lengths(atoms)
    theta = np.radians(hoh_angles(atoms))
    energy = (0.5 * prm.bond_k * ((bonds - prm.bond_r0) ** 2).sum()
              + 0.5 * prm.angle_k * ((theta - np.radians(prm.angle_theta0)) ** 2).sum()) * KCAL
    charges = np.tile([prm.charge_o, prm.charge_h, prm.charge_h], len(atoms) // 3)
    molecule = np.arange(len(atoms)) // 3
    oxygen = np.arange(len(atoms)) % 3 == 0
    cell = atoms.cell.array
    # Plane spacing h = V / |a x b|; atoms may sit up to a cell outside, hence the + 1.
    spacing = [atoms.cell.volume / np.linalg.norm(np.cross(cell[d - 2], cell[d - 1])) for d in range(3)]
    reach = [math.ceil(cutoff / spacing[d]) + 1 if atoms.pbc[d] else 0 for d in range(3)]
    ke = units.Hartree * units.Bohr

    def coulomb(r):
        return (erfc(alpha * r) / r - erfc(alpha * cutoff) / cutoff
                + (erfc(alpha * cutoff) / cutoff**2
                   + 2 * alpha / np.sqrt(np.pi) * np.exp(-(alpha * cutoff) ** 2) / cutoff) * (r - cutoff))

    def lj(r):
        return 4 * prm.lj_epsilon * KCAL * ((prm.lj_sigma / r) ** 12 - (prm.lj_sigma / r) ** 6)

    def lj_slope(r):
        return 4 * prm.lj_epsilon * KCAL * (-12 * prm.lj_sigma**12 / r**13 + 6 * prm.lj_sigma**6 / r**7)

    pair_energy = 0.0
    for shift in itertools.product(*[range(-n, n + 1) for n in reach]):
        r = np.linalg.norm(p[None, :, :] - p[:, None, :] + np.asarray(shift) @ cell, axis=-1)
        counted = r < cutoff
        if not any(shift):
            counted &= molecule[:, None] != molecule[None, :]
        i, j = np.nonzero(counted)
        rij = r[i, j]
        pair_energy += (ke * charges[i] * charges[j] * coulomb(rij)).sum()
        both = oxygen[i] & oxygen[j]
        rij = rij[both]
        pair_energy += (lj(rij) - lj(cutoff) - (rij - cutoff) * lj_slope(cutoff)).sum()
    return energy + 0.5 * pair_energy


def jiggled_box(n_side=2, seed=0, amplitude=0.05, **kwargs) -> Atoms:
    atoms = water_box(n_side=n_side, seed=seed, **kwargs)
    atoms.positions += np.random.default_rng(seed + 100).normal(scale=amplitude, size=atoms.positions.shape)
    return atoms


# ----------------------------------------------------------------------------------------------- water_box


def test_water_box_matches_the_anchor_convention():
    atoms = water_box(n_side=12)
    assert len(atoms) == 5184 and atoms.get_chemical_formula() == "H3456O1728"
    assert atoms.pbc.all()
    np.testing.assert_allclose(atoms.cell.array, np.eye(3) * 37.25167035, atol=1e-6)
    density = atoms.get_masses().sum() / units._Nav / (atoms.get_volume() * 1e-24)  # g/cm^3
    assert abs(density - 1.0) < 2e-3
    check_water_order(atoms.numbers)
    np.testing.assert_allclose(oh_lengths(atoms), 0.9572, atol=1e-12)
    np.testing.assert_allclose(hoh_angles(atoms), 104.52, atol=1e-9)
    # Oxygens on the grid, offset 0.3 Å; random orientations (H directions spread over the sphere).
    spacing = atoms.cell[0, 0] / 12
    grid = (atoms.positions[0::3] - 0.3) / spacing
    np.testing.assert_allclose(grid, np.round(grid), atol=1e-9)
    directions = atoms.positions[1::3] - atoms.positions[0::3]
    assert np.abs(directions.mean(0)).max() < 0.05


def test_water_box_seeds_sizes_and_density():
    assert np.array_equal(water_box(n_side=3, seed=4).positions, water_box(27, seed=4).positions)
    assert not np.allclose(water_box(n_side=3, seed=4).positions, water_box(n_side=3, seed=5).positions)
    atoms = water_box(10, density=0.9, oh_length=1.0, hoh_angle=112.0)
    assert len(atoms) == 30
    volume_per_molecule = atoms.get_volume() / 10
    assert abs(volume_per_molecule - 18.015 / 0.6022 / 0.9) < 1e-9
    np.testing.assert_allclose(oh_lengths(atoms), 1.0, atol=1e-12)
    np.testing.assert_allclose(hoh_angles(atoms), 112.0, atol=1e-9)
    oxygen = atoms.positions[0::3]
    assert len(np.unique(np.round(oxygen, 6), axis=0)) == 10  # distinct sites


@pytest.mark.parametrize(
    "kwargs, message",
    [(dict(), "exactly one"), (dict(n_molecules=8, n_side=2), "exactly one"), (dict(n_side=0), "n_side"),
     (dict(n_molecules=-3), "n_molecules"), (dict(n_side=2.5), "n_side"),
     (dict(n_side=2, density=0.0), "density")],
)
def test_water_box_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        water_box(**kwargs)


def test_atom_order_is_checked():
    atoms = water_box(n_side=2)
    calc = QSPCFwCalculator()
    wrong = atoms[[1, 0, 2] + list(range(3, len(atoms)))]
    wrong.calc = calc
    with pytest.raises(ValueError, match="molecule 0"):
        wrong.get_potential_energy()
    short = atoms[:-1]
    short.calc = calc
    with pytest.raises(ValueError, match="3 atoms per molecule"):
        short.get_potential_energy()


# ----------------------------------------------------------------------------------------------- energy


def test_isolated_molecule_energies_are_the_textbook_terms():
    calc = QSPCFwCalculator()
    molecule = water_box(1, oh_length=1.0, hoh_angle=112.0)
    molecule.pbc = False
    molecule.calc = calc
    assert abs(molecule.get_potential_energy()) < 1e-12
    assert np.abs(molecule.get_forces()).max() < 1e-10
    stretched = molecule.copy()
    stretched.calc = calc
    stretched.positions[1] = stretched.positions[0] + 1.1 * (stretched.positions[1] - stretched.positions[0])
    assert stretched.get_potential_energy() == pytest.approx(0.5 * 1059.162 * 0.1**2 * KCAL, rel=1e-12)


@pytest.mark.parametrize("pbc", [True, False])
def test_energy_matches_direct_reference(pbc):
    # 8 molecules in a 6.2 Å cell with a 9 Å cutoff: up to two images each way take part.
    atoms = jiggled_box(seed=1)
    atoms.pbc = pbc
    atoms.calc = QSPCFwCalculator()
    assert atoms.get_potential_energy() == pytest.approx(reference_energy(atoms), rel=1e-10, abs=1e-10)


def test_split_molecules_are_made_whole():
    atoms = jiggled_box(seed=2)
    atoms.calc = QSPCFwCalculator()
    energy, forces = atoms.get_potential_energy(), atoms.get_forces()
    wrapped = atoms.copy()
    wrapped.wrap()
    assert np.abs(wrapped.positions - atoms.positions).max() > 1.0  # some molecules now straddle a face
    wrapped.calc = QSPCFwCalculator()
    assert wrapped.get_potential_energy() == pytest.approx(energy, rel=1e-12)
    np.testing.assert_allclose(wrapped.get_forces(), forces, atol=1e-10)


# ----------------------------------------------------------------------------------------------- derivatives


def _energy(calc, atoms: Atoms) -> float:
    atoms.calc = calc
    return atoms.get_potential_energy()


def test_forces_are_minus_the_energy_gradient():
    atoms = jiggled_box(seed=3)
    atoms.calc = QSPCFwCalculator()
    forces = atoms.get_forces()
    step = 1e-5
    for atom, axis in [(0, 0), (1, 2), (5, 1), (13, 0), (23, 2)]:
        direction = unit(atoms.positions.shape, atom, axis)
        numerical = -central_difference(lambda t: _energy(atoms.calc, displaced(atoms, direction, t)), step)  # noqa: B023
        assert abs(forces[atom, axis]) > 1e-3
        assert forces[atom, axis] == pytest.approx(numerical, abs=2e-7, rel=1e-6)
    assert np.abs(forces.sum(0)).max() < 1e-10  # Newton's third law


@pytest.mark.parametrize("shear", [False, True])
def test_stress_is_the_strain_derivative(shear):
    atoms = jiggled_box(seed=4)
    if shear:  # a triclinic cell, atoms carried along
        shear_matrix = np.array([[1, 0.1, -0.05], [0, 1, 0.07], [0, 0, 1]])
        atoms.set_cell(atoms.cell.array @ shear_matrix, scale_atoms=True)
    atoms.calc = QSPCFwCalculator()
    stress = atoms.get_stress()
    numerical = stress_by_strain(lambda a: _energy(atoms.calc, a), atoms, h=1e-6)
    for voigt in range(6):
        assert stress[voigt] == pytest.approx(numerical[voigt], abs=1e-8, rel=1e-6)
    assert np.abs(stress).max() > 1e-3


def test_stress_needs_a_periodic_cell():
    atoms = jiggled_box(seed=5)
    atoms.pbc = (True, True, False)
    atoms.calc = QSPCFwCalculator()
    assert np.isfinite(atoms.get_forces()).all()
    with pytest.raises(PropertyNotImplementedError):
        atoms.get_stress()


def test_invariant_under_translation_rotation_and_permutation():
    atoms = jiggled_box(seed=6)
    atoms.calc = QSPCFwCalculator()
    energy, forces = atoms.get_potential_energy(), atoms.get_forces()
    assert abs(energy) > 0.1

    moved = atoms.copy()
    moved.calc = QSPCFwCalculator()
    moved.positions += [1.7, -0.4, 12.3]
    assert moved.get_potential_energy() == pytest.approx(energy, rel=1e-11)
    np.testing.assert_allclose(moved.get_forces(), forces, atol=1e-9)

    rotation = random_rotation(7).numpy()  # proper
    rotated = atoms.copy()
    rotated.calc = QSPCFwCalculator()
    rotated.set_cell(atoms.cell.array @ rotation.T, scale_atoms=True)  # rotates positions and cell together
    np.testing.assert_allclose(rotated.positions, atoms.positions @ rotation.T, atol=1e-12)
    assert rotated.get_potential_energy() == pytest.approx(energy, rel=1e-11)
    np.testing.assert_allclose(rotated.get_forces(), forces @ rotation.T, atol=1e-9)

    molecules = np.random.default_rng(8).permutation(len(atoms) // 3)
    order = np.concatenate([[3 * m, 3 * m + 2, 3 * m + 1] for m in molecules])  # also swaps each H pair
    permuted = atoms[order]
    permuted.calc = QSPCFwCalculator()
    assert permuted.get_potential_energy() == pytest.approx(energy, rel=1e-11)
    np.testing.assert_allclose(permuted.get_forces(), forces[order], atol=1e-9)


def test_verlet_reuse_gives_the_fresh_answer():
    atoms = jiggled_box(n_side=3, seed=9)
    reused = QSPCFwCalculator(skin=1.0)
    atoms.calc = reused
    atoms.get_forces()
    atoms.positions += np.random.default_rng(10).normal(scale=0.1, size=atoms.positions.shape)
    energy, forces = atoms.get_potential_energy(), atoms.get_forces()
    assert reused.neighbours.n_builds == 1  # moved less than skin / 2: the list was reused
    fresh = atoms.copy()
    fresh.calc = QSPCFwCalculator(skin=0.0)
    assert fresh.get_potential_energy() == pytest.approx(energy, rel=1e-12)
    np.testing.assert_allclose(fresh.get_forces(), forces, atol=1e-10)


# ----------------------------------------------------------------------------------------------- dynamics


@pytest.fixture(scope="module")
def equilibrated():
    """64 molecules relaxed off the grid, then 200 fs of Langevin at 300 K; O-H lengths sampled on the way."""
    atoms = water_box(n_side=4, seed=1)
    atoms.calc = QSPCFwCalculator()
    dynamics = Langevin(atoms, 0.5 * units.fs, temperature_K=300, friction=0.05 / units.fs, fixcm=False,
                        rng=np.random.default_rng(2))
    samples = {"oh": [], "angle": [], "temperature": []}

    def sample():
        samples["oh"].append(oh_lengths(atoms))
        samples["angle"].append(hoh_angles(atoms))
        samples["temperature"].append(atoms.get_temperature())

    dynamics.attach(sample, interval=5)
    with one_torch_thread():
        FIRE(atoms, logfile=None).run(fmax=0.5, steps=60)
        thermalize_momenta(atoms, temperature_K=300, rng=np.random.default_rng(3))
        dynamics.run(400)
    # The second half only: by then the thermostat has taken the grid's strain energy out.
    return atoms, {key: np.asarray(values[len(values) // 2:]) for key, values in samples.items()}


@pytest.mark.slow
def test_langevin_gives_sane_water(equilibrated):
    atoms, samples = equilibrated
    oh, angle = samples["oh"].ravel(), samples["angle"].ravel()
    # Equipartition: std of r is about sqrt(kT / k_b) = 0.024 Å; hydrogen bonds stretch the mean past 1 Å.
    assert 0.995 < oh.mean() < 1.04, oh.mean()
    assert 0.015 < oh.std() < 0.035, oh.std()
    assert oh.min() > 0.88 and oh.max() < 1.15, (oh.min(), oh.max())
    assert 102.0 < angle.mean() < 112.0, angle.mean()
    assert 250.0 < samples["temperature"].mean() < 350.0
    oxygens = atoms[0::3]
    oxygen_distances = oxygens.get_all_distances(mic=True)[np.triu_indices(len(oxygens), 1)]
    assert oxygen_distances.min() > 2.3  # no collapse of molecules into each other


@pytest.mark.slow
def test_nve_conserves_energy(equilibrated):
    atoms = equilibrated[0].copy()
    atoms.calc = QSPCFwCalculator()
    dynamics = VelocityVerlet(atoms, 0.25 * units.fs)
    totals = []
    dynamics.attach(lambda: totals.append(atoms.get_total_energy()), interval=1)
    with one_torch_thread():
        dynamics.run(200)
    totals = np.asarray(totals)
    kinetic = atoms.get_kinetic_energy()
    assert 200 < atoms.get_temperature() < 400 and kinetic > 5.0
    # Measured: max |E - E0| = 2.1 meV over 200 steps (192 atoms, ~7.6 eV kinetic); bound 5x that.
    assert np.abs(totals - totals[0]).max() < 0.01
    drift_per_step = np.polyfit(np.arange(len(totals)), totals, 1)[0]
    assert abs(drift_per_step) * len(totals) < 0.005


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_matches_cpu():
    atoms = jiggled_box(n_side=3, seed=11)
    atoms.calc = QSPCFwCalculator()
    energy, forces, stress = atoms.get_potential_energy(), atoms.get_forces(), atoms.get_stress()
    gpu = atoms.copy()
    gpu.calc = QSPCFwCalculator(device="cuda")
    assert gpu.get_potential_energy() == pytest.approx(energy, rel=1e-12)
    np.testing.assert_allclose(gpu.get_forces(), forces, atol=1e-10)
    np.testing.assert_allclose(gpu.get_stress(), stress, atol=1e-12)
