"""Molecular dynamics: NVT (Langevin or CSVR), NVE or NPT with progress lines, a trajectory, blow-up
detection, restarts, a clean Ctrl-C and a plot (:func:`run_md`; docs/md.md).

:func:`plan_md` checks every argument, output file and the structure once; :meth:`MDPlan.run` runs, on
cgforge's device engine (``engine.py``) or ASE's dynamics (``dynamics.py``). Each frame's ``atoms.info`` holds
what a restart continues (``md_step``, ``md_time_fs``, ``md_etot0``, ``md_rng``/``md_engine``, ``md_<keyword>``
of :meth:`MDOptions.saved`, ``md_epot``, ``md_model``).
"""

from __future__ import annotations

import difflib
import inspect
import math
import os
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TextIO

import numpy as np
from ase import Atoms

from .checks import CtrlC, Guard, MDInstabilityError, MDSummary, Progress, summarize, total_energy
from .compile_trial import auto_compile, engine_trial
from .dynamics import AseDynamics, ase_dynamics, choose_engine, engine_dynamics, thermalize
from .files import (
    MODEL_MISMATCH_MEV_PER_ATOM,
    PLOT_SUFFIXES,
    FreeName,
    Printer,
    Reservations,
    Restart,
    TrajectoryWriter,
    check_distinct,
    check_new_path,
    check_restart_model,
    check_same_system,
    continue_from,
    default_trajectory_path,
    make_printer,
    model_name,
    read_restart,
    read_structure,
)
from .options import COMPILE_AUTO_MIN_STEPS, OPTION_FIELDS, EngineOptions, MDOptions, refuse_on_restart
from .plot import check_matplotlib, plot_run

__all__ = ["run_md", "plan_md", "MDPlan", "MDSummary", "MDInstabilityError", "MDInterrupted", "Restart",
           "read_restart", "read_structure", "check_new_path", "default_trajectory_path", "MODEL_MISMATCH_MEV_PER_ATOM",
           "model_banner", "options_banner", "auto_compile"]

class MDInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM (``signum``) during :func:`run_md`: stopped cleanly after ``step`` (``summary``)."""

    def __init__(self, message: str, step: int, summary: MDSummary, signum: int = signal.SIGINT) -> None:
        super().__init__(message)
        self.step, self.summary, self.signum = step, summary, signum


class _StopRequested(Exception):
    """The first Ctrl-C, acted on between steps."""


def _as_path(value: Any, what: str) -> Path | None:
    if value is None:
        return None
    if not isinstance(value, str | os.PathLike):
        raise TypeError(f"{what}: expected a file name, got {type(value).__name__}")
    return Path(value)


def run_md(
    atoms: Atoms | None,
    calculator: Any = None,
    *,
    restart: str | os.PathLike | Restart | None = None,
    trajectory: str | os.PathLike | None = None,
    log: TextIO | Callable[[str], None] | str | os.PathLike | list | tuple | None = print,
    plot: str | os.PathLike | None = None,
    engine_options: EngineOptions | dict[str, Any] | None = None,
    **options: Any,
) -> MDSummary:
    """Run MD on ``atoms`` in place with the ``options`` of :class:`MDOptions`, one keyword per field (docs/md.md
    has the table). ``calculator`` replaces ``atoms.calc``; ``trajectory``: a new .traj/.xyz/.extxyz file;
    ``log``: print, a callable, a stream, a file name, a list of these or None; ``plot``: a new .png/.pdf/.svg;
    ``restart``: a trajectory written by run_md (or a :class:`Restart`) continued for ``steps`` more steps with
    its saved options (``atoms`` may then be None). A blow-up raises :class:`MDInstabilityError`; Ctrl-C and
    SIGTERM stop after the current step and raise :class:`MDInterrupted`."""
    plan = plan_md(atoms, calculator, restart=restart, trajectory=trajectory, log=log, plot=plot,
                   engine_options=engine_options, **options)
    return plan.run()


# run_md's keywords: the files above and one per MDOptions field (its default), for help() and the checks
run_md.__signature__ = inspect.signature(run_md).replace(parameters=[  # type: ignore[attr-defined]
    *[p for p in inspect.signature(run_md).parameters.values() if p.kind != p.VAR_KEYWORD],
    *[inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
      for f in fields(MDOptions)]])


def plan_md(atoms: Atoms | None, calculator: Any = None, *, names: Mapping[str, str] | None = None,
            inputs: dict[str, Path | None] | None = None, structure: Path | None = None,
            calculator_later: bool = False, new_run: str | None = None, prog: str = "run_md",
            **arguments: Any) -> MDPlan:
    """Check :func:`run_md`'s ``arguments``, its output files and the structure once, read the restart, create the
    outputs: the :class:`MDPlan` whose ``run()`` runs. ``names``: what the user typed for an argument (flags);
    ``inputs``: more files no output may name; ``structure``: a file to read as ``atoms``; ``calculator_later``:
    it comes with :meth:`MDPlan.attach`; ``new_run``, ``prog``: for the messages."""
    if unknown := sorted(k for k in arguments if k not in _RUN_MD_DEFAULTS):
        known = [p.name for p in inspect.signature(run_md).parameters.values() if p.kind != p.VAR_KEYWORD]
        close = difflib.get_close_matches(unknown[0], known, n=1, cutoff=0.5)
        hint = f" (did you mean {close[0]!r}?)" if close else f"; known: {', '.join(known)}"
        raise TypeError(f"run_md: unknown argument {unknown[0]!r}{hint}")
    # one lookup for every check (a dict's own method: the checks never call back into the caller's code)
    names = {**{k: k for k in (*_RUN_MD_DEFAULTS, "atoms", "calculator", "structure")}, **(names or {})}.__getitem__
    a = {**_RUN_MD_DEFAULTS, **arguments}
    restart = a["restart"]
    if atoms is None and restart is None and structure is None:
        raise TypeError(f"{names('atoms')}: expected an ase.Atoms (None only with restart=...)")
    if atoms is not None and not isinstance(atoms, Atoms):
        raise TypeError(f"{names('atoms')}: expected an ase.Atoms, got {type(atoms).__name__}")
    if atoms is not None and len(atoms) == 0:
        raise ValueError(f"{names('atoms')}: expected a structure with at least one atom, got an empty Atoms")
    if restart is not None and not isinstance(restart, str | os.PathLike | Restart):
        raise TypeError(f"{names('restart')}: expected a trajectory file name or a Restart, got "
                        f"{type(restart).__name__}")
    if calculator is None and not calculator_later and (atoms is None or atoms.calc is None) and structure is None:
        raise ValueError("calculator: atoms has no calculator; pass one (e.g. cgforge.plugin.Calculator('mace'))")
    # outputs: never an input (force or not), then new (or --force), in a folder that takes them
    named_logs = [x for x in (a["log"] if isinstance(a["log"], list | tuple) else [a["log"]])
                  if isinstance(x, str | os.PathLike)]
    outputs = {names("trajectory"): _as_path(a["trajectory"], names("trajectory")),
               names("log"): Path(named_logs[0]) if named_logs else None,
               names("plot"): _as_path(a["plot"], names("plot"))}
    restart_path = None if restart is None else restart.path if isinstance(restart, Restart) else Path(restart)
    check_distinct(outputs, {names("restart"): restart_path, names("structure"): structure, **(inputs or {})})
    if structure is not None:
        atoms = read_structure(structure, names("structure"))
    given = {k: a[k] for k in OPTION_FIELDS}
    if restart is None:
        state, o = None, MDOptions.given(given, names)
    else:
        refuse_on_restart(given, names)
        state = read_restart(restart, names("restart"))
        new_run = new_run or f"atoms=read_structure({str(state.path)!r}) without restart="
        o = MDOptions.given(given, names, {**state.options, "engine": _engine_of(state)}, str(state.path), new_run)
    engine_options = EngineOptions.of(a["engine_options"], names("engine_options")).for_one_structure("run_md")
    force = o.force
    path, log_path, plot_path = outputs.values()
    free = isinstance(a["trajectory"], FreeName)  # a default name: the next free one if it is taken meanwhile
    path = check_new_path(path, force or free, names("trajectory")) if path is not None else None
    if log_path is not None:
        check_new_path(log_path, force, names("log"), suffixes=None)
    if plot_path is not None:
        plot_path = check_new_path(plot_path, force, names("plot"), PLOT_SUFFIXES)
        check_matplotlib(names("plot"))
    if state is not None:  # the frame's positions and cell are the ones that run
        check_same_system(atoms, state)
        _check_structure(state.atoms, f"{names('restart')}: {state.path}")
    else:
        _check_structure(atoms, names("atoms"))
        for key in [k for k in atoms.info if k.startswith("md_")]:  # a run's own records (a frame read as a
            del atoms.info[key]  # structure): a new run writes its own, never another run's random state
    system = atoms if atoms is not None else state.atoms
    if o.ensemble == "npt" and not (system.pbc.all() and abs(system.cell.volume) > 0):
        raise ValueError(f"{names('ensemble')}: NPT changes the cell and needs a periodic 3-D cell; this structure "
                         f"has pbc={system.pbc.tolist()} and volume {abs(system.cell.volume):g} Å^3")
    reserved = Reservations()  # the last checks: the output files are created (a concurrent run gets others)
    try:
        path = reserved.take(a["trajectory"] if free else path, force, names("trajectory")) if path else None
        plot_path = reserved.take(plot_path, force, names("plot")) if plot_path is not None else None
        printer = make_printer(a["log"], force, names("log"))
    except BaseException:
        reserved.release()
        raise
    if state is not None and state.note:
        printer.write(state.note)
    atoms = continue_from(atoms, state) if state is not None else atoms
    plan = MDPlan(atoms=atoms, o=o, trajectory=path, printer=printer, plot=plot_path, restart=state,
                  engine_options=engine_options, names=names, prog=prog, new_run=new_run, reserved=reserved,
                  engine_given=given["engine"] is not None)
    if calculator is not None:
        try:
            plan.attach(calculator)
        except BaseException:
            plan.close()  # a refused calculator or engine leaves no reserved output behind
            raise
    return plan


def _check_structure(atoms: Atoms, what: str) -> None:
    """What needs no model: finite positions and cell, a periodic cell that spans its periodic directions."""
    positions = atoms.get_positions()
    bad = ~np.isfinite(positions).all(axis=1)
    if bad.any():
        first = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{what}: {int(bad.sum())} of {len(atoms)} atoms have non-finite positions (first: atom "
                         f"{first}, {atoms.get_chemical_symbols()[first]}, {positions[first].tolist()})")
    cell = np.asarray(atoms.cell, dtype=float)
    if not np.isfinite(cell).all():
        raise ValueError(f"{what}: the cell is not finite: {cell.tolist()}")
    pbc = np.asarray(atoms.pbc, dtype=bool)
    if pbc.any():
        vectors = cell[pbc]
        lengths = np.linalg.norm(vectors, axis=1)
        gram = float(np.linalg.det(vectors @ vectors.T))
        if (lengths <= 1e-6).any() or gram <= 1e-12 * float(np.prod(lengths**2)):
            raise ValueError(f"{what}: the cell is singular along its periodic directions (pbc={pbc.tolist()}, cell "
                             f"{np.round(cell, 6).tolist()}): give each periodic direction a cell vector, the "
                             "vectors independent")


_RUN_MD_DEFAULTS = {p.name: p.default for p in inspect.signature(run_md).parameters.values()
                    if p.kind == p.KEYWORD_ONLY}
_PATHS = {"device": "cgforge's device engine", "ase": "ASE's dynamics"}


def _engine_of(state: Restart) -> str:
    """The engine that wrote a restart's frame (``md_engine``: the device engine)."""
    return "device" if state.engine_state is not None else "ase"


@dataclass
class MDPlan:
    """A run checked by :func:`plan_md`: structure, options ``o``, output files, the log's :class:`Printer`."""

    atoms: Atoms
    o: MDOptions
    trajectory: Path | None
    printer: Printer
    plot: Path | None
    restart: Restart | None
    engine_options: EngineOptions
    names: Callable[[str], str] = str
    prog: str = "run_md"
    new_run: str | None = None
    model: str | None = None  # the model's name as the user gave it, saved in frames (md_model)
    engine: str | None = None  # the integrator path chosen by attach: "device" or "ase"
    reserved: Reservations | None = None  # the output files created for this run (released by close)
    engine_given: bool = True  # False: a restart's engine, not one the user named
    errors_to_caller: bool = False  # True: "stopped ..." lines only to the log file (cgforge md prints the error)

    @property
    def out(self) -> Callable[[str], None]:
        return self.printer.write

    def attach(self, calc: Any) -> None:
        """``calc`` becomes the run's calculator, checked against the structure and the integrator path."""
        if isinstance(calc, str | os.PathLike):
            raise TypeError(f"calculator: expected an ASE calculator, got the {type(calc).__name__} {str(calc)!r}; "
                            f"load the model first: Calculator({str(calc)!r}) from cgforge.plugin")
        if not callable(getattr(calc, "get_forces", None)) and not callable(getattr(calc, "calculate", None)):
            raise TypeError(f"calculator: expected an ASE calculator (e.g. cgforge.plugin.Calculator('mace')), got "
                            f"{type(calc).__name__}")
        adapter = getattr(calc, "adapter", None)
        if callable(getattr(adapter, "species", None)):
            try:
                adapter.species(self.atoms.numbers)
            except ValueError as err:  # UnknownElementError: the model has no such element
                source = self.names("restart") if self.restart is not None else self.names("atoms")
                raise ValueError(f"{source}: {str(err).removeprefix('atoms: ')}") from None
        self.engine = choose_engine(self.o.engine, calc, self.atoms, self.names("engine"),
                                    None if self.engine_given or self.restart is None else self.restart.path)
        self.atoms.calc = calc

    def start(self, calc: Any = None, seconds: float | None = None) -> None:
        """Before the first step: ``calc`` attached, the radial-precision line, ``relax``, the ``compile`` decision.
        ``seconds``: the model's load time when the caller loaded it (then the model and options lines too)."""
        calc = calc if calc is not None else self.atoms.calc
        if calc is None:
            raise ValueError("calculator: none attached; pass one (e.g. cgforge.plugin.Calculator('mace'))")
        loaded = seconds is not None  # the caller loaded the model for this run: its lines too
        if loaded:
            self.out(model_banner(self.model or type(calc).__name__, calc, seconds))
        if self.engine is None or calc is not self.atoms.calc:
            self.attach(calc)  # an element the model lacks, another model than the restart's: before any step
        mode = getattr(calc, "radial_precision_requested", "fp32")
        if mode != "fp32":
            self.atoms.get_forces()  # the first structure decides (see Calculator)
            kept = "kept" if calc.radial_precision == mode else "refused: radial MLPs stay in fp32"
            self.out(f"radial MLPs in {mode} {kept}: the forces changed by {calc.radial_precision_error:.1e} "
                     "relative (tolerance 1e-4)")
        if self.o.compile not in ("auto", "off") and getattr(calc, "compile", None) != self.o.compile:
            if not callable(getattr(calc, "set_compile", None)):
                raise ValueError(f"{self.names('compile')}: {type(calc).__name__} cannot be compiled (a cgforge "
                                 "Calculator can)")
            calc.set_compile(self.o.compile)
        if self.o.relax:  # FIRE towards 0.1 eV/Å
            from ase.optimize import FIRE

            before = self.atoms.get_potential_energy()
            optimizer = FIRE(self.atoms, logfile=None)
            optimizer.run(fmax=0.1, steps=self.o.relax)
            self.out(f"relaxed {optimizer.nsteps} FIRE steps: energy {before:.4f} -> "
                     f"{self.atoms.get_potential_energy():.4f} eV, max force "
                     f"{float(np.linalg.norm(self.atoms.get_forces(), axis=1).max()):.3f} eV/Å")
        if self.o.compile == "auto" and not getattr(calc, "compile", None):
            trial = (lambda: engine_trial(calc, self.atoms, self.o, self.engine_options)) if self.engine == "device" \
                else None
            line = auto_compile(calc, self.atoms, self.o.steps, trial, say=self.out)
            # said when the caller loaded the model, and whenever auto may have run a trial or compiled
            if line and (loaded or self.o.steps >= COMPILE_AUTO_MIN_STEPS):
                self.out(line)
        if loaded:
            self.out(options_banner(calc, self.engine, self.o.engine, calc.neighbours.skin))

    def run(self, calc: Any = None, *, seconds: float | None = None, close: bool = True) -> MDSummary:
        """:meth:`start`, then the steps (:func:`run_md`); the log closed at the end unless ``close`` is False."""
        try:
            self.start(calc, seconds)
        except BaseException as err:
            self.close(err)
            raise
        try:
            return _run(self, self.engine)
        finally:
            if close:
                self.close()

    def close(self, error: BaseException | None = None) -> None:
        """Close the log, release unused outputs; ``error`` (before the first step) goes to the log file first."""
        if error is not None and self.errors_to_caller and not isinstance(error, KeyboardInterrupt):
            self.printer.to_file(f"error: {error}")
        self.printer.close()
        if self.reserved is not None:
            self.reserved.release()  # the outputs no frame or plot was written to


def model_banner(name: str, calc: Any, seconds: float) -> str:
    """One line about the loaded model: kind, cutoff, device, dtype, which code runs it, load time."""
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in calc.model.parameters() if p.is_floating_point()})
    dtype = "/".join(dtypes) if dtypes else str(calc.dtype).removeprefix("torch.")
    compiled = " (kernels compiled)" if calc.device.type == "cuda" and getattr(calc, "patched", False) else ""
    code = ("cgforge's kernels" if getattr(calc, "patched", False) else
            "the model's own code" + (" (faster than cgforge's kernels on a CPU)" if calc.device.type == "cpu" else ""))
    mode = getattr(calc, "compile", None)
    inductor = f"; torch.compile ({mode}) at the first step" if mode else ""
    errors = getattr(calc, "radial_table_errors", [])
    table = (f"; radial tables ({max(n for n, _ in errors)} intervals, error {max(e for _, e in errors):.0e})"
             if errors else "")
    return (f"model {name} ({calc.adapter.kind}, cutoff {calc.cutoff:g} Å) on {calc.device} in {dtype}, {code}, "
            f"ready in {seconds:.1f} s{compiled}{table}{inductor}")


def options_banner(calc: Any, engine: str, requested: str, skin: float) -> str:
    """The effective run options in one line: integrator path, compile, CUDA graph, tables, memory, skin, tuning."""
    why = ""
    if requested == "auto":
        why = " (auto: the device engine runs a cgforge Calculator on CUDA)" if engine == "device" else \
              f" (auto: ASE's dynamics {'on a CPU' if calc.device.type != 'cuda' else 'for this box'})"
    memory = ("streamed edges" if getattr(calc, "streaming", False) else "stored edges") + (
        " (streaming auto: on when the box would not fit)" if getattr(calc, "streaming_requested", None) is None
        and calc.device.type == "cuda" else "")
    workspace = getattr(getattr(calc, "potential", None), "workspace", None)
    tiles = workspace is not None and workspace.tiles_chosen
    if tiles:
        memory = "tiles with a fixed working set (workspace " + workspace.mode + ")"
    graph = "off (tiles run eagerly)" if tiles else "on" if getattr(calc, "cuda_graph", False) else "off"
    parts = [f"engine {_PATHS[engine]}{why}", f"torch.compile {getattr(calc, 'compile', None) or 'off'}",
             f"CUDA graph {graph}",
             f"radial tables {'on' if getattr(calc, 'radial_table', False) else 'off'}",
             f"memory: {memory}", f"skin {skin:g} Å"]
    tuning = getattr(calc, "tuning", None)  # a KernelTuning value; no environment variable changes a kernel
    if tuning is not None and tuning != type(tuning)() and getattr(calc, "patched", False):
        parts.append("kernel tuning: " + tuning.describe().replace("\n", ", "))
    return "options: " + ", ".join(parts)


def _run(plan: MDPlan, which: str) -> MDSummary:
    atoms, o, path, out, state = plan.atoms, plan.o, plan.trajectory, plan.out, plan.restart
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
        dyn = engine_dynamics(atoms, calc, o, state, plan.engine_options, intervals)
        stop_when = f"after the current block (at most {dyn.engine.block} steps)"
    else:
        dyn = AseDynamics(ase_dynamics(atoms, o, rng))
        stop_when = "after the current step"
    dyn.nsteps = start
    end = start + o["steps"]
    dt = o["timestep_fs"]
    time0 = state.time_fs if state is not None and math.isfinite(state.time_fs) else start * dt
    writer = TrajectoryWriter(path, atoms, plan.names("trajectory"), plan.reserved) if path is not None else None
    guard = Guard(atoms, o["max_temperature_K"])
    saved = {f"md_{k}": v for k, v in o.saved().items()}
    saved["md_model"] = model = model_name(plan.model, calc)
    n = len(atoms)
    if state is not None and which != _engine_of(state):
        out(f"note: {state.path} was written by {_PATHS[_engine_of(state)]}; this run continues on {_PATHS[which]}, "
            "whose random numbers differ: not the bit-for-bit continuation")
    out(f"cgforge md: {n} atom{'s' if n != 1 else ''}, {o.describe()}, {o.steps} steps"
        + (f" from step {start} of {state.path} (its saved options)" if state is not None else "")
        + (f", trajectory {path}" if path else "")
        + f", stop above {o['max_temperature_K']:g} K; {dyn.describe()}")
    stopped = plan.printer.to_file if plan.errors_to_caller else out  # the error is printed once
    progress: Progress | None = None
    wall_start = time.perf_counter()
    step = start
    ctrl_c = CtrlC(lambda how: f"{plan.prog}: {how}: the run stops {stop_when} and writes its frame; "
                   f"{'press Ctrl-C' if how == 'Ctrl-C' else 'send it'} again to stop now (the trajectory keeps its "
                   "complete frames)")

    def time_fs(s: int) -> float:
        return time0 + (s - start) * dt

    def frame(s: int) -> None:
        if writer is not None and writer.last_step != s:
            info = {"md_step": s, "md_time_fs": time_fs(s), "md_etot0": progress.etot0,
                    "md_epot": float(atoms.get_potential_energy()), **saved, **dyn.restart_info()}
            with ctrl_c.writing():
                writer.write(s, info)

    def line(s: int) -> None:
        if progress is not None and (progress.last_step != s or not progress.history):
            progress(s, time_fs(s), total_energy(atoms))

    with ctrl_c.active():  # until the end: a second Ctrl-C while the last frame is written waits for it
        try:
            dyn.interrupted = ctrl_c  # the engine polls it between blocks
            for _ in dyn.irun(o["steps"]):
                step = dyn.nsteps
                guard.check(step)
                if progress is None:
                    if state is not None:
                        check_restart_model(state, atoms, model, plan.names("restart"), plan.new_run)
                    etot0 = state.etot0 if state is not None and state.etot0 is not None else total_energy(atoms)
                    progress = Progress(atoms, out, etot0, start, time_fs(start))
                    progress.header()
                if writer is not None and (step == end or (step % o["trajectory_interval"] == 0
                                                            and not (state is not None and step == start))):
                    frame(step)
                if step == start or step == end or step % o["log_interval"] == 0:
                    line(step)
                if ctrl_c() and step < end:
                    raise _StopRequested
        except MDInstabilityError as err:
            stopped(f"stopped: {err}")
            raise
        except (_StopRequested, KeyboardInterrupt) as err:
            # A second Ctrl-C may land mid-step: then the atoms are half updated and no frame or line is written.
            try:
                if isinstance(err, _StopRequested):
                    frame(step)  # the state of the last completed step, for a restart
                    line(step)  # the log and the plot end where the trajectory does
            except KeyboardInterrupt:
                pass
            finally:
                if writer is not None:
                    writer.close()
            saved_to = (f"; trajectory {path} ends at step {writer.last_step} (continue with --restart {path} / "
                        f"restart={str(path)!r})") if writer is not None and writer.last_step is not None else ""
            message = f"interrupted ({ctrl_c.how}) at step {step}{saved_to}"
            out(message)
            summary = summarize(atoms, o, start, step, wall_start, progress, path, writer, plan.printer.path, which)
            raise MDInterrupted(message, step, summary, ctrl_c.signum) from None
        except Exception as err:
            when = f"after step {dyn.nsteps}" if progress is not None else "before the first step"
            stopped(f"stopped {when}: {type(err).__name__}: {err}")
            raise
        finally:
            if writer is not None:
                writer.close()
            if stress_flag is False:
                calc.stress_with_forces = False
            plotted = (plot_run(plan.plot, progress.history if progress is not None else [], len(atoms), o, out,
                            plan.names("plot")) if plan.plot is not None else None)
    summary = summarize(atoms, o, start, end, wall_start, progress, path, writer, plan.printer.path, which)
    summary.plot = plotted
    speed = f" ({summary.ns_per_day:.3f} ns/day)" if math.isfinite(summary.ns_per_day) else ""
    out(f"done: {o['steps']} step{'s' if o['steps'] != 1 else ''}, {summary.simulated_ps:g} ps in "
        f"{summary.wall_s:.1f} s{speed}" + (f"; trajectory: {path}" if path else ""))
    return summary
