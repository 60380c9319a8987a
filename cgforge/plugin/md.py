"""Molecular dynamics with ASE's integrators: NVT (Langevin), NVE (velocity Verlet) or NPT (Berendsen), with
progress lines, a trajectory, blow-up detection, restarts and a clean Ctrl-C.

    from cgforge.plugin import Calculator, run_md, water_box
    atoms = water_box(1728)
    atoms.calc = Calculator("mace")
    summary = run_md(atoms, ensemble="nvt", temperature_K=300, timestep_fs=0.5, steps=1000,
                     trajectory="water.traj", log="water.log")
    run_md(None, Calculator("mace"), restart="water.traj", steps=1000, trajectory="water-2.traj")

Progress lines give the step, simulated time, speed (ns/day of wall time since the previous line),
temperature and the drift of the total energy (kinetic + potential) since step 0 in meV/atom (a
conservation check in NVE; in NVT and NPT the thermostat exchanges energy, so it only shows the trend).

Trajectories are ASE ``.traj`` files, or extended XYZ for ``.xyz``/``.extxyz`` names, always written to a
new file: an existing one is replaced only with ``force=True``, and only once the first frame is complete
(the first frame goes to a hidden temporary file in the same folder, renamed over the name). The last step
is always written. Every frame's ``atoms.info`` holds ``md_step``, ``md_time_fs``, ``md_etot0`` (the total
energy at step 0, for the drift) and, for Langevin NVT, ``md_rng`` (the random generator's state), which is
what a restart needs: from a ``.traj`` file a restarted run repeats the uninterrupted one exactly (extended
XYZ stores positions to 1e-8 Å, so a restart from it continues closely but not bit for bit).

After every step the state is checked: non-finite forces or energy, or a temperature above
``max_temperature_K`` (default ``max(5000 K, 10 x temperature_K)``), stop the run with
:class:`MDInstabilityError` naming the step and the value; the trajectory written so far stays readable.
Ctrl-C stops after the current step, writes that step's frame and raises :class:`MDInterrupted`.
"""

from __future__ import annotations

import argparse
import datetime
import difflib
import inspect
import json
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np
from ase import Atoms, units

__all__ = ["run_md", "MDSummary", "MDInstabilityError", "MDInterrupted", "Restart", "read_restart",
           "read_structure", "check_new_path", "default_trajectory_path", "add_md_arguments", "prepare_md",
           "run_from_args", "relax_structure", "model_banner"]

ENSEMBLES = ("nvt", "nve", "npt")
_XYZ_SUFFIXES = (".xyz", ".extxyz")
_TRAJ_SUFFIXES = (".traj", *_XYZ_SUFFIXES)

# Blow-up limit when none is given: far above any liquid or solid a user runs, far below what a run that
# exploded reaches (1e5-1e6 K within a few steps); 10x the target for hot runs.
MAX_TEMPERATURE_FLOOR_K = 5000.0
MAX_TEMPERATURE_FACTOR = 10.0

# NPT (Berendsen) defaults: 1 atm, water's isothermal compressibility at 300 K.
DEFAULT_PRESSURE_BAR = 1.01325
DEFAULT_COMPRESSIBILITY_PER_BAR = 4.57e-5
DEFAULT_TAUT_FS = 100.0
DEFAULT_TAUP_FS = 1000.0
DEFAULT_FRICTION = 0.01  # 1/fs, Langevin

_NPT_OPTIONS = ("pressure_bar", "taut_fs", "taup_fs", "compressibility_per_bar")


class MDInstabilityError(RuntimeError):
    """The run blew up: non-finite forces/energy or a runaway temperature at ``step``."""

    def __init__(self, step: int, quantity: str, value: float, message: str) -> None:
        super().__init__(message)
        self.step, self.quantity, self.value = step, quantity, value


class MDInterrupted(KeyboardInterrupt):
    """Ctrl-C during :func:`run_md`: the run stopped cleanly after ``step``; ``summary`` describes it."""

    def __init__(self, message: str, step: int, summary: MDSummary) -> None:
        super().__init__(message)
        self.step, self.summary = step, summary


@dataclass
class MDSummary:
    steps: int  # steps run by this call
    simulated_ps: float
    wall_s: float
    ns_per_day: float
    temperature_K: float
    energy_drift_meV_per_atom: float
    trajectory: str | None
    n_atoms: int
    first_step: int = 0  # the step counter at the start (> 0 after a restart)
    last_step: int = 0
    log: str | None = None
    atoms: Atoms | None = field(default=None, repr=False)


@dataclass
class Restart:
    """The state a restart continues from: the last frame of a trajectory written by :func:`run_md`."""

    path: Path
    atoms: Atoms
    step: int
    time_fs: float
    etot0: float | None
    rng_state: dict | None


# ---------------------------------------------------------------------------------------------
# Checks


def check_new_path(path: str | os.PathLike, force: bool = False, what: str = "trajectory",
                   suffixes: tuple[str, ...] | None = _TRAJ_SUFFIXES) -> Path:
    """``path`` as a Path, after refusing an existing file (unless ``force``), a directory, a missing parent
    or (when ``suffixes`` is given) a name that does not end with one of them."""
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"{what}: expected a file name, got {type(path).__name__}")
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{what}: {path} is a directory, expected a file name")
    if path.exists() and not force:
        raise FileExistsError(f"{what}: {path} exists; choose a new name or pass --force (force=True) to overwrite")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"{what}: directory {path.parent} does not exist")
    if suffixes is not None and path.suffix.lower() not in suffixes:
        raise ValueError(f"{what}: {path} must end with {', '.join(suffixes[:-1])} or {suffixes[-1]}")
    return path


def _same_file(a: Path, b: Path) -> bool:
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)  # hard links
    except OSError:
        return False


def check_distinct(outputs: dict[str, Path | None], inputs: dict[str, Path | None]) -> None:
    """Refuse an output that names an input file or another output (``force`` never overrides this)."""
    outs = [(k, v) for k, v in outputs.items() if v is not None]
    for i, (name, path) in enumerate(outs):
        for in_name, in_path in inputs.items():
            if in_path is not None and _same_file(path, in_path):
                raise ValueError(f"{name}: {path} is the {in_name} file; cgforge never writes over its input")
        for other, other_path in outs[i + 1:]:
            if _same_file(path, other_path):
                raise ValueError(f"{name} and {other} name the same file ({path}); give them different names")


def default_trajectory_path(stem: str = "md", directory: str | os.PathLike = ".") -> Path:
    """A file name that does not exist yet: ``<stem>-<date>-<time>.traj`` (with -1, -2... if needed)."""
    base = f"{stem}-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    path = Path(directory) / f"{base}.traj"
    n = 0
    while path.exists():
        n += 1
        path = Path(directory) / f"{base}-{n}.traj"
    return path


def _number(name: str, value: Any, *, minimum: float | None = 0.0, strict: bool = True,
            allow_inf: bool = False) -> float:
    """A float; > minimum (strict) or >= minimum; finite unless ``allow_inf``."""
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__} {value!r}")
    value = float(value)
    ok = not math.isnan(value) and (math.isfinite(value) or (allow_inf and value > 0))
    if minimum is not None:
        ok = ok and (value > minimum if strict else value >= minimum)
    if not ok:
        bound = "" if minimum is None else f" {'>' if strict else '>='} {minimum:g}"
        raise ValueError(f"{name}: expected a finite number{bound}, got {value!r}")
    return value


def _count(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name}: expected an int >= {minimum}, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")
    return int(value)


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{name}: expected True or False, got {type(value).__name__} {value!r}")
    return bool(value)


def default_max_temperature(temperature_K: float) -> float:
    return max(MAX_TEMPERATURE_FLOOR_K, MAX_TEMPERATURE_FACTOR * temperature_K)


def _checked_options(o: dict[str, Any], name: Callable[[str], str]) -> dict[str, Any]:
    """The MD options of :func:`run_md`, checked; ``name`` turns an argument's name into what the user typed
    (the Python name for run_md, the flag for the command line)."""
    o = dict(o)
    ensemble = o["ensemble"]
    if not isinstance(ensemble, str):
        raise TypeError(f"{name('ensemble')}: expected one of {', '.join(ENSEMBLES)}, got {type(ensemble).__name__}")
    o["ensemble"] = ensemble = ensemble.lower()
    if ensemble not in ENSEMBLES:
        raise ValueError(f"{name('ensemble')}: expected one of {', '.join(ENSEMBLES)}, got {ensemble!r}")
    o["temperature_K"] = _number(name("temperature_K"), o["temperature_K"], strict=False)
    o["timestep_fs"] = _number(name("timestep_fs"), o["timestep_fs"])
    o["steps"] = _count(name("steps"), o["steps"], 0)
    o["trajectory_interval"] = _count(name("trajectory_interval"), o["trajectory_interval"], 1)
    o["log_interval"] = _count(name("log_interval"), o["log_interval"], 1)
    o["seed"] = _count(name("seed"), o["seed"], 0)
    # Options of one ensemble are refused for the others: a --friction with NVE would silently do nothing.
    if o["friction"] is not None and ensemble != "nvt":
        raise ValueError(f"{name('friction')}: the Langevin friction is for NVT only; this run is {ensemble.upper()}")
    o["friction"] = _number(name("friction"), DEFAULT_FRICTION if o["friction"] is None else o["friction"],
                            strict=False)
    given_npt = [k for k in _NPT_OPTIONS if o[k] is not None]
    if given_npt and ensemble != "npt":
        raise ValueError(f"{name(given_npt[0])}: a barostat option, for NPT only; this run is {ensemble.upper()} "
                         f"(choose the NPT ensemble to use it)")
    defaults = (DEFAULT_PRESSURE_BAR, DEFAULT_TAUT_FS, DEFAULT_TAUP_FS, DEFAULT_COMPRESSIBILITY_PER_BAR)
    for key, default in zip(_NPT_OPTIONS, defaults, strict=True):
        value = default if o[key] is None else o[key]
        o[key] = _number(name(key), value, minimum=None if key == "pressure_bar" else 0.0)
    if o["max_temperature_K"] is None:
        o["max_temperature_K"] = default_max_temperature(o["temperature_K"])
    else:
        o["max_temperature_K"] = _number(name("max_temperature_K"), o["max_temperature_K"], allow_inf=True)
        if ensemble != "nve" and o["max_temperature_K"] <= o["temperature_K"]:
            raise ValueError(f"{name('max_temperature_K')}: the blow-up limit {o['max_temperature_K']:g} K must be "
                             f"above the target temperature {o['temperature_K']:g} K")
    o["force"] = _flag(name("force"), o["force"])
    if o["init_velocities"] is not None:
        o["init_velocities"] = _flag(name("init_velocities"), o["init_velocities"])
    return o


def _check_atoms_for(ensemble: str, atoms: Atoms, name: Callable[[str], str]) -> None:
    if ensemble == "npt" and not (atoms.pbc.all() and abs(atoms.cell.volume) > 0):
        raise ValueError(f"{name('ensemble')}: NPT changes the cell and needs a periodic 3-D cell; this structure "
                         f"has pbc={atoms.pbc.tolist()} and volume {abs(atoms.cell.volume):g} Å^3")


# ---------------------------------------------------------------------------------------------
# Reading structures and restarts


def read_structure(path: str | os.PathLike, what: str = "structure", index: int | str = -1) -> Atoms:
    """The structure in ``path`` (any ase.io format; the last frame of a trajectory), or one clear error
    naming ``what`` and the file: missing, a directory, empty, not a structure, no atoms."""
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"{what}: expected a file name, got {type(path).__name__}")
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{what}: {path} not found")
    if path.is_dir():
        raise IsADirectoryError(f"{what}: {path} is a directory, expected a structure file")
    if path.stat().st_size == 0:
        raise ValueError(f"{what}: {path} is empty")
    from ase.io import read

    try:
        atoms = read(path, index=index)
    except Exception as err:  # ase.io raises a different type per format; all mean "not a structure"
        reason = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        raise ValueError(f"{what}: {path}: not a structure file ase.io can read (e.g. .xyz, .extxyz, .traj, "
                         f"POSCAR, .cif): {type(err).__name__}: {reason}") from None
    if isinstance(atoms, list):
        atoms = atoms[-1] if atoms else None
    if not isinstance(atoms, Atoms) or len(atoms) == 0:
        raise ValueError(f"{what}: {path} holds no atoms")
    return atoms


def _encode_rng(state: dict) -> str:
    # Hex of JSON: only [0-9a-f], so the state survives extended XYZ's key=value comment line as well as .traj.
    return json.dumps(state).encode().hex()


def _decode_rng(text: Any, what: str, path: Path) -> dict:
    try:
        state = json.loads(bytes.fromhex(str(text)).decode())
        if not isinstance(state, dict) or "bit_generator" not in state:
            raise ValueError("not a generator state")
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{what}: {path}: the saved random state md_rng is unreadable ({err})") from None
    ours = type(np.random.default_rng(0).bit_generator).__name__
    if state["bit_generator"] != ours:
        raise ValueError(f"{what}: {path}: the saved random state is for {state['bit_generator']}; run_md uses {ours}")
    return state


def read_restart(path: str | os.PathLike | Restart, what: str = "restart") -> Restart:
    """The last frame of a trajectory written by :func:`run_md`, with the step counter and random state."""
    if isinstance(path, Restart):
        return path
    atoms = read_structure(path, what)
    path = Path(path)
    info = atoms.info
    if "md_step" not in info:
        raise ValueError(f"{what}: {path} has no MD step counter (md_step in the frame's info): it was not written "
                         "by cgforge md / run_md; start from it as a structure instead")
    try:
        step = int(info["md_step"])
    except (TypeError, ValueError):
        raise ValueError(f"{what}: {path}: md_step is {info['md_step']!r}, expected an int") from None
    if step < 0:
        raise ValueError(f"{what}: {path}: md_step is {step}, expected >= 0")
    if not atoms.has("momenta"):
        raise ValueError(f"{what}: {path}: the last frame has no momenta to continue from")
    rng = _decode_rng(info["md_rng"], what, path) if "md_rng" in info else None
    etot0 = float(info["md_etot0"]) if "md_etot0" in info else None
    time_fs = float(info.get("md_time_fs", float("nan")))
    for key in ("md_step", "md_rng", "md_etot0", "md_time_fs", "md_ensemble"):
        info.pop(key, None)
    atoms.calc = None  # the frame's stored results are not the calculator's
    return Restart(path=path, atoms=atoms, step=step, time_fs=time_fs, etot0=etot0, rng_state=rng)


def _check_same_system(atoms: Atoms | None, restart: Restart) -> None:
    frame = restart.atoms
    if atoms is not None and (len(atoms) != len(frame) or not np.array_equal(atoms.numbers, frame.numbers)):
        raise ValueError(f"restart: {restart.path} holds {frame.get_chemical_formula()} ({len(frame)} atoms), "
                         f"atoms is {atoms.get_chemical_formula()} ({len(atoms)} atoms); pass atoms=None to "
                         "continue the saved structure")


def _continue_from(atoms: Atoms | None, restart: Restart) -> Atoms:
    """``atoms`` set to the restart frame's state (positions, momenta, cell), or the frame's Atoms if None."""
    if atoms is None or atoms is restart.atoms:
        return restart.atoms
    frame = restart.atoms
    atoms.set_cell(frame.cell)
    atoms.pbc = frame.pbc
    atoms.positions = frame.positions
    atoms.set_momenta(frame.get_momenta())
    return atoms


# ---------------------------------------------------------------------------------------------
# Output


class _TrajectoryWriter:
    """Frames to ``path``, created only at the first frame: that frame goes to a hidden temporary file in the
    same folder, which then replaces ``path``. A run that fails before its first frame leaves no file behind
    and an existing file (``force=True``) untouched."""

    def __init__(self, path: Path, atoms: Atoms) -> None:
        self.path, self.atoms = path, atoms
        self.frames = 0
        self.last_step: int | None = None
        self._traj = None
        self._xyz = path.suffix.lower() in _XYZ_SUFFIXES
        self._tmp: Path | None = None

    def write(self, step: int, info: dict[str, Any]) -> None:
        self.atoms.info.update(info)
        try:
            if self.frames == 0:
                self._first_frame()
            elif self._xyz:
                self._write_xyz(self.path)
            else:
                self._traj.write()
        finally:
            for key in info:
                self.atoms.info.pop(key, None)
        self.frames += 1
        self.last_step = step

    def _write_xyz(self, path: Path) -> None:
        from ase.io import write

        write(str(path), self.atoms, format="extxyz", append=True)

    def _first_frame(self) -> None:
        from ase.io.trajectory import Trajectory

        self._tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
        os.close(os.open(self._tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))  # umask decides the mode
        if self._xyz:
            self._write_xyz(self._tmp)
        else:
            with Trajectory(str(self._tmp), "w", self.atoms) as traj:
                traj.write()
        os.replace(self._tmp, self.path)
        self._tmp = None
        if not self._xyz:
            self._traj = Trajectory(str(self.path), "a", self.atoms)

    def close(self) -> None:
        if self._traj is not None:
            self._traj.close()
            self._traj = None
        if self._tmp is not None and self._tmp.exists():
            self._tmp.unlink()  # our own half-written first frame, never a user's file


def _printer(log: Any, force: bool) -> tuple[Callable[[str], None], Callable[[], None], Path | None]:
    """(write a line, close, the log file's path) for ``log``: print, a callable, a stream, a path or None."""
    if log is None:
        return (lambda line: None), (lambda: None), None
    if log is print:
        return (lambda line: print(line, flush=True)), (lambda: None), None  # the sys.stdout of the moment
    if isinstance(log, str | os.PathLike):
        path = check_new_path(log, force, what="log", suffixes=None)
        stream = open(path, "w" if force else "x", encoding="utf-8")  # noqa: SIM115 (closed by run_md)
        return _stream_printer(stream), stream.close, path
    if hasattr(log, "write"):
        return _stream_printer(log), (lambda: None), None
    if callable(log):
        return log, (lambda: None), None
    if isinstance(log, list | tuple) and log and not any(isinstance(x, list | tuple) for x in log):
        if sum(isinstance(x, str | os.PathLike) for x in log) > 1:
            raise ValueError("log: at most one file name in the list")
        parts = [_printer(x, force) for x in log]
        path = next((p for _, _, p in parts if p is not None), None)

        def write_all(line: str) -> None:
            for write, _, _ in parts:
                write(line)

        def close_all() -> None:
            for _, close, _ in parts:
                close()

        return write_all, close_all, path
    raise TypeError(f"log: expected print, a callable taking a line, a stream, a file name, a list of these or "
                    f"None, got {type(log).__name__}")


def _stream_printer(stream: TextIO) -> Callable[[str], None]:
    def write(line: str) -> None:
        stream.write(line + "\n")
        stream.flush()

    return write


class _Progress:
    """A line per call: step, ps, ns/day since the previous line, T, total energy and its drift."""

    def __init__(self, atoms: Atoms, out: Callable[[str], None], etot0: float, start_step: int,
                 start_time_fs: float) -> None:
        self.atoms, self.out, self.etot0 = atoms, out, etot0
        self.n_atoms = len(atoms)
        self.last_step, self.last_time_fs = start_step, start_time_fs
        self.last_time = time.perf_counter()
        self.drift = 0.0
        self.ns_per_day = float("nan")

    def header(self) -> None:
        self.out(f"{'step':>8s} {'time[ps]':>10s} {'ns/day':>9s} {'T[K]':>8s} {'Etot[eV]':>14s} "
                 f"{'drift[meV/atom]':>16s}")

    def __call__(self, step: int, time_fs: float, etot: float) -> None:
        now = time.perf_counter()
        self.drift = (etot - self.etot0) / self.n_atoms * 1000.0
        if step > self.last_step:
            simulated_ns = (time_fs - self.last_time_fs) * 1e-6
            self.ns_per_day = simulated_ns / ((now - self.last_time) / 86400.0)
        speed = f"{self.ns_per_day:9.3f}" if math.isfinite(self.ns_per_day) else f"{'-':>9s}"
        self.out(f"{step:8d} {time_fs / 1000:10.4f} {speed} {self.atoms.get_temperature():8.1f} "
                 f"{etot:14.5f} {self.drift:16.4f}")
        self.last_step, self.last_time, self.last_time_fs = step, now, time_fs


# ---------------------------------------------------------------------------------------------
# The run


def _total_energy(atoms: Atoms) -> float:
    return float(atoms.get_potential_energy()) + float(atoms.get_kinetic_energy())


class _Guard:
    """Stops a run that blew up: non-finite forces or energy, or a temperature above the limit."""

    def __init__(self, atoms: Atoms, max_temperature_K: float) -> None:
        self.atoms, self.max_temperature_K = atoms, max_temperature_K

    def check(self, step: int) -> None:
        atoms = self.atoms
        forces = atoms.get_forces()  # cached: the integrator just asked for them
        bad = ~np.isfinite(forces).all(axis=1)
        if bad.any():
            first = int(np.flatnonzero(bad)[0])
            self._stop(step, "forces", float(forces[first][~np.isfinite(forces[first])][0]),
                       f"the forces are not finite on {int(bad.sum())} of {len(atoms)} atoms (first: atom {first}, "
                       f"{atoms.get_chemical_symbols()[first]}, force {forces[first].tolist()})")
        results = getattr(atoms.calc, "results", None)
        energy = results.get("energy") if isinstance(results, dict) else None
        if energy is not None and not np.isfinite(energy):
            self._stop(step, "energy", float(energy), f"the potential energy is {float(energy)}")
        temperature = float(atoms.get_temperature())
        if not math.isfinite(temperature):
            self._stop(step, "temperature", temperature, f"the temperature is {temperature} (non-finite velocities)")
        if temperature > self.max_temperature_K:
            self._stop(step, "temperature", temperature,
                       f"the temperature reached {temperature:.4g} K, above the limit of {self.max_temperature_K:g} K "
                       "(max_temperature_K, --max-temperature)")

    def _stop(self, step: int, quantity: str, value: float, what: str) -> None:
        raise MDInstabilityError(step, quantity, value,
                                 f"MD became unstable at step {step}: {what}. Try a smaller timestep, relax the "
                                 "structure first, or check the model and the structure")


class _StopRequested(Exception):
    """The first Ctrl-C, acted on between steps (the state is that of a completed step)."""


@contextmanager
def _ctrl_c_after_step() -> Iterator[Callable[[], bool]]:
    """While active, the first Ctrl-C only sets a flag (the run stops after the current step, its files whole);
    a second one interrupts at once. Only in the main thread and only over Python's default handler."""
    pressed = [0]
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield lambda: False
        return

    def handler(signum: int, frame: Any) -> None:
        pressed[0] += 1
        if pressed[0] > 1:
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield lambda: pressed[0] > 0
    finally:
        signal.signal(signal.SIGINT, previous)


def _make_dynamics(atoms: Atoms, o: dict[str, Any], rng: np.random.Generator) -> Any:
    """The integrator for ``o['ensemble']``: the one place another engine (e.g. a GPU MD engine) plugs in.

    What run_md needs from it: ``nsteps`` (the step counter, settable: a restart sets it), ``irun(steps)``
    (a generator that yields once at the current state, then after each step with ``atoms`` updated and
    the forces available from ``atoms.get_forces()``) and, for a stochastic integrator, ``rng`` (a
    ``np.random.Generator`` whose state is saved with each frame for restarts). An engine that yields less
    often than every step must yield on every step that is a multiple of the trajectory and log intervals.
    """
    dt = o["timestep_fs"] * units.fs
    ensemble = o["ensemble"]
    if ensemble == "nvt":
        from ase.md.langevin import Langevin

        # fixcm=False: ASE >= 3.28 deprecates its approximate centre-of-mass fix (the box may drift as a whole)
        return Langevin(atoms, dt, temperature_K=o["temperature_K"], friction=o["friction"] / units.fs, rng=rng,
                        fixcm=False)
    if ensemble == "npt":
        from ase.md.nptberendsen import NPTBerendsen

        bar = 1e5 * units.Pascal
        return NPTBerendsen(atoms, dt, temperature_K=o["temperature_K"], pressure_au=o["pressure_bar"] * bar,
                            taut=o["taut_fs"] * units.fs, taup=o["taup_fs"] * units.fs,
                            compressibility_au=o["compressibility_per_bar"] / bar)
    from ase.md.verlet import VelocityVerlet

    return VelocityVerlet(atoms, dt)


def _unknown_arguments(unknown: dict[str, Any]) -> None:
    if not unknown:
        return
    known = [p.name for p in inspect.signature(run_md).parameters.values() if p.kind != p.VAR_KEYWORD]
    name = sorted(unknown)[0]
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
    hint = f" (did you mean {close[0]!r}?)" if close else f"; known: {', '.join(known)}"
    raise TypeError(f"run_md: unknown argument {name!r}{hint}")


def _check_calculator(atoms: Atoms | None, calculator: Any) -> None:
    if calculator is not None:
        if isinstance(calculator, str | os.PathLike):
            raise TypeError(f"calculator: expected an ASE calculator, got the {type(calculator).__name__} "
                            f"{str(calculator)!r}; load the model first: Calculator({str(calculator)!r}) from "
                            "cgforge.plugin")
        if not callable(getattr(calculator, "get_forces", None)) and not callable(
                getattr(calculator, "calculate", None)):
            raise TypeError(f"calculator: expected an ASE calculator (e.g. cgforge.plugin.Calculator('mace')), got "
                            f"{type(calculator).__name__}")
    elif atoms is None or atoms.calc is None:
        raise ValueError("calculator: atoms has no calculator; pass one (e.g. cgforge.plugin.Calculator('mace'))")


def run_md(
    atoms: Atoms | None,
    calculator: Any = None,
    *,
    ensemble: str = "nvt",
    temperature_K: float = 300.0,
    timestep_fs: float = 0.5,
    steps: int = 100,
    friction: float | None = None,
    pressure_bar: float | None = None,
    taut_fs: float | None = None,
    taup_fs: float | None = None,
    compressibility_per_bar: float | None = None,
    trajectory: str | os.PathLike | None = None,
    trajectory_interval: int = 10,
    log_interval: int = 10,
    seed: int = 0,
    force: bool = False,
    init_velocities: bool | None = None,
    max_temperature_K: float | None = None,
    restart: str | os.PathLike | Restart | None = None,
    log: TextIO | Callable[[str], None] | str | os.PathLike | list | tuple | None = print,
    **unknown: Any,
) -> MDSummary:
    """Run MD on ``atoms`` in place: NVT (Langevin, ``friction`` in 1/fs, default 0.01), NVE (velocity Verlet)
    or NPT (Berendsen: ``pressure_bar`` default 1.01325, ``taut_fs`` 100, ``taup_fs`` 1000,
    ``compressibility_per_bar`` 4.57e-5, water's; isotropic, the cell keeps its shape; it reaches the right
    density and temperature but does not sample the NPT ensemble's fluctuations).

    ``calculator`` replaces ``atoms.calc`` when given. Velocities are drawn from Maxwell-Boltzmann at
    ``temperature_K`` (``seed``, zero total momentum) when ``init_velocities`` is True, or when it is None and
    the atoms are at rest. ``trajectory``: a new .traj/.xyz/.extxyz file written every ``trajectory_interval``
    steps and at the last step (an existing file only with ``force=True``). ``log``: print (default), a
    callable taking a line, a stream, a file name (the lines go to that new file instead of stdout), a list of
    these (``[print, "md.log"]``: each line to all) or None.

    ``max_temperature_K``: the run stops with :class:`MDInstabilityError` above it (default
    ``max(5000, 10 * temperature_K)``; ``math.inf`` turns the check off), as it does for non-finite forces or
    energy. ``restart``: a trajectory written by run_md (or a :class:`Restart`): its last frame's positions,
    momenta, cell, step counter and random state are continued for ``steps`` more steps; ``atoms`` may be None
    (the frame's structure is used and returned in the summary). Ctrl-C stops after the current step and
    raises :class:`MDInterrupted` (a KeyboardInterrupt) once the trajectory is closed.
    """
    _unknown_arguments(unknown)
    if atoms is None and restart is None:
        raise TypeError("atoms: expected an ase.Atoms (None only with restart=...)")
    if atoms is not None and not isinstance(atoms, Atoms):
        raise TypeError(f"atoms: expected an ase.Atoms, got {type(atoms).__name__}")
    if atoms is not None and len(atoms) == 0:
        raise ValueError("atoms: expected a structure with at least one atom, got an empty Atoms")
    o = _checked_options(dict(
        ensemble=ensemble, temperature_K=temperature_K, timestep_fs=timestep_fs, steps=steps, friction=friction,
        pressure_bar=pressure_bar, taut_fs=taut_fs, taup_fs=taup_fs, compressibility_per_bar=compressibility_per_bar,
        trajectory_interval=trajectory_interval, log_interval=log_interval, seed=seed, force=force,
        init_velocities=init_velocities, max_temperature_K=max_temperature_K), str)
    if restart is not None and o["init_velocities"]:
        raise ValueError("init_velocities: a restart continues the saved velocities; leave init_velocities out")
    if restart is not None and not isinstance(restart, str | os.PathLike | Restart):
        raise TypeError(f"restart: expected a trajectory file name or a Restart, got {type(restart).__name__}")
    _check_calculator(atoms, calculator)
    path = check_new_path(trajectory, o["force"]) if trajectory is not None else None
    named = [x for x in (log if isinstance(log, list | tuple) else [log]) if isinstance(x, str | os.PathLike)]
    log_path = check_new_path(named[0], o["force"], "log", suffixes=None) if named else None
    restart_path = None if restart is None else restart.path if isinstance(restart, Restart) else Path(restart)
    check_distinct({"trajectory": path, "log": log_path}, {"restart": restart_path})
    state = read_restart(restart) if restart is not None else None
    if state is not None:
        _check_same_system(atoms, state)
    _check_atoms_for(o["ensemble"], atoms if atoms is not None else state.atoms, str)
    out, close_log, log_path = _printer(log, o["force"])  # the last check: it creates the log file
    atoms = _continue_from(atoms, state) if state is not None else atoms
    if calculator is not None:
        atoms.calc = calculator
    try:
        return _run(atoms, o, path, out, state, log_path)
    finally:
        close_log()


def _run(atoms: Atoms, o: dict[str, Any], path: Path | None, out: Callable[[str], None], state: Restart | None,
         log_path: Path | None) -> MDSummary:
    rng = np.random.default_rng(o["seed"])
    if state is not None and state.rng_state is not None:
        rng.bit_generator.state = state.rng_state  # the generator's kind was checked by read_restart
    elif state is None and (o["init_velocities"] or (o["init_velocities"] is None and not np.any(atoms.get_momenta()))):
        _thermalize(atoms, o["temperature_K"], rng)
        if len(atoms) > 1:  # one atom: no motion would be left (and ASE's Stationary divides by zero)
            from ase.md.velocitydistribution import Stationary

            Stationary(atoms)
    dyn = _make_dynamics(atoms, o, rng)
    calc = atoms.calc
    stress_flag = getattr(calc, "stress_with_forces", None)
    if o["ensemble"] == "npt" and stress_flag is False:
        calc.stress_with_forces = True  # the barostat asks for the stress after the forces: one model run, not two
    start = state.step if state is not None else 0
    dyn.nsteps = start
    end = start + o["steps"]
    dt = o["timestep_fs"]
    time0 = state.time_fs if state is not None and math.isfinite(state.time_fs) else start * dt
    writer = _TrajectoryWriter(path, atoms) if path is not None else None
    guard = _Guard(atoms, o["max_temperature_K"])
    ensemble = o["ensemble"]
    out(f"cgforge md: {len(atoms)} atoms, {ensemble.upper()}"
        + (f" at {o['temperature_K']:g} K" if ensemble != "nve" else "")
        + (f" and {o['pressure_bar']:g} bar" if ensemble == "npt" else "")
        + f", timestep {dt:g} fs, {o['steps']} steps"
        + (f" from step {start} of {state.path}" if state is not None else "")
        + (f", trajectory {path}" if path else "")
        + f", stop above {o['max_temperature_K']:g} K")
    progress: _Progress | None = None
    wall_start = time.perf_counter()
    step = start

    def time_fs(s: int) -> float:
        return time0 + (s - start) * dt

    def frame(s: int) -> None:
        if writer is not None and writer.last_step != s:
            info = {"md_step": s, "md_time_fs": time_fs(s), "md_etot0": progress.etot0, "md_ensemble": ensemble}
            if isinstance(getattr(dyn, "rng", None), np.random.Generator):
                info["md_rng"] = _encode_rng(dyn.rng.bit_generator.state)
            writer.write(s, info)

    try:
        with _ctrl_c_after_step() as interrupted:
            for _ in dyn.irun(o["steps"]):
                step = dyn.nsteps
                guard.check(step)
                if progress is None:
                    etot0 = (state.etot0 if state is not None and state.etot0 is not None
                             else _total_energy(atoms))
                    progress = _Progress(atoms, out, etot0, start, time_fs(start))
                    progress.header()
                if writer is not None and (step == end or (step % o["trajectory_interval"] == 0
                                                            and not (state is not None and step == start))):
                    frame(step)
                if step == start or step == end or step % o["log_interval"] == 0:
                    progress(step, time_fs(step), _total_energy(atoms))
                if interrupted() and step < end:
                    raise _StopRequested
    except MDInstabilityError as err:
        out(f"stopped: {err}")
        raise
    except (_StopRequested, KeyboardInterrupt) as err:
        # A second Ctrl-C may land mid-step: then the atoms are half updated and no frame is written.
        try:
            if isinstance(err, _StopRequested):
                frame(step)  # the state of the last completed step, for a restart
        finally:
            if writer is not None:
                writer.close()
        saved = (f"; trajectory {path} ends at step {writer.last_step} (continue with --restart {path} / "
                 f"restart={str(path)!r})") if writer is not None and writer.last_step is not None else ""
        message = f"interrupted (Ctrl-C) at step {step}{saved}"
        out(message)
        summary = _summary(atoms, o, start, step, wall_start, progress, path, writer, log_path)
        raise MDInterrupted(message, step, summary) from None
    except Exception as err:
        out(f"stopped after step {dyn.nsteps}: {type(err).__name__}: {err}")
        raise
    finally:
        if writer is not None:
            writer.close()
        if stress_flag is False:
            calc.stress_with_forces = False
    summary = _summary(atoms, o, start, end, wall_start, progress, path, writer, log_path)
    out(f"done: {o['steps']} steps, {summary.simulated_ps:g} ps in {summary.wall_s:.1f} s "
        f"({summary.ns_per_day:.3f} ns/day)" + (f"; trajectory: {path}" if path else ""))
    return summary


def _summary(atoms: Atoms, o: dict[str, Any], start: int, last: int, wall_start: float, progress: _Progress | None,
             path: Path | None, writer: _TrajectoryWriter | None, log_path: Path | None) -> MDSummary:
    wall = time.perf_counter() - wall_start
    steps = last - start
    simulated_ps = steps * o["timestep_fs"] / 1000.0
    return MDSummary(
        steps=steps, simulated_ps=simulated_ps, wall_s=wall,
        ns_per_day=(simulated_ps * 1e-3) / (wall / 86400.0) if wall > 0 and steps else float("nan"),
        temperature_K=float(atoms.get_temperature()),
        energy_drift_meV_per_atom=progress.drift if progress is not None else 0.0,
        trajectory=str(path) if path is not None and writer is not None and writer.frames else None,
        n_atoms=len(atoms), first_step=start, last_step=last, log=str(log_path) if log_path else None, atoms=atoms,
    )


def relax_structure(atoms: Atoms, calc: Any, steps: int, fmax: float = 0.1,
                    out: Callable[[str], None] | None = None) -> None:
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
    line = (f"relaxed {optimizer.nsteps} FIRE steps: energy {before:.4f} -> {after:.4f} eV, "
            f"max force {float(np.linalg.norm(atoms.get_forces(), axis=1).max()):.3f} eV/Å")
    if out is None:
        print(line, flush=True)
    else:
        out(line)


def _thermalize(atoms: Atoms, temperature_K: float, rng: np.random.Generator) -> None:
    """Maxwell-Boltzmann momenta (ASE >= 3.28 names it thermalize_momenta)."""
    try:
        from ase.md.velocitydistribution import thermalize_momenta
    except ImportError:
        from ase.md.velocitydistribution import MaxwellBoltzmannDistribution as thermalize_momenta
    thermalize_momenta(atoms, temperature_K=temperature_K, rng=rng)


def model_banner(name: str, calc: Any, seconds: float) -> str:
    """One line about the loaded model: kind, cutoff, device, the dtype of its parameters, load time."""
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in calc.model.parameters() if p.is_floating_point()})
    dtype = "/".join(dtypes) if dtypes else str(calc.dtype).removeprefix("torch.")
    compiled = " (kernels compiled)" if calc.device.type == "cuda" else ""
    return (f"model {name} ({calc.adapter.kind}, cutoff {calc.cutoff:g} Å) on {calc.device} in {dtype}, "
            f"ready in {seconds:.1f} s{compiled}")


# ---------------------------------------------------------------------------------------------
# Command line (shared by `cgforge md` and examples/water_md.py)

CPU_MOLECULES = 32  # a CPU-sized default box (96 atoms)
GPU_MOLECULES = 1728  # the benchmarks' 5184-atom box
DEFAULT_RELAX = 100  # FIRE steps for a generated box

# run_md's argument -> the flag that sets it, so that errors name what the user typed.
FLAGS = {"ensemble": "--ensemble", "temperature_K": "--temperature", "timestep_fs": "--timestep",
         "steps": "--steps", "friction": "--friction", "pressure_bar": "--pressure", "taut_fs": "--taut",
         "taup_fs": "--taup", "compressibility_per_bar": "--compressibility", "trajectory": "--trajectory",
         "trajectory_interval": "--traj-interval", "log_interval": "--log-interval", "seed": "--seed",
         "force": "--force", "max_temperature_K": "--max-temperature",
         "restart": "--restart", "log": "--log"}


def add_md_arguments(parser: argparse.ArgumentParser) -> None:
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--molecules", type=int, default=None,
                      help=f"water molecules in the box (default {GPU_MOLECULES} on a GPU, {CPU_MOLECULES} on CPU)")
    what.add_argument("--structure", default=None, help="read the structure from this file (any ase.io format)")
    what.add_argument("--restart", default=None, metavar="TRAJ",
                      help="continue a run from the last frame of its trajectory: step counter, velocities and "
                           "thermostat random state (exact from .traj); --steps more steps, into a new -o file")
    parser.add_argument("--model", default="mace",
                        help="'mace' or 'nequip' (bundled water models), or a .model/.ckpt/.nequip.zip file")
    parser.add_argument("--ensemble", type=str.lower, choices=ENSEMBLES, default="nvt",
                        help="nvt (Langevin, default), nve (velocity Verlet) or npt (Berendsen thermostat and "
                             "isotropic barostat; needs a periodic cell)")
    parser.add_argument("--temperature", type=float, default=300.0, help="K (default 300)")
    parser.add_argument("--timestep", type=float, default=0.5, help="fs (default 0.5)")
    parser.add_argument("--steps", type=int, default=100, help="MD steps (default 100)")
    parser.add_argument("--friction", type=float, default=None,
                        help=f"NVT: Langevin friction in 1/fs (default {DEFAULT_FRICTION:g})")
    parser.add_argument("--pressure", type=float, default=None,
                        help=f"NPT: pressure in bar (default {DEFAULT_PRESSURE_BAR:g})")
    parser.add_argument("--taut", type=float, default=None,
                        help=f"NPT: temperature coupling time in fs (default {DEFAULT_TAUT_FS:g})")
    parser.add_argument("--taup", type=float, default=None,
                        help=f"NPT: pressure coupling time in fs (default {DEFAULT_TAUP_FS:g})")
    parser.add_argument("--compressibility", type=float, default=None,
                        help=f"NPT: isothermal compressibility in 1/bar (default {DEFAULT_COMPRESSIBILITY_PER_BAR:g}, "
                             "water)")
    parser.add_argument("--max-temperature", type=float, default=None,
                        help=f"stop (exit code 3) when the temperature exceeds this, in K (default: "
                             f"max({MAX_TEMPERATURE_FLOOR_K:g}, {MAX_TEMPERATURE_FACTOR:g} x --temperature); 'inf' "
                             "turns it off); non-finite forces or energy always stop the run")
    parser.add_argument("--seed", type=int, default=0, help="velocities, thermostat noise and box (default 0)")
    parser.add_argument("-o", "--trajectory", default=None,
                        help="trajectory file to write, .traj or .xyz (default: a new md-<date>-<time>.traj)")
    parser.add_argument("--traj-interval", type=int, default=10,
                        help="steps between frames (default 10; the last step is always written)")
    parser.add_argument("--log", default=None, metavar="FILE",
                        help="also write the progress lines (and the model and relaxation lines) to this new file")
    parser.add_argument("--log-interval", type=int, default=10, help="steps between progress lines (default 10)")
    parser.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available)")
    parser.add_argument("--dtype", choices=("float32", "float64"), default=None,
                        help="model precision (default: the model's)")
    parser.add_argument("--skin", type=float, default=1.0, help="neighbour-list skin in Å (default 1.0)")
    parser.add_argument("--relax", type=int, default=None,
                        help="FIRE steps (to 0.1 eV/Å) before MD (default 100 for a generated box, whose rigid "
                             "grid-placed molecules would otherwise heat to ~1500 K; 0 for --structure; refused "
                             "with --restart)")
    parser.add_argument("--radial-precision", choices=("fp32", "tf32", "3xtf32"), default="fp32",
                        help="radial-MLP products: fp32 (default), tf32 or 3xtf32 on tensor cores (CUDA, FP32 "
                             "models; kept only if the first structure's forces change by <= 1e-4 relative, "
                             "which is printed)")
    parser.add_argument("--force", action="store_true",
                        help="overwrite the trajectory and log files if they exist (never the input files)")


def relax_steps(args: argparse.Namespace) -> int:
    """FIRE steps before MD: --relax, else 100 for a generated box and 0 for a structure file or a restart."""
    if args.relax is not None:
        steps = _count("--relax", args.relax, 0)
        if steps and getattr(args, "restart", None) is not None:
            raise ValueError("--relax: a restart continues the saved state; relaxing it would not; leave --relax out")
        return steps
    return 0 if args.structure is not None or getattr(args, "restart", None) is not None else DEFAULT_RELAX


@dataclass
class MDSetup:
    """What ``cgforge md`` checked and prepared before loading the model."""

    atoms: Atoms
    device: Any
    relax: int
    trajectory: Path
    log: Path | None
    restart: Restart | None
    run_md_kwargs: dict[str, Any]


def _model_file(model: str) -> Path | None:
    """The model file ``--model`` names (None for a bundled name whose file is checked at load)."""
    from .calculator import BUNDLED

    if model.lower() in BUNDLED:
        return None
    path = Path(model)
    if not path.exists():
        raise FileNotFoundError(f"--model: {model} not found (expected 'mace', 'nequip' or a checkpoint file)")
    return path


def prepare_md(args: argparse.Namespace, stem: str = "md") -> MDSetup:
    """Every flag checked (errors name the flag), the structure read or built and the output files checked,
    all before any model is loaded."""
    from .calculator import resolve_device

    flag = FLAGS.get
    o = _checked_options(dict(
        ensemble=args.ensemble, temperature_K=args.temperature, timestep_fs=args.timestep, steps=args.steps,
        friction=args.friction, pressure_bar=args.pressure, taut_fs=args.taut, taup_fs=args.taup,
        compressibility_per_bar=args.compressibility, trajectory_interval=args.traj_interval,
        log_interval=args.log_interval, seed=args.seed, force=args.force, init_velocities=None,
        max_temperature_K=args.max_temperature), lambda k: flag(k, k))
    relax = relax_steps(args)
    _number("--skin", args.skin, strict=False)
    if args.molecules is not None:
        _count("--molecules", args.molecules, 1)
    try:
        device = resolve_device(args.device)
    except ValueError as err:
        raise ValueError(f"--device: {str(err).removeprefix('device: ')}") from None
    radial = getattr(args, "radial_precision", "fp32")
    if radial != "fp32" and device.type != "cuda":
        raise ValueError(f"--radial-precision: {radial} needs a CUDA device (TF32 is a tensor-core format), got "
                         f"{device}")
    if radial != "fp32" and args.dtype == "float64":
        raise ValueError(f"--radial-precision: {radial} is for FP32 models; leave out --dtype float64")
    model = _model_file(args.model)
    trajectory = (check_new_path(args.trajectory, args.force, what="--trajectory") if args.trajectory is not None
                  else default_trajectory_path(stem))
    log = check_new_path(args.log, args.force, what="--log", suffixes=None) if args.log is not None else None
    restart_path = Path(args.restart) if args.restart is not None else None
    structure = Path(args.structure) if args.structure is not None else None
    check_distinct({"--trajectory": trajectory, "--log": log},
                   {"--structure": structure, "--restart": restart_path, "--model": model})
    restart = None
    if restart_path is not None:
        restart = read_restart(restart_path, "--restart")
        atoms = restart.atoms
    elif structure is not None:
        atoms = read_structure(structure, "--structure")
    else:
        from .water import water_box

        n = args.molecules if args.molecules is not None else (GPU_MOLECULES if device.type == "cuda"
                                                               else CPU_MOLECULES)
        atoms = water_box(n, seed=args.seed)
    _check_atoms_for(o["ensemble"], atoms, lambda k: flag(k, k))
    kwargs = {k: o[k] for k in ("ensemble", "temperature_K", "timestep_fs", "steps", "trajectory_interval",
                                "log_interval", "seed", "force", "max_temperature_K")}
    kwargs.update({k: o[k] for k in (("friction",) if o["ensemble"] == "nvt" else _NPT_OPTIONS
                                     if o["ensemble"] == "npt" else ())})
    kwargs.update(trajectory=trajectory, restart=restart)
    return MDSetup(atoms=atoms, device=device, relax=relax, trajectory=trajectory, log=log, restart=restart,
                   run_md_kwargs=kwargs)


def run_from_args(args: argparse.Namespace, stem: str = "md") -> MDSummary:
    """``cgforge md``: check everything, load the model, relax if asked, run; lines to stdout (and --log)."""
    from .calculator import Calculator

    setup = prepare_md(args, stem)  # bad input fails here, before the model is loaded and compiled
    log_stream = open(setup.log, "w" if args.force else "x", encoding="utf-8") if setup.log else None  # noqa: SIM115
    to_log = _stream_printer(log_stream) if log_stream else None

    def out(line: str) -> None:
        print(line, flush=True)
        if to_log is not None:
            to_log(line)

    try:
        atoms = setup.atoms
        t = time.perf_counter()
        calc = Calculator(args.model, device=setup.device, dtype=args.dtype, skin=args.skin,
                          radial_precision=args.radial_precision, stress_with_forces=args.ensemble == "npt")
        out(model_banner(args.model, calc, time.perf_counter() - t))
        if calc.radial_precision_requested != "fp32":
            atoms.calc = calc
            atoms.get_forces()  # the first structure decides (see Calculator)
            mode = calc.radial_precision_requested
            kept = "kept" if calc.radial_precision == mode else "refused: radial MLPs stay in fp32"
            out(f"radial MLPs in {mode} {kept}: the forces changed by {calc.radial_precision_error:.1e} relative "
                f"(tolerance 1e-4)")
        if setup.relax:
            relax_structure(atoms, calc, setup.relax, out=out)
        summary = run_md(atoms, calc, log=out, **setup.run_md_kwargs)
        summary.log = str(setup.log) if setup.log else None
        return summary
    except Exception as err:
        if to_log is not None:
            to_log(f"error: {err}")
        raise
    finally:
        if log_stream is not None:
            log_stream.close()
