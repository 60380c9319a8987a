"""What an MD run reports and checks: the progress lines (and the values the plot needs), the blow-up guard,
with the one error both integrator paths raise, and Ctrl-C and SIGTERM (``CtrlC``: stop after the step, a second
one now)."""

from __future__ import annotations

import math
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from ase import Atoms

from .plot import record


class MDInstabilityError(RuntimeError):
    """The run blew up: non-finite forces/energy or a runaway temperature at ``step``."""

    def __init__(self, step: int, quantity: str, value: float, message: str) -> None:
        super().__init__(message)
        self.step, self.quantity, self.value = step, quantity, value


def instability(step: int, quantity: str, value: float, what: str) -> MDInstabilityError:
    return MDInstabilityError(step, quantity, value,
                              f"MD became unstable at step {step}: {what}. Try a smaller timestep, relax the "
                              "structure first, or check the model and the structure")


def too_hot(temperature: float, limit: float) -> str:
    return (f"the temperature reached {temperature:.4g} K, above the limit of {limit:g} K (max_temperature_K, "
            "--max-temperature)")


def engine_blow_up(err: Any, max_temperature_K: float) -> MDInstabilityError:
    """The engine's ``MDBlowUp`` as the error (and message) run_md raises on both paths."""
    value = err.value
    what = {"temperature": lambda: too_hot(value, max_temperature_K),
            "energy": lambda: f"the potential energy is {value}",
            "forces": lambda: f"the forces are not finite (largest component {value})",
            }.get(err.quantity, lambda: str(err).split("; the engine's state")[0].removeprefix("MD blew up at "))()
    return instability(err.step, err.quantity, value, what)


class Progress:
    """A line per call: step, ps, ns/day since the previous line, T, total energy and its drift."""

    def __init__(self, atoms: Atoms, out: Callable[[str], None], etot0: float, start_step: int,
                 start_time_fs: float) -> None:
        self.atoms, self.out, self.etot0 = atoms, out, etot0
        self.n_atoms = len(atoms)
        self.last_step, self.last_time_fs = start_step, start_time_fs
        self.last_time = time.perf_counter()
        self.drift, self.ns_per_day = 0.0, float("nan")
        self.history: list[dict[str, float]] = []  # the values of every line, for the plot

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
        self.history.append(record(self.atoms, step, time_fs, etot, self.ns_per_day))
        self.last_step, self.last_time, self.last_time_fs = step, now, time_fs


def total_energy(atoms: Atoms) -> float:
    return float(atoms.get_potential_energy()) + float(atoms.get_kinetic_energy())


class Guard:
    """Stops a run that blew up: non-finite forces or energy, or a temperature above the limit."""

    def __init__(self, atoms: Atoms, max_temperature_K: float) -> None:
        self.atoms, self.max_temperature_K = atoms, max_temperature_K

    def check(self, step: int) -> None:
        atoms = self.atoms
        forces = atoms.get_forces()  # cached: the integrator just asked for them
        bad = ~np.isfinite(forces).all(axis=1)
        if bad.any():
            first = int(np.flatnonzero(bad)[0])
            raise instability(step, "forces", float(forces[first][~np.isfinite(forces[first])][0]),
                              f"the forces are not finite on {int(bad.sum())} of {len(atoms)} atoms (first: atom "
                              f"{first}, {atoms.get_chemical_symbols()[first]}, force {forces[first].tolist()})")
        results = getattr(atoms.calc, "results", None)
        energy = results.get("energy") if isinstance(results, dict) else None
        if energy is not None and not np.isfinite(energy):
            raise instability(step, "energy", float(energy), f"the potential energy is {float(energy)}")
        temperature = float(atoms.get_temperature())
        if not math.isfinite(temperature):
            raise instability(step, "temperature", temperature,
                              f"the temperature is {temperature} (non-finite velocities)")
        if temperature > self.max_temperature_K:
            raise instability(step, "temperature", temperature, too_hot(temperature, self.max_temperature_K))


class Terminated(KeyboardInterrupt):
    """SIGTERM (what batch schedulers send before they kill a job) outside a run's steps, under
    :func:`sigterm_as_interrupt`: unwinds like Ctrl-C (files closed, empty reservations released)."""

    signum = signal.SIGTERM


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated("terminated (SIGTERM)")


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """While active (main thread, over the default handler): SIGTERM raises :class:`Terminated`; inside a run,
    :class:`CtrlC` takes it over (the run stops after its step and writes its frame)."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class CtrlC:
    """While ``active`` (main thread, over default handlers only): the first Ctrl-C or SIGTERM prints
    ``notice(how)`` and sets a flag (the run stops after its step); a second interrupts at once, or inside
    ``writing()`` once the frame is complete. ``how``/``signum``: which came (SIGTERM wins)."""

    HOW = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}

    def __init__(self, notice: Callable[[str], str]) -> None:
        self.notice = notice
        self.pressed, self.signum = 0, signal.SIGINT
        self._writing, self._pending = 0, False  # inside writing(); a second signal waits for its end

    @property
    def how(self) -> str:
        return self.HOW[self.signum]

    def __call__(self) -> bool:
        return self.pressed > 0

    def _handler(self, signum: int, frame: Any) -> None:
        self.pressed += 1
        if signum == signal.SIGTERM or self.pressed == 1:
            self.signum = signal.Signals(signum)
        if self.pressed == 1:
            print(self.notice(self.how), file=sys.stderr, flush=True)
        elif self._writing:
            self._pending = True
        else:
            raise KeyboardInterrupt

    @contextmanager
    def active(self) -> Iterator[CtrlC]:
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        ours = {signal.SIGINT: (signal.default_int_handler,), signal.SIGTERM: (signal.SIG_DFL, _raise_terminated)}
        previous = {s: signal.getsignal(s) for s in ours}
        taken = [s for s in ours if previous[s] in ours[s]]
        for s in taken:
            signal.signal(s, self._handler)
        try:
            yield self
        finally:
            for s in taken:
                signal.signal(s, previous[s])

    @contextmanager
    def writing(self) -> Iterator[None]:
        self._writing += 1
        try:
            yield
        finally:
            self._writing -= 1
        if self._pending and not self._writing:
            self._pending = False
            raise KeyboardInterrupt


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


def summarize(atoms: Atoms, o: dict[str, Any], start: int, last: int, wall_start: float, progress: Progress | None,
              path: Path | None, writer: Any, log_path: Path | None, which: str) -> MDSummary:
    """The :class:`MDSummary` of a run from ``start`` to ``last`` (``writer``: its TrajectoryWriter or None)."""
    wall = time.perf_counter() - wall_start
    steps = last - start
    simulated_ps = steps * o["timestep_fs"] / 1000.0
    return MDSummary(steps=steps, simulated_ps=simulated_ps, wall_s=wall,
                     ns_per_day=(simulated_ps * 1e-3) / (wall / 86400.0) if wall > 0 and steps else float("nan"),
                     temperature_K=float(atoms.get_temperature()),
                     energy_drift_meV_per_atom=progress.drift if progress is not None else 0.0,
                     trajectory=str(path) if path is not None and writer is not None and writer.frames else None,
                     n_atoms=len(atoms), first_step=start, last_step=last,
                     log=str(log_path) if log_path else None, atoms=atoms, engine=which)
