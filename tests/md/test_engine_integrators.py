"""The engine's integrators on torch test potentials (CPU, FP64): equal to ASE's VelocityVerlet and Langevin
step for step, thermostats and barostat sample the right distributions, restarts continue exactly, blow-ups
stop with the step and the value."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from ase import units
from ase.io.trajectory import Trajectory
from ase.md.langevin import Langevin as AseLangevin
from ase.md.verlet import VelocityVerlet as AseVelocityVerlet
from engine_potentials import (  # noqa: E402
    ReplayNoise,
    TorchCalculator,
    argon_box,
    harmonic_tethers,
    lennard_jones,
    oscillators,
    zero_energy,
)

from cgforge.kernels.md_rescale import cell_volume, pressure_tensor  # noqa: E402
from cgforge.plugin.md.engine import Engine, MDBlowUp, energy_function_engine  # noqa: E402
from cgforge.plugin.md.forces import EnergyFunctionForces  # noqa: E402
from cgforge.plugin.md.integrators import (  # noqa: E402
    CSVR,
    Langevin,
    StochasticCellRescaling,
    VelocityVerlet,
)
from cgforge.plugin.runtime.options import RuntimeOptions  # noqa: E402

AOT_EAGER = RuntimeOptions(compile_backend="aot_eager")  # dynamo's graphs without code generation
TOL = 1e-10  # Å and amu Å/(ASE time): the FP64 trajectories agree to rounding


pytestmark = pytest.mark.usefixtures("fp64_one_thread")


def _assert_same_state(engine: Engine, atoms) -> None:
    engine.sync_atoms()
    assert np.abs(engine.atoms.positions - atoms.positions).max() <= TOL
    assert np.abs(engine.atoms.get_momenta() - atoms.get_momenta()).max() <= TOL


# ---------------------------------------------------------------------------------------------
# Equal to ASE


@pytest.mark.smoke
def test_nve_equals_ase_velocity_verlet():
    lj = lennard_jones()
    atoms = argon_box()
    ref = atoms.copy()
    ref.calc = TorchCalculator(lj)
    engine = energy_function_engine(lj, atoms.copy(), VelocityVerlet(4.0), block=7)
    engine.run(100)
    AseVelocityVerlet(ref, 4.0 * units.fs).run(100)
    assert engine.step == 100
    _assert_same_state(engine, ref)
    assert abs(engine.atoms.get_potential_energy() - ref.get_potential_energy()) <= 1e-12
    assert float(np.abs(ref.positions - atoms.positions).max()) > 0.5, "the atoms moved: a real comparison"


@pytest.mark.smoke
def test_langevin_equals_ase_langevin_with_the_same_random_numbers():
    lj = lennard_jones()
    atoms = argon_box(seed=1)
    ref = atoms.copy()
    ref.calc = TorchCalculator(lj)
    engine = energy_function_engine(lj, atoms.copy(), Langevin(4.0, 300.0, 0.02), block=9)
    engine.noise = ReplayNoise(11)
    engine.run(100)
    AseLangevin(ref, 4.0 * units.fs, temperature_K=300.0, friction=0.02 / units.fs,
                rng=np.random.default_rng(11), fixcm=False).run(100)
    _assert_same_state(engine, ref)


# ---------------------------------------------------------------------------------------------
# Distributions


def _series(engine: Engine, steps: int, every: int, *names: str) -> dict[str, np.ndarray]:
    out = {name: [] for name in names}

    def observe(e: Engine) -> None:
        a = e.atoms
        values = {"T": a.get_temperature(), "U": a.get_potential_energy(), "K": a.get_kinetic_energy(),
                  "V": a.get_volume()}
        for name in names:
            out[name].append(values[name])

    engine.run(steps, every=every, callback=observe)
    return {k: np.array(v) for k, v in out.items()}


@pytest.mark.slow
def test_langevin_samples_the_canonical_distribution():
    """64 tethered oscillators (3N = 192 quadratic kinetic and potential terms): <T> = T0, var(T) = 2 T0^2 / 3N,
    <U> = 3N kT / 2 (ASE's scheme has an O(dt^2) bias, small at omega dt <= 0.1)."""
    n, t0 = 64, 300.0
    atoms = oscillators(n, temperature_K=t0)
    engine = energy_function_engine(harmonic_tethers(atoms.positions.copy()), atoms, Langevin(1.0, t0, 0.05),
                                    seed=3, block=50)
    engine.run(300)
    s = _series(engine, 6000, 10, "T", "U")
    assert abs(s["T"].mean() / t0 - 1) < 0.02
    assert 0.8 < s["T"].var() / (2 * t0**2 / (3 * n)) < 1.25
    assert abs(s["U"].mean() / (1.5 * n * units.kB * t0) - 1) < 0.03


@pytest.mark.slow  # > 10 s on a CPU: the full tier (CI) runs it
def test_csvr_kinetic_energy_is_gamma_distributed():
    """An ideal gas (no forces) with CSVR: K alone follows the thermostat's Markov chain, whose stationary law is
    Gamma(dof / 2, kT): mean dof kT / 2, variance dof (kT)^2 / 2."""
    n, t0 = 32, 300.0
    atoms = oscillators(n, temperature_K=50.0)  # starts cold: the thermostat must bring it up
    dof = 3 * n
    engine = energy_function_engine(zero_energy, atoms, CSVR(1.0, t0, tau_fs=10.0, dof=dof), seed=5, block=100)
    engine.run(200)
    k = _series(engine, 8000, 4, "K")["K"]
    kt = units.kB * t0
    assert abs(k.mean() / (0.5 * dof * kt) - 1) < 0.02
    assert 0.85 < k.var() / (0.5 * dof * kt**2) < 1.15
    assert engine.state.extra["heat"] > 0, "the heat put in is tracked"


@pytest.mark.slow
def test_csvr_thermostats_a_lennard_jones_crystal():
    """Argon (27 atoms, momentum conserved: dof = 3N - 3) with CSVR: canonical mean and fluctuation of K, and
    the effective energy (E - heat) conserved."""
    lj = lennard_jones()
    atoms = argon_box(temperature_K=60.0)
    t0 = 60.0
    engine = energy_function_engine(lj, atoms, CSVR(4.0, t0, tau_fs=100.0), seed=2, block=50)
    e0 = engine.conserved_energy()
    engine.run(300)
    k = _series(engine, 4000, 5, "K")["K"]
    dof, kt = 3 * len(atoms) - 3, units.kB * t0
    assert abs(k.mean() / (0.5 * dof * kt) - 1) < 0.05
    assert 0.7 < k.var() / (0.5 * dof * kt**2) < 1.3
    assert abs(engine.conserved_energy() - e0) / len(atoms) < 2e-4  # eV/atom over 17 ps


@pytest.mark.slow
@pytest.mark.parametrize("anisotropic", [False, True])
def test_stochastic_cell_rescaling_samples_the_ideal_gas_volume(anisotropic):
    """Ideal gas of N atoms at P0 (flat measure in V): V ~ Gamma(N + 1, kT / P0), <V> = (N + 1) kT / P0. At N = 8
    a sampler without the right Jacobian or Itô term is 1/(N + 1) = 11% off."""
    n, t0 = 8, 300.0
    kt = units.kB * t0
    p0 = (n + 1) * kt / 2000.0  # <V> = 2000 Å^3
    atoms = oscillators(n, temperature_K=t0, seed=4)
    atoms.set_cell(np.eye(3) * 12.0)
    atoms.pbc = True
    # A strong thermostat (tau 4 fs) decorrelates K within steps, so V decorrelates in ~tau_p / dt = 20 steps:
    # ~600 independent samples, 1.4% on <V>. Euler-Maruyama in ln V at dt / tau_p = 0.05 is ~0.8% high.
    integrator = StochasticCellRescaling(2.0, t0, p0 / units.GPa, tau_fs=4.0, tau_p_fs=40.0,
                                         compressibility_per_GPa=units.GPa / p0, anisotropic=anisotropic, dof=3 * n)
    engine = energy_function_engine(zero_energy, atoms, integrator, seed=6, block=100)
    engine.run(500)
    v = _series(engine, 12000, 4, "V")["V"]
    mean = (n + 1) * kt / p0
    assert abs(v.mean() / mean - 1) < 0.045
    assert 0.7 < v.var() / ((n + 1) * (kt / p0) ** 2) < 1.35
    cell = engine.atoms.cell.array
    if anisotropic:
        assert abs(cell[0, 0] / cell[1, 1] - 1) > 1e-6, "the axes moved independently"
    else:
        assert np.allclose(cell / cell[0, 0], np.eye(3)), "isotropic: the cell stays cubic"


@pytest.mark.slow
def test_stochastic_cell_rescaling_reaches_the_target_pressure():
    """Argon fluid (64 atoms, 150 K, 0.1 GPa; CSVR + C-rescale; LJ cut at 6.5 Å < half the box): after
    equilibration the mean pressure (virial + kinetic) equals the target within its statistical error, and the
    density settles."""
    lj = lennard_jones(cutoff=6.5)
    atoms = argon_box(n_side=4, spacing=3.75, temperature_K=150.0, seed=2)
    target = 0.1
    integrator = StochasticCellRescaling(4.0, 150.0, target, tau_fs=100.0, tau_p_fs=400.0,
                                         compressibility_per_GPa=2.0)
    engine = energy_function_engine(lj, atoms, integrator, seed=1, block=50)
    engine.run(1500)
    pressures, volumes = [], []

    def observe(e: Engine) -> None:
        s = e.state
        pressure = pressure_tensor(s.momenta, s.masses, s.virial, cell_volume(s.cell))
        pressures.append(float(torch.diagonal(pressure).mean()) / units.GPa)
        volumes.append(e.atoms.get_volume())

    engine.run(3000, every=10, callback=observe)
    p, v = np.array(pressures), np.array(volumes)
    assert 2 * 6.5 < v.min() ** (1 / 3), "the cutoff stays below half the box"
    error = p.std() / np.sqrt(len(p) / 10)  # ~10 samples (100 steps) per correlation time
    assert abs(p.mean() - target) < max(4 * error, 0.02), (p.mean(), error)
    # V fluctuates by sqrt(kT beta / V) ~ 3.5% here with a ~100-step correlation: the halves agree to ~2%
    # (one sigma); a density still drifting (or a barostat running away) leaves that far behind
    assert abs(v[: len(v) // 2].mean() / v[len(v) // 2:].mean() - 1) < 0.08


# ---------------------------------------------------------------------------------------------
# Fused (compiled) integrator arithmetic


FUSED_CASES = {"langevin": lambda: Langevin(4.0, 120.0, 0.02), "csvr": lambda: CSVR(4.0, 120.0, 50.0),
               "npt": lambda: StochasticCellRescaling(4.0, 120.0, 0.05, tau_p_fs=200.0),
               "npt-aniso": lambda: StochasticCellRescaling(4.0, 120.0, 0.05, tau_p_fs=200.0, anisotropic=True)}


def _fused_and_plain(name: str, backend: str) -> tuple[Engine, Engine]:
    torch._dynamo.reset()
    lj = lennard_jones()
    atoms = argon_box(seed=3)
    plain = energy_function_engine(lj, atoms.copy(), FUSED_CASES[name](), seed=9, block=6)
    fused = energy_function_engine(lj, atoms.copy(), FUSED_CASES[name](), seed=9, block=6, fuse_integrator=True,
                                   options=RuntimeOptions(compile_backend=backend))
    assert fused.integrator.fused and not plain.integrator.fused
    for engine in (plain, fused):
        engine.run(30)
    return plain, fused


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "npt-aniso" else n
                                  for n in sorted(FUSED_CASES)])
def test_fused_integrator_traces_to_the_same_trajectory(name):
    """Every scheme's arithmetic goes through torch.compile as one graph (fullgraph: a graph break or a failed
    trace would fall back to eager with a warning, which is an error here) and gives the unfused trajectory."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        plain, fused = _fused_and_plain(name, "aot_eager")
    for key in ("positions", "momenta", "cell"):
        torch.testing.assert_close(getattr(fused.state, key), getattr(plain.state, key), rtol=0, atol=1e-12)
    for key, value in plain.state.extra.items():
        torch.testing.assert_close(fused.state.extra[key], value, rtol=0, atol=1e-12)
    assert float(np.abs(fused.sync_atoms().positions - argon_box(seed=3).positions).max()) > 0.05


@pytest.mark.slow
@pytest.mark.parametrize("name", ["langevin", "npt"])
def test_fused_integrator_with_inductor_on_a_cpu(name):
    """Inductor's generated code (C++ on a CPU): the same trajectory to rounding over 30 steps."""
    plain, fused = _fused_and_plain(name, "inductor")
    for key in ("positions", "momenta", "cell"):
        torch.testing.assert_close(getattr(fused.state, key), getattr(plain.state, key), rtol=0, atol=1e-9)


# ---------------------------------------------------------------------------------------------
# Restart, blow-ups, argument checks


@pytest.mark.parametrize("integrator", [lambda: Langevin(4.0, 120.0, 0.02), lambda: CSVR(4.0, 120.0, 50.0),
                                        lambda: StochasticCellRescaling(4.0, 120.0, 0.05, tau_p_fs=200.0)])
def test_restart_continues_exactly(integrator, tmp_path):
    lj = lennard_jones()
    atoms = argon_box(seed=3)
    whole = energy_function_engine(lj, atoms.copy(), integrator(), seed=9, block=6)
    whole.run(40)
    first = energy_function_engine(lj, atoms.copy(), integrator(), seed=9, block=4)
    first.run(25)
    path = first.save(tmp_path / "state.npz")
    traj = tmp_path / "frames.traj"
    with Trajectory(str(traj), "w") as writer:
        writer.write(first.sync_atoms())
    for source in (path, first.state_dict(), traj):
        if source == traj:
            source = Trajectory(str(traj))[-1]
        second = energy_function_engine(lj, atoms.copy(), integrator(), seed=9, block=5)
        second.load_state(source)
        assert second.step == 25
        second.run(15)
        assert second.step == 40
        for name in ("positions", "momenta", "cell"):
            assert torch.equal(getattr(second.state, name), getattr(whole.state, name)), (source, name)
        for name, value in whole.state.extra.items():
            assert torch.equal(second.state.extra[name], value)


@pytest.mark.parametrize("fused", [False, True])
def test_blow_up_stops_with_the_step_and_the_temperature(fused):
    lj = lennard_jones()
    atoms = argon_box()
    atoms.positions[1] = atoms.positions[0] + [2.0, 0.0, 0.0]  # deep in the repulsive wall
    engine = energy_function_engine(lj, atoms, VelocityVerlet(4.0), max_temperature_K=500.0, block=10,
                                    fuse_integrator=fused, options=AOT_EAGER)  # fused: the bookkeeping traced too
    with pytest.raises(MDBlowUp, match=r"at step \d+: temperature .* above max_temperature_K=500") as info:
        engine.run(50)
    err = info.value
    assert err.quantity == "temperature" and err.value > 500 and 1 <= err.step <= 50
    assert engine.step == err.step - 1, "the state is that of the last good step"
    assert engine.temperature() <= 500


@pytest.mark.parametrize("fused", [False, True])
def test_blow_up_on_non_finite_energy(fused):
    calls = {"n": 0}
    atoms = oscillators(4)
    tethers = harmonic_tethers(atoms.positions.copy())

    def energy(positions, cell):
        calls["n"] += 1  # the first call is the engine's start, then one per step
        e = tethers(positions, cell)
        return e * float("nan") if calls["n"] > 3 else e

    engine = energy_function_engine(energy, atoms, VelocityVerlet(1.0), block=5, fuse_integrator=fused,
                                    options=AOT_EAGER)
    with pytest.raises(MDBlowUp, match=r"at step 3: energy nan"):
        engine.run(10)


def test_arguments_are_checked():
    atoms = argon_box()
    forces = EnergyFunctionForces(lennard_jones())
    with pytest.raises(ValueError, match="timestep_fs"):
        VelocityVerlet(0.0)
    with pytest.raises(ValueError, match="temperature_K"):
        Langevin(1.0, -5.0, 0.01)
    with pytest.raises(TypeError, match="integrator"):
        Engine(forces, atoms, "nve")
    with pytest.raises(ValueError, match="block"):
        Engine(forces, atoms, VelocityVerlet(1.0), block=0)
    with pytest.raises(ValueError, match="pbc"):
        molecule = atoms.copy()
        molecule.pbc = False
        Engine(forces, molecule, StochasticCellRescaling(1.0, 300.0))
    with pytest.raises(ValueError, match="cuda_graph=True"):
        Engine(forces, atoms, VelocityVerlet(1.0), cuda_graph=True)
    with pytest.raises(TypeError, match="fuse_integrator: expected None, True or False, got 'yes'"):
        Engine(forces, atoms, VelocityVerlet(1.0), fuse_integrator="yes")
    with pytest.raises(TypeError, match="compile: expected None or a callable"):
        VelocityVerlet(1.0).fuse("inductor")
    engine = Engine(forces, atoms, VelocityVerlet(1.0))
    with pytest.raises(ValueError, match="restart: 8 atoms"):
        engine.load_state({"positions": np.zeros((8, 3))})
    with pytest.raises(FileNotFoundError, match="restart"):
        engine.load_state("missing.npz")
