"""Molecular dynamics with ASE's integrators: NVT (Langevin) or NVE (velocity Verlet), progress and trajectory.

    from cgforge.plugin import Calculator, run_md, water_box
    atoms = water_box(1728)
    atoms.calc = Calculator("mace")
    summary = run_md(atoms, ensemble="nvt", temperature_K=300, timestep_fs=0.5, steps=1000,
                     trajectory="water.traj")

Progress lines give the step, simulated time, speed (ns/day of wall time since the previous line),
temperature and the drift of the total energy (kinetic + potential) since step 0 in meV/atom (a
conservation check in NVE; in NVT the thermostat exchanges energy, so it only shows the trend).
Trajectories are ASE ``.traj`` files, or extended XYZ for ``.xyz``/``.extxyz`` names, and are always
written to a new file: an existing one is replaced only with ``force=True``.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np
from ase import Atoms, units
from ase.md.langevin import Langevin
from ase.md.velocitydistribution import Stationary
from ase.md.verlet import VelocityVerlet

__all__ = ["run_md", "MDSummary", "check_new_path", "default_trajectory_path", "add_md_arguments",
           "run_from_args"]

ENSEMBLES = ("nvt", "nve")
_XYZ_SUFFIXES = (".xyz", ".extxyz")


@dataclass
class MDSummary:
    steps: int
    simulated_ps: float
    wall_s: float
    ns_per_day: float
    temperature_K: float
    energy_drift_meV_per_atom: float
    trajectory: str | None
    n_atoms: int


def check_new_path(path: str | os.PathLike, force: bool = False, what: str = "trajectory") -> Path:
    """``path`` as a Path, after refusing an existing file (unless ``force``), a directory or a missing parent."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{what}: {path} is a directory, expected a file name")
    if path.exists() and not force:
        raise FileExistsError(f"{what}: {path} exists; choose a new name or pass --force (force=True) to overwrite")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"{what}: directory {path.parent} does not exist")
    if path.suffix.lower() not in (".traj", *_XYZ_SUFFIXES):
        raise ValueError(f"{what}: {path} must end with .traj, .xyz or .extxyz")
    return path


def default_trajectory_path(stem: str = "md", directory: str | os.PathLike = ".") -> Path:
    """A file name that does not exist yet: ``<stem>-<date>-<time>.traj`` (with -1, -2... if needed)."""
    base = f"{stem}-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    path = Path(directory) / f"{base}.traj"
    n = 0
    while path.exists():
        n += 1
        path = Path(directory) / f"{base}-{n}.traj"
    return path


def _positive(name: str, value: float, allow_zero: bool = False) -> float:
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__}") from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name}: expected a finite number {'>=' if allow_zero else '>'} 0, got {value!r}")
    return value


def _count(name: str, value: int, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")
    return int(value)


class _TrajectoryWriter:
    def __init__(self, path: Path, atoms: Atoms) -> None:
        self.path = path
        self.atoms = atoms
        if path.exists():
            path.unlink()  # force=True was checked by the caller: start a fresh file
        if path.suffix.lower() in _XYZ_SUFFIXES:
            self._traj = None
        else:
            from ase.io.trajectory import Trajectory

            self._traj = Trajectory(str(path), "w", atoms)

    def write(self) -> None:
        if self._traj is not None:
            self._traj.write()
        else:
            from ase.io import write

            write(str(self.path), self.atoms, format="extxyz", append=True)

    def close(self) -> None:
        if self._traj is not None:
            self._traj.close()


class _Progress:
    """Prints a line every ``interval`` steps: step, ps, ns/day, T, total energy and its drift."""

    def __init__(self, atoms: Atoms, dyn, timestep_fs: float, out: Callable[[str], None]) -> None:
        self.atoms, self.dyn, self.timestep_fs, self.out = atoms, dyn, timestep_fs, out
        self.n_atoms = len(atoms)
        self.e0: float | None = None
        self.last_step = 0
        self.last_time = time.perf_counter()
        self.drift = 0.0
        self.ns_per_day = float("nan")

    def header(self) -> None:
        self.out(f"{'step':>8s} {'time[ps]':>10s} {'ns/day':>9s} {'T[K]':>8s} {'Etot[eV]':>14s} "
                 f"{'drift[meV/atom]':>16s}")

    def __call__(self) -> None:
        step = self.dyn.nsteps
        now = time.perf_counter()
        epot = self.atoms.get_potential_energy()  # cached by the calculator with the forces
        etot = epot + self.atoms.get_kinetic_energy()
        if self.e0 is None:
            self.e0 = etot
        self.drift = (etot - self.e0) / self.n_atoms * 1000.0
        if step > self.last_step:
            simulated_ns = (step - self.last_step) * self.timestep_fs * 1e-6
            self.ns_per_day = simulated_ns / ((now - self.last_time) / 86400.0)
        speed = f"{self.ns_per_day:9.3f}" if math.isfinite(self.ns_per_day) else f"{'-':>9s}"
        self.out(f"{step:8d} {step * self.timestep_fs / 1000:10.4f} {speed} {self.atoms.get_temperature():8.1f} "
                 f"{etot:14.5f} {self.drift:16.4f}")
        self.last_step, self.last_time = step, now


def run_md(
    atoms: Atoms,
    calculator=None,
    *,
    ensemble: str = "nvt",
    temperature_K: float = 300.0,
    timestep_fs: float = 0.5,
    steps: int = 100,
    friction: float = 0.01,
    trajectory: str | os.PathLike | None = None,
    trajectory_interval: int = 10,
    log_interval: int = 10,
    seed: int = 0,
    force: bool = False,
    init_velocities: bool | None = None,
    log: TextIO | Callable[[str], None] | None = print,
) -> MDSummary:
    """Run NVT (Langevin, ``friction`` in 1/fs) or NVE (velocity Verlet) MD on ``atoms`` in place.

    ``calculator`` replaces ``atoms.calc`` when given. Velocities are drawn from Maxwell-Boltzmann at
    ``temperature_K`` (``seed``, zero total momentum) when ``init_velocities`` is True, or when it is None and
    the atoms are at rest. ``trajectory``: a new .traj/.xyz/.extxyz file written every ``trajectory_interval``
    steps (an existing file only with ``force=True``). ``log``: a callable taking a line (default: print),
a stream, or None for silence.
    """
    if not isinstance(atoms, Atoms):
        raise TypeError(f"atoms: expected an ase.Atoms, got {type(atoms).__name__}")
    if len(atoms) == 0:
        raise ValueError("atoms: expected a structure with at least one atom, got an empty Atoms")
    if calculator is not None:
        atoms.calc = calculator
    if atoms.calc is None:
        raise ValueError("calculator: atoms has no calculator; pass one (e.g. cgforge.plugin.Calculator('mace'))")
    ensemble = str(ensemble).lower()
    if ensemble not in ENSEMBLES:
        raise ValueError(f"ensemble: expected one of {ENSEMBLES}, got {ensemble!r}")
    temperature_K = _positive("temperature_K", temperature_K, allow_zero=True)
    timestep_fs = _positive("timestep_fs", timestep_fs)
    friction = _positive("friction", friction, allow_zero=True)
    steps = _count("steps", steps, 0)
    trajectory_interval = _count("trajectory_interval", trajectory_interval, 1)
    log_interval = _count("log_interval", log_interval, 1)
    path = check_new_path(trajectory, force) if trajectory is not None else None
    out = _printer(log)

    rng = np.random.default_rng(seed)
    if init_velocities or (init_velocities is None and not np.any(atoms.get_momenta())):
        _thermalize(atoms, temperature_K, rng)
        Stationary(atoms)
    if ensemble == "nvt":
        # fixcm=False: ASE >= 3.28 deprecates its approximate centre-of-mass fix (the box may drift as a whole)
        dyn = Langevin(atoms, timestep_fs * units.fs, temperature_K=temperature_K,
                       friction=friction / units.fs, rng=rng, fixcm=False)
    else:
        dyn = VelocityVerlet(atoms, timestep_fs * units.fs)

    writer = _TrajectoryWriter(path, atoms) if path is not None else None
    if writer is not None:
        dyn.attach(writer.write, interval=trajectory_interval)
    progress = _Progress(atoms, dyn, timestep_fs, out)
    dyn.attach(progress, interval=log_interval)
    out(f"cgforge md: {len(atoms)} atoms, {ensemble.upper()}"
        + (f" at {temperature_K:g} K" if ensemble == "nvt" else "")
        + f", timestep {timestep_fs:g} fs, {steps} steps" + (f", trajectory {path}" if path else ""))
    progress.header()
    start = time.perf_counter()
    try:
        dyn.run(steps)
    finally:
        if writer is not None:
            writer.close()
    wall = time.perf_counter() - start
    if steps % log_interval:
        progress()  # the last step, when the interval did not land on it
    simulated_ps = steps * timestep_fs / 1000.0
    summary = MDSummary(
        steps=steps, simulated_ps=simulated_ps, wall_s=wall,
        ns_per_day=(simulated_ps * 1e-3) / (wall / 86400.0) if wall > 0 and steps else float("nan"),
        temperature_K=float(atoms.get_temperature()), energy_drift_meV_per_atom=progress.drift,
        trajectory=str(path) if path else None, n_atoms=len(atoms),
    )
    out(f"done: {steps} steps, {simulated_ps:g} ps in {wall:.1f} s ({summary.ns_per_day:.3f} ns/day)"
        + (f"; trajectory: {path}" if path else ""))
    return summary


def relax_structure(atoms: Atoms, calc: Any, steps: int, fmax: float = 0.1) -> None:
    """At most ``steps`` FIRE steps towards ``fmax`` (eV/Å), printing the energy before and after.

    The generated water box holds rigid, randomly oriented molecules on a grid, far from the model's
    equilibrium: started straight into MD it heats to ~1500 K within 20 fs.
    """
    from ase.optimize import FIRE

    atoms.calc = calc
    before = atoms.get_potential_energy()
    optimizer = FIRE(atoms, logfile=None)
    optimizer.run(fmax=fmax, steps=steps)
    after = atoms.get_potential_energy()
    print(f"relaxed {optimizer.nsteps} FIRE steps: energy {before:.4f} -> {after:.4f} eV, "
          f"max force {float(np.linalg.norm(atoms.get_forces(), axis=1).max()):.3f} eV/Å", flush=True)


def _thermalize(atoms: Atoms, temperature_K: float, rng: np.random.Generator) -> None:
    """Maxwell-Boltzmann momenta (ASE >= 3.28 names it thermalize_momenta)."""
    try:
        from ase.md.velocitydistribution import thermalize_momenta
    except ImportError:
        from ase.md.velocitydistribution import MaxwellBoltzmannDistribution as thermalize_momenta
    thermalize_momenta(atoms, temperature_K=temperature_K, rng=rng)


def _printer(log: TextIO | Callable[[str], None] | None) -> Callable[[str], None]:
    if log is None:
        return lambda line: None
    if log is print:
        return lambda line: print(line, flush=True)  # the sys.stdout of the moment (pytest, redirections)
    if callable(log) and not hasattr(log, "write"):
        return log

    def write(line: str) -> None:
        log.write(line + "\n")
        log.flush()

    return write


# ---------------------------------------------------------------------------------------------
# Command line (shared by `cgforge md` and examples/water_md.py)

CPU_MOLECULES = 32  # a CPU-sized default box (96 atoms)
GPU_MOLECULES = 1728  # the benchmarks' 5184-atom box
DEFAULT_RELAX = 100  # FIRE steps for a generated box


def add_md_arguments(parser: argparse.ArgumentParser) -> None:
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--molecules", type=int, default=None,
                      help=f"water molecules in the box (default {GPU_MOLECULES} on a GPU, {CPU_MOLECULES} on CPU)")
    what.add_argument("--structure", default=None, help="read the structure from this file (any ase.io format)")
    parser.add_argument("--model", default="mace",
                        help="'mace' or 'nequip' (bundled water models), or a .model/.ckpt/.nequip.zip file")
    parser.add_argument("--ensemble", choices=ENSEMBLES, default="nvt", help="nvt (Langevin) or nve")
    parser.add_argument("--temperature", type=float, default=300.0, help="K (default 300)")
    parser.add_argument("--timestep", type=float, default=0.5, help="fs (default 0.5)")
    parser.add_argument("--steps", type=int, default=100, help="MD steps (default 100)")
    parser.add_argument("--friction", type=float, default=0.01, help="Langevin friction in 1/fs (default 0.01)")
    parser.add_argument("--seed", type=int, default=0, help="velocities, thermostat noise and box (default 0)")
    parser.add_argument("-o", "--trajectory", default=None,
                        help="trajectory file to write, .traj or .xyz (default: a new md-<date>-<time>.traj)")
    parser.add_argument("--traj-interval", type=int, default=10, help="steps between frames (default 10)")
    parser.add_argument("--log-interval", type=int, default=10, help="steps between progress lines (default 10)")
    parser.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available)")
    parser.add_argument("--dtype", choices=("float32", "float64"), default=None,
                        help="model precision (default: the model's)")
    parser.add_argument("--skin", type=float, default=1.0, help="neighbour-list skin in Å (default 1.0)")
    parser.add_argument("--relax", type=int, default=None,
                        help="FIRE steps (to 0.1 eV/Å) before MD (default 100 for a generated box, whose rigid "
                             "grid-placed molecules would otherwise heat to ~1500 K; 0 for --structure)")
    parser.add_argument("--radial-precision", choices=("fp32", "tf32", "3xtf32"), default="fp32",
                        help="radial-MLP products: fp32 (default), tf32 or 3xtf32 on tensor cores (CUDA, FP32 "
                             "models; kept only if the first structure's forces change by <= 1e-4 relative, "
                             "which is printed)")
    parser.add_argument("--force", action="store_true", help="overwrite the trajectory file if it exists")


def relax_steps(args: argparse.Namespace) -> int:
    """FIRE steps before MD: --relax, else 100 for a generated box and 0 for a structure file."""
    steps = args.relax if args.relax is not None else (0 if args.structure is not None else DEFAULT_RELAX)
    if steps < 0:
        raise ValueError(f"--relax: expected a number of steps >= 0, got {steps}")
    return steps


def run_from_args(args: argparse.Namespace, stem: str = "md") -> MDSummary:
    from .calculator import Calculator, resolve_device
    from .water import water_box

    relax = relax_steps(args)  # bad input fails before the model is loaded and compiled
    device = resolve_device(args.device)
    path = (check_new_path(args.trajectory, args.force) if args.trajectory is not None
            else default_trajectory_path(stem))
    if args.structure is not None:
        from ase.io import read

        if not os.path.isfile(args.structure):
            raise FileNotFoundError(f"--structure: {args.structure} not found")
        atoms = read(args.structure)
    else:
        n = args.molecules if args.molecules is not None else (GPU_MOLECULES if device.type == "cuda"
                                                               else CPU_MOLECULES)
        atoms = water_box(n, seed=args.seed)
    t = time.perf_counter()
    calc = Calculator(args.model, device=device, dtype=args.dtype, skin=args.skin,
                      radial_precision=args.radial_precision)
    print(f"model {args.model} ({calc.adapter.kind}, cutoff {calc.cutoff:g} Å) on {device} in {calc.dtype}, "
          f"ready in {time.perf_counter() - t:.1f} s (kernels compiled)", flush=True)
    if calc.radial_precision_requested != "fp32":
        atoms.calc = calc
        atoms.get_forces()  # the first structure decides (see Calculator)
        mode = calc.radial_precision_requested
        kept = "kept" if calc.radial_precision == mode else "refused: radial MLPs stay in fp32"
        print(f"radial MLPs in {mode} {kept}: the forces changed by {calc.radial_precision_error:.1e} relative "
              f"(tolerance 1e-4)", flush=True)
    if relax:
        relax_structure(atoms, calc, relax)
    summary = run_md(atoms, calc, ensemble=args.ensemble, temperature_K=args.temperature,
                     timestep_fs=args.timestep, steps=args.steps, friction=args.friction, trajectory=path,
                     trajectory_interval=args.traj_interval, log_interval=args.log_interval, seed=args.seed,
                     force=args.force)
    return summary
