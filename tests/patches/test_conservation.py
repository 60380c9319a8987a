"""Forces are conservative, for every patched model family (FP64): the peers' failure mode was kernels whose
forward and backward matched e3nn while MD still heated (non-conservative forces at l = 3).

Per model (MACE: residual l=2; l=3 hidden irreps with correlation 3; density-residual block with l=3
edges and correlation 3. NequIP: l_max 1 without parity, 2 and 3):
- forces equal minus the finite-difference derivative of the energy (fourth-order stencil) along random
  directions and single coordinates;
- the force Jacobian dF/dx is symmetric (on a random subspace) and its products with a vector match finite
  differences of the forces: checks the double-backward formulas of the fused convolution too;
- an NVE run (velocity Verlet, periodic box, neighbour list rebuilt every step) conserves the total energy
  within ENERGY_BOUND, as the unpatched model does, on the same trajectory.

The random models have their features balanced so that every path of every layer moves the energy, and
MACE's energy is scaled to a force RMS of 0.3 eV/Å (tests/potentials.py). All atoms get mass 16 in the MD so
the random (unbound) models move atoms ~0.1 Å in the run rather than sending hydrogens flying. The
CUDA-marked tests run the same checks with the generated kernels.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from ase import Atoms, units
from oracles import central_difference, displaced, projected_jacobian
from potentials import Potential, mace_potential, mace_system, nequip_potential, nequip_system


def _with_radial_tables(pot: Potential, tol: float = 1e-10) -> Potential:
    """The same model, patched with every block's weights read from tables of the edge length. The tables are C1:
    the force Jacobian jumps by O(h^2) at their knots, so the FP64 checks here get fine ones (tol 1e-10; 1e-9 for
    NequIP, whose tables of r / r_max reach 2e-10 in the derivative at the fit's 16384 intervals at most)."""
    if pot.name.startswith("NequIP"):
        from cgforge.patches import nequip as family
    else:
        from cgforge.patches import mace as family

    def patch(model: torch.nn.Module) -> torch.nn.Module:
        model = family.patch(model)
        family.set_radial_table(model, True, tol=tol)
        return model

    return dataclasses.replace(pot, patch_fn=patch)


MODELS = {
    "mace-l2": lambda: mace_potential(hidden="8x0e+8x1o+8x2e", max_ell=2),
    "mace-l3-corr3": lambda: mace_potential(interaction="RealAgnosticResidualInteractionBlock",
                                            first="RealAgnosticInteractionBlock", hidden="8x0e+8x1o+8x2e+8x3o",
                                            max_ell=3, correlation=3),
    "mace-l3-corr3-tables": lambda: _with_radial_tables(mace_potential(
        interaction="RealAgnosticResidualInteractionBlock", first="RealAgnosticInteractionBlock",
        hidden="8x0e+8x1o+8x2e+8x3o", max_ell=3, correlation=3)),
    "mace-density-l3-corr3": lambda: mace_potential(interaction="RealAgnosticDensityResidualInteractionBlock",
                                                    hidden="8x0e+8x1o+8x2e", max_ell=3, correlation=3),
    "nequip-l1-noparity": lambda: nequip_potential(1, parity=False),
    "nequip-l2": lambda: nequip_potential(2),
    "nequip-l2-tables": lambda: _with_radial_tables(nequip_potential(2), tol=1e-9),
    "nequip-l3": lambda: nequip_potential(3),
}
FD_STEP = 1e-3  # Å, fourth-order central stencil: truncation ~h^4, round-off ~1e-16 |E| / h
FD_TOL = 1e-7
SYMMETRY_TOL = 1e-10
MD_STEPS = 60
MD_DT_FS = 0.25
MD_MASS = 16.0
MD_TEMPERATURE_K = 300.0
# eV, max |E_total(t) - E_total(0)| over the 15 fs run (8 or 24 atoms, initial kinetic energy 0.3 or 0.9 eV).
# The unpatched models stay within 3e-6 to 1.1e-4 eV (velocity Verlet's own error at this step: it scales
# as dt^2); the patched ones must stay within this bound and within twice the unpatched model's drift.
ENERGY_BOUND = 5e-4


@pytest.fixture(scope="module")
def potentials():
    cache = {}

    def get(name: str, device: str = "cpu") -> tuple[Potential, Potential]:
        """(plain, patched) on `device`."""
        if (name, device) not in cache:
            plain = MODELS[name]()
            plain = plain if device == "cpu" else plain.to(device)
            cache[name, device] = plain, plain.patched()
        return cache[name, device]

    return get


def _system(name: str) -> Atoms:
    return mace_system() if name.startswith("mace") else nequip_system()


def _directions(atoms: Atoms, seed: int, n_random: int = 3, n_axes: int = 3) -> list[np.ndarray]:
    """Unit random directions over all coordinates, and single coordinates (atom, axis)."""
    rng = np.random.default_rng(seed)
    shape = atoms.positions.shape
    dirs = [d / np.linalg.norm(d) for d in rng.normal(size=(n_random, *shape))]
    for flat in rng.choice(shape[0] * 3, size=n_axes, replace=False):
        d = np.zeros(shape)
        d.flat[flat] = 1.0
        dirs.append(d)
    return dirs


def _stencil(f, atoms: Atoms, d: np.ndarray, h: float = FD_STEP):
    """Fourth-order central difference of f(atoms displaced by t d) at t = 0."""
    return central_difference(lambda t: f(displaced(atoms, d, t)), h, order=4)


def check_forces_match_finite_differences(pot: Potential, atoms: Atoms) -> None:
    _, forces = pot.energy_forces(atoms)
    dirs = _directions(atoms, seed=3)
    fd = np.array([_stencil(lambda a: pot.energy_forces(a)[0], atoms, d) for d in dirs])
    want = np.array([-(forces * d).sum() for d in dirs])
    err = np.linalg.norm(fd - want) / np.linalg.norm(want)
    assert np.linalg.norm(want) > 1e-2, "forces along the test directions are ~0: the check would be empty"
    assert err < FD_TOL, f"{pot.name}: dE/dx by finite differences vs -F: relative error {err:.3g}"


def check_force_jacobian(pot: Potential, atoms: Atoms, n_vectors: int = 4) -> None:
    """M[j, k] = v_j . (J v_k) from autograd (J = dF/dx, via the double backward) must be symmetric,
    and J v for one v must equal finite differences of the forces."""
    _, forces, positions, _ = pot.evaluate(atoms, graph=True)
    rng = np.random.default_rng(5)
    vs = torch.tensor(rng.normal(size=(n_vectors, *forces.shape)), dtype=forces.dtype, device=forces.device)
    m, jt_v = projected_jacobian(forces, positions, vs)  # grad of F . v with respect to x is J^T v
    m = m.cpu()
    asym = (m - m.T).norm() / m.norm()
    assert m.norm() > 0
    assert asym < SYMMETRY_TOL, f"{pot.name}: force Jacobian asymmetry {asym:.3g}"
    v0 = vs[0].cpu().numpy()
    fd = _stencil(lambda a: pot.energy_forces(a)[1], atoms, v0)  # J v0
    err = np.linalg.norm(fd - jt_v[0].detach().cpu().numpy()) / np.linalg.norm(fd)
    assert err < 1e-6, f"{pot.name}: J v by autograd vs finite differences of the forces: relative error {err:.3g}"


def nve_run(pot: Potential, atoms: Atoms, steps: int = MD_STEPS, dt_fs: float = MD_DT_FS, seed: int = 7):
    """Velocity Verlet in ASE units, neighbour list rebuilt every step. Returns (total energies, final positions)."""
    atoms = atoms.copy()
    masses = np.full((len(atoms), 1), MD_MASS)
    # Maxwell-Boltzmann velocities (ASE units: Å, eV, amu), no centre-of-mass motion
    velocities = np.random.default_rng(seed).normal(size=atoms.positions.shape) * np.sqrt(
        units.kB * MD_TEMPERATURE_K / masses)
    velocities -= velocities.mean(0)
    dt = dt_fs * units.fs
    energy, forces = pot.energy_forces(atoms)
    totals = [energy + 0.5 * (masses * velocities**2).sum()]
    for _ in range(steps):
        velocities = velocities + 0.5 * dt * forces / masses
        atoms.positions = atoms.positions + dt * velocities
        energy, forces = pot.energy_forces(atoms)
        velocities = velocities + 0.5 * dt * forces / masses
        totals.append(energy + 0.5 * (masses * velocities**2).sum())
    return np.array(totals), atoms.positions.copy()


def check_nve(plain: Potential, patched: Potential, atoms: Atoms) -> None:
    e_plain, x_plain = nve_run(plain, atoms)
    e_patched, x_patched = nve_run(patched, atoms)
    drift_plain = np.abs(e_plain - e_plain[0]).max()
    drift_patched = np.abs(e_patched - e_patched[0]).max()
    moved = np.abs(x_plain - atoms.positions).max()
    assert moved > 0.05, f"atoms moved only {moved:.3g} Å: the run tests nothing"
    assert drift_plain < ENERGY_BOUND, f"{plain.name}: the unpatched model drifts {drift_plain:.3g} eV"
    assert drift_patched < ENERGY_BOUND, (
        f"{patched.name}: energy drift {drift_patched:.3g} eV over {MD_STEPS} steps (bound {ENERGY_BOUND:g}, "
        f"unpatched {drift_plain:.3g})")
    assert drift_patched <= 2 * drift_plain + 1e-9, (drift_patched, drift_plain)
    assert np.abs(x_patched - x_plain).max() < 1e-6, "patched and plain trajectories diverge"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_forces_match_finite_differences_of_the_energy(potentials, name):
    check_forces_match_finite_differences(potentials(name)[1], _system(name))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_force_jacobian_is_symmetric_and_matches_finite_differences(potentials, name):
    check_force_jacobian(potentials(name)[1], _system(name))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_nve_energy_drift_is_bounded_and_matches_the_unpatched_model(potentials, name):
    plain, patched = potentials(name)
    check_nve(plain, patched, _system(name))


@pytest.mark.cuda
@pytest.mark.parametrize("check", ["finite_differences", "jacobian", "nve"])
@pytest.mark.parametrize("name", list(MODELS))
def test_on_gpu(potentials, name, check):
    plain, patched = potentials(name, "cuda")
    atoms = _system(name)
    if check == "finite_differences":
        check_forces_match_finite_differences(patched, atoms)
    elif check == "jacobian":
        check_force_jacobian(patched, atoms)
    else:
        check_nve(plain, patched, atoms)
