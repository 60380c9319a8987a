"""Molecular dynamics: NVT (Langevin or CSVR), NVE (velocity Verlet) or NPT, with progress lines, a
trajectory, blow-up detection, restarts, a clean Ctrl-C and a plot at the end.

    from cgforge.plugin import Calculator, run_md, water_box
    atoms = water_box(1728)
    atoms.calc = Calculator("mace")
    summary = run_md(atoms, ensemble="nvt", temperature_K=300, timestep_fs=0.5, steps=1000,
                     trajectory="water.traj", log="water.log", plot="water.png")
    run_md(None, Calculator("mace"), restart="water.traj", steps=1000, trajectory="water-2.traj")

Two integrator paths (``engine``; md_dynamics.py has the table of integrators): cgforge's device engine
(``engine.py``: integrator and model step on the calculator's device, captured as a CUDA graph on a GPU; the
host sees the state only at log and trajectory steps), the default (``engine="auto"``) when the calculator is
a cgforge Calculator on CUDA, and ASE's dynamics (any ASE calculator; one host round trip per step), the
default otherwise. ``engine="device"`` runs the engine also on a CPU, ``engine="ase"`` ASE's dynamics on a GPU.
Both paths write the same frames and lines and keep every guarantee below.

Progress lines give the step, simulated time, speed (ns/day of wall time since the previous line),
temperature and the drift of the total energy (kinetic + potential) since step 0 in meV/atom (a
conservation check in NVE; in NVT and NPT the thermostat exchanges energy, so it only shows the trend).

Trajectories are ASE ``.traj`` files, or extended XYZ for ``.xyz``/``.extxyz`` names, always written to a
new file: an existing one is replaced only with ``force=True``, and only once the first frame is complete
(the first frame goes to a hidden temporary file in the same folder, renamed over the name). The last step
is always written. Every frame holds energy, forces and momenta (and the stress in NPT), and its
``atoms.info`` holds ``md_step``, ``md_time_fs``, ``md_etot0`` (the total energy at step 0, for the drift) and
the random state: ``md_rng`` (ASE's stochastic dynamics: the numpy generator's state) or ``md_engine`` (the
device engine: its seed, integrator and thermostat scalars; its noise is a hash of (seed, step)). That is
what a restart needs: from a ``.traj`` file a restarted run repeats the uninterrupted one (extended XYZ stores
positions to 1e-8 Å, so a restart from it continues closely but not bit for bit).

After every step the state is checked (by the engine on the device, every step): non-finite forces or
energy, or a temperature above ``max_temperature_K`` (default ``max(5000 K, 10 x temperature_K)``), stop the
run with :class:`MDInstabilityError` naming the step and the value; the trajectory written so far stays
readable. Ctrl-C stops after the current step (the engine: after the current block of at most 10 steps on a
CPU, 50 on CUDA), writes that step's frame and raises :class:`MDInterrupted`. ``plot``: a figure of the
progress lines' values, written at the end also after a blow-up or Ctrl-C (md_plot.py).
"""

from __future__ import annotations

import difflib
import inspect
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
from ase import Atoms

from .checks import Guard, MDInstabilityError, Progress, total_energy
from .dynamics import (
    AseDynamics,
    ase_dynamics,
    check_engine_options,
    choose_engine,
    engine_dynamics,
    thermalize,
)
from .files import (
    PLOT_SUFFIXES,
    Restart,
    TrajectoryWriter,
    check_distinct,
    check_new_path,
    check_same_system,
    continue_from,
    default_trajectory_path,
    make_printer,
    read_restart,
    read_structure,
)
from .options import check_atoms_for, checked_options
from .plot import check_matplotlib, write_plot

__all__ = ["run_md", "MDSummary", "MDInstabilityError", "MDInterrupted", "Restart", "read_restart",
           "read_structure", "check_new_path", "default_trajectory_path"]


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
    engine: str = "ase"  # the integrator path that ran: "device" (cgforge's engine) or "ase"
    plot: str | None = None


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
    engine: str = "auto",
    thermostat: str | None = None,
    plot: str | os.PathLike | None = None,
    engine_options: dict[str, Any] | None = None,
    **unknown: Any,
) -> MDSummary:
    """Run MD on ``atoms`` in place: NVT (``thermostat`` "langevin", the default, ``friction`` in 1/fs, default
    0.01; or "csvr", Bussi's stochastic velocity rescaling with ``taut_fs``), NVE (velocity Verlet) or NPT
    (isotropic, the cell keeps its shape; ``pressure_bar`` default 1.01325, ``taut_fs`` 100, ``taup_fs`` 1000,
    ``compressibility_per_bar`` 4.57e-5, water's: stochastic cell rescaling with CSVR in the device engine, which
    samples the NPT ensemble; Berendsen in ASE's dynamics, which reaches the right density and temperature but
    not the ensemble's fluctuations).

    ``engine``: "auto" (cgforge's device engine when the calculator is a cgforge Calculator on CUDA, else ASE's
    dynamics), "device" (the engine, also on a CPU; an error for a calculator it cannot run) or "ase".
    ``engine_options``: the engine's ``block``, ``steps_per_graph``, ``cuda_graph``, ``rebuild_margin``.

    ``calculator`` replaces ``atoms.calc`` when given. Velocities are drawn from Maxwell-Boltzmann at
    ``temperature_K`` (``seed``, zero total momentum) when ``init_velocities`` is True, or when it is None and
    the atoms are at rest. ``trajectory``: a new .traj/.xyz/.extxyz file written every ``trajectory_interval``
    steps and at the last step (an existing file only with ``force=True``). ``log``: print (default), a
    callable taking a line, a stream, a file name (the lines go to that new file instead of stdout), a list of
    these (``[print, "md.log"]``: each line to all) or None. ``plot``: a new .png/.pdf/.svg file, written at
    the end (also after a blow-up or Ctrl-C) from the values at the progress lines (needs matplotlib).

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
    o = checked_options(dict(
        ensemble=ensemble, temperature_K=temperature_K, timestep_fs=timestep_fs, steps=steps, friction=friction,
        pressure_bar=pressure_bar, taut_fs=taut_fs, taup_fs=taup_fs, compressibility_per_bar=compressibility_per_bar,
        trajectory_interval=trajectory_interval, log_interval=log_interval, seed=seed, force=force,
        init_velocities=init_velocities, max_temperature_K=max_temperature_K, engine=engine,
        thermostat=thermostat), str)
    options = check_engine_options(engine_options)
    if restart is not None and o["init_velocities"]:
        raise ValueError("init_velocities: a restart continues the saved velocities; leave init_velocities out")
    if restart is not None and not isinstance(restart, str | os.PathLike | Restart):
        raise TypeError(f"restart: expected a trajectory file name or a Restart, got {type(restart).__name__}")
    _check_calculator(atoms, calculator)
    path = check_new_path(trajectory, o["force"]) if trajectory is not None else None
    named = [x for x in (log if isinstance(log, list | tuple) else [log]) if isinstance(x, str | os.PathLike)]
    log_path = check_new_path(named[0], o["force"], "log", suffixes=None) if named else None
    plot_path = check_new_path(plot, o["force"], "plot", PLOT_SUFFIXES) if plot is not None else None
    if plot_path is not None:
        check_matplotlib("plot")
    restart_path = None if restart is None else restart.path if isinstance(restart, Restart) else Path(restart)
    check_distinct({"trajectory": path, "log": log_path, "plot": plot_path}, {"restart": restart_path})
    state = read_restart(restart) if restart is not None else None
    if state is not None:
        check_same_system(atoms, state)
    check_atoms_for(o["ensemble"], atoms if atoms is not None else state.atoms, str)
    calc = calculator if calculator is not None else atoms.calc
    which = choose_engine(o["engine"], calc, atoms if atoms is not None else state.atoms)
    out, close_log, log_path = make_printer(log, o["force"])  # the last check: it creates the log file
    atoms = continue_from(atoms, state) if state is not None else atoms
    if calculator is not None:
        atoms.calc = calculator
    try:
        return _run(atoms, o, path, out, state, log_path, which, options, plot_path)
    finally:
        close_log()


def _run(atoms: Atoms, o: dict[str, Any], path: Path | None, out: Callable[[str], None], state: Restart | None,
         log_path: Path | None, which: str, engine_options: dict[str, Any], plot: Path | None) -> MDSummary:
    rng = np.random.default_rng(o["seed"])
    if state is not None and state.rng_state is not None:
        rng.bit_generator.state = state.rng_state  # the generator's kind was checked by read_restart
    elif state is None and (o["init_velocities"] or (o["init_velocities"] is None and not np.any(atoms.get_momenta()))):
        thermalize(atoms, o["temperature_K"], rng)
    calc = atoms.calc
    stress_flag = getattr(calc, "stress_with_forces", None) if which == "ase" else None
    if o["ensemble"] == "npt" and stress_flag is False:
        calc.stress_with_forces = True  # the barostat asks for the stress after the forces: one model run, not two
    start = state.step if state is not None else 0
    if which == "device":
        intervals = (o["log_interval"], *((o["trajectory_interval"],) if path is not None else ()))
        dyn = engine_dynamics(atoms, calc, o, state, engine_options, intervals)
    else:
        dyn = AseDynamics(ase_dynamics(atoms, o, rng))
    dyn.nsteps = start
    end = start + o["steps"]
    dt = o["timestep_fs"]
    time0 = state.time_fs if state is not None and math.isfinite(state.time_fs) else start * dt
    writer = TrajectoryWriter(path, atoms) if path is not None else None
    guard = Guard(atoms, o["max_temperature_K"])
    ensemble = o["ensemble"]
    out(f"cgforge md: {len(atoms)} atoms, {ensemble.upper()}"
        + (f" at {o['temperature_K']:g} K" if ensemble != "nve" else "")
        + (f" and {o['pressure_bar']:g} bar" if ensemble == "npt" else "")
        + f", timestep {dt:g} fs, {o['steps']} steps"
        + (f" from step {start} of {state.path}" if state is not None else "")
        + (f", trajectory {path}" if path else "")
        + f", stop above {o['max_temperature_K']:g} K; {dyn.describe()}")
    progress: Progress | None = None
    wall_start = time.perf_counter()
    step = start
    completed = False

    def time_fs(s: int) -> float:
        return time0 + (s - start) * dt

    def frame(s: int) -> None:
        if writer is not None and writer.last_step != s:
            info = {"md_step": s, "md_time_fs": time_fs(s), "md_etot0": progress.etot0, "md_ensemble": ensemble,
                    **dyn.restart_info()}
            writer.write(s, info)

    try:
        with _ctrl_c_after_step() as interrupted:
            dyn.interrupted = interrupted  # the engine polls it between blocks
            for _ in dyn.irun(o["steps"]):
                step = dyn.nsteps
                guard.check(step)
                if progress is None:
                    etot0 = (state.etot0 if state is not None and state.etot0 is not None
                             else total_energy(atoms))
                    progress = Progress(atoms, out, etot0, start, time_fs(start))
                    progress.header()
                if writer is not None and (step == end or (step % o["trajectory_interval"] == 0
                                                            and not (state is not None and step == start))):
                    frame(step)
                if step == start or step == end or step % o["log_interval"] == 0:
                    progress(step, time_fs(step), total_energy(atoms))
                if interrupted() and step < end:
                    raise _StopRequested
        completed = True
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
        summary = _summary(atoms, o, start, step, wall_start, progress, path, writer, log_path, which)
        raise MDInterrupted(message, step, summary) from None
    except Exception as err:
        out(f"stopped after step {dyn.nsteps}: {type(err).__name__}: {err}")
        raise
    finally:
        if writer is not None:
            writer.close()
        if stress_flag is False:
            calc.stress_with_forces = False
        plotted = _plot(plot, progress, atoms, o, out, completed)
    summary = _summary(atoms, o, start, end, wall_start, progress, path, writer, log_path, which)
    summary.plot = plotted
    out(f"done: {o['steps']} steps, {summary.simulated_ps:g} ps in {summary.wall_s:.1f} s "
        f"({summary.ns_per_day:.3f} ns/day)" + (f"; trajectory: {path}" if path else ""))
    return summary


def _plot(path: Path | None, progress: Progress | None, atoms: Atoms, o: dict[str, Any], out: Callable[[str], None],
          completed: bool) -> str | None:
    """The plot of what was recorded; a failure after a failed run is a line (the run's error stays the one
    raised), after a completed run an error."""
    if path is None:
        return None
    history = progress.history if progress is not None else []
    ensemble = o["ensemble"]
    targets = {"temperature_K": o["temperature_K"]} if ensemble != "nve" else {}
    if ensemble == "npt":
        targets["pressure_bar"] = o["pressure_bar"]
    title = (f"{len(atoms)} atoms, {ensemble.upper()}" + (f" {o['temperature_K']:g} K" if ensemble != "nve" else "")
             + (f" {o['pressure_bar']:g} bar" if ensemble == "npt" else "") + f", {o['timestep_fs']:g} fs")
    try:
        if write_plot(path, history, title, ensemble == "npt", targets):
            out(f"plot: {path}")
            return str(path)
        out(f"plot: nothing recorded, {path} not written")
    except Exception as err:
        if completed:
            raise
        out(f"plot: {path} not written ({type(err).__name__}: {err})")
    return None


def _summary(atoms: Atoms, o: dict[str, Any], start: int, last: int, wall_start: float, progress: Progress | None,
             path: Path | None, writer: TrajectoryWriter | None, log_path: Path | None, which: str) -> MDSummary:
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
        engine=which,
    )
