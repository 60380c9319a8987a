"""Where a LAMMPS step's time goes inside cgforge's ML-IAP calls: per-phase times, and their table in LAMMPS's
screen and log output (docs/lammps.md, "Timers", says what each phase times and how the input prints the table).

On from the model file (``CgforgeMLIAP.timers``) or the input (``switch``); off, every phase is ``OFF``'s shared
no-op. On CUDA the ``DEVICE_PHASES`` are timed by CUDA events read once complete, the others by the host clock.
"""

from __future__ import annotations

import atexit
import sys
import weakref
from contextlib import nullcontext
from time import perf_counter
from typing import Any

import torch

from .ranks import launcher_rank, launcher_ranks

__all__ = ["DEVICE_PHASES", "OFF", "PHASES", "PhaseTimers", "report", "switch", "tables"]

# name -> (row label, depth in the table); on CUDA the phases of DEVICE_PHASES are timed by events
PHASES = {
    "arrays": ("LAMMPS's arrays to torch", 0),
    "owners": ("ghost owners (one rank)", 0),
    "model": ("model: energies and forces", 0),
    "exchange forward": ("forward exchanges", 1),
    "exchange reverse": ("reverse exchanges", 1),
    "forces": ("results back to LAMMPS", 0),
    "waits": ("host waits for the device", 0),
}
DEVICE_PHASES = frozenset({"model", "exchange forward", "exchange reverse"})
FOLD_AT = 64  # pending CUDA event pairs that make a call fold the completed ones into the totals

_NOOP = nullcontext()
_LIVE: weakref.WeakSet = weakref.WeakSet()  # this process's CgforgeMLIAP objects (``register``)
_EXIT_HOOKED = False


class _Off:
    """Timers switched off: every phase is one shared no-op context."""

    enabled = False

    def phase(self, name: str = "") -> nullcontext:
        return _NOOP

    wait = call = phase


OFF = _Off()


class _Phase:
    __slots__ = ("clock", "name", "events", "start")

    def __init__(self, clock: PhaseTimers, name: str, events: bool) -> None:
        self.clock, self.name, self.events = clock, name, events

    def __enter__(self) -> None:
        if self.events:
            self.start = self.clock._event()
            self.start.record()
        else:
            self.start = perf_counter()

    def __exit__(self, *exc: object) -> None:
        c = self.clock
        c.counts[self.name] += 1
        if self.events:
            end = c._event()
            end.record()
            c._pending.append((self.name, self.start, end))
        else:
            c.seconds[self.name] += perf_counter() - self.start


class _Call:
    __slots__ = ("clock", "start")

    def __init__(self, clock: PhaseTimers) -> None:
        self.clock = clock

    def __enter__(self) -> None:
        c = self.clock
        self.start = perf_counter()
        if c._last_end is not None:
            c.between += self.start - c._last_end
        if len(c._pending) >= FOLD_AT:
            c.fold(wait=False)

    def __exit__(self, *exc: object) -> None:
        c = self.clock
        c._last_end = perf_counter()
        c.call_seconds += c._last_end - self.start
        c.calls += 1


class PhaseTimers:
    """Per-phase times of one CgforgeMLIAP's calls on ``device`` (CUDA events there, else the host clock; see the
    module doc). ``phase(name)`` (a name of ``PHASES``), ``wait()`` and ``call()`` are context managers."""

    enabled = True

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.events = self.device.type == "cuda"
        self._pool: list = []
        self.reset()

    def reset(self) -> None:
        """Every total to zero (the events still pending are dropped)."""
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.counts = dict.fromkeys(PHASES, 0)
        self.calls, self.call_seconds, self.between = 0, 0.0, 0.0
        self._pending: list = []
        self._last_end: float | None = None

    def phase(self, name: str) -> _Phase:
        return _Phase(self, name, self.events and name in DEVICE_PHASES)

    def wait(self) -> _Phase:
        return _Phase(self, "waits", False)

    def call(self) -> _Call:
        return _Call(self)

    def _event(self) -> Any:
        return self._pool.pop() if self._pool else torch.cuda.Event(enable_timing=True)

    def fold(self, wait: bool = True) -> None:
        """Add the pending CUDA events' times to the totals: all of them after one synchronisation (``wait``),
        else those complete (recorded in stream order: the first incomplete one ends the fold)."""
        if wait and self._pending:
            torch.cuda.synchronize(self.device)
        done = 0
        for name, start, end in self._pending:
            if not wait and not end.query():
                break
            self.seconds[name] += start.elapsed_time(end) / 1e3
            self._pool += [start, end]
            done += 1
        del self._pending[:done]

    def table(self, rank: int, size: int) -> list[str]:
        """The table's lines, headed by ``rank`` of ``size`` (its events read: one synchronisation)."""
        self.fold()
        clock = (f"{self.device}, model and exchanges by CUDA events, the rest host clock" if self.events
                 else f"{self.device}, host clock")
        lines = [f"cgforge ML-IAP timers, rank {rank} of {size} ({clock}): {self.calls} calls, "
                 f"{self.call_seconds:.3f} s in them, {self.between:.3f} s in LAMMPS between them",
                 f"  {'phase':<32} {'count':>8} {'total s':>10} {'ms/call':>10} {'% of calls':>10}"]
        calls = max(self.calls, 1)
        for name, (label, depth) in PHASES.items():
            if self.counts[name] == 0:
                continue
            s = self.seconds[name]
            share = 100 * s / self.call_seconds if self.call_seconds else 0.0
            lines.append(f"  {'  ' * depth + label:<32} {self.counts[name]:>8} {s:>10.3f} {1e3 * s / calls:>10.3f} "
                         f"{share:>10.1f}")
        return lines


def register(obj: Any) -> None:
    """Keep ``obj`` (a CgforgeMLIAP) findable by ``report`` and ``switch`` while it lives."""
    _LIVE.add(obj)


def hook_exit() -> None:
    """Write unreported tables to standard error when the interpreter exits (once per process)."""
    global _EXIT_HOOKED
    if not _EXIT_HOOKED:
        atexit.register(_at_exit)
        _EXIT_HOOKED = True


def _timed() -> list[Any]:
    return [o for o in list(_LIVE) if getattr(o, "_timers", OFF).enabled]


def tables(rank: int, size: int, reset: bool = True) -> list[str]:
    """The lines of this process's tables (every timed CgforgeMLIAP with calls), restarted from zero if ``reset``."""
    lines = []
    for obj in _timed():
        if obj._timers.calls:
            lines += obj._timers.table(rank, size)
            if reset:
                obj._timers.reset()
    return lines


def switch(on: bool) -> int:
    """Timers on or off for this process's CgforgeMLIAP objects (from the LAMMPS input, through its ``python``
    command); the number of objects switched."""
    if not isinstance(on, bool):
        raise TypeError(f"on: expected True or False, got {on!r}")
    objs = list(_LIVE)
    for obj in objs:
        obj.set_timers(on)
    return len(objs)


def report(lmp: Any, reset: bool = True) -> None:
    """Print every rank's tables into LAMMPS's screen and log (see the module doc). lmp: the running LAMMPS, as
    LAMMPS's ``python`` command passes ``SELF`` (a capsule), or a ``lammps.lammps`` object. Every rank calls it."""
    if not hasattr(lmp, "command"):  # the capsule: wrap the running instance (nothing is created or closed)
        import lammps

        lmp = lammps.lammps(ptr=lmp)
    rank, size = lmp.extract_setting("world_rank"), lmp.extract_setting("world_size")
    lines = tables(rank, size, reset)
    if size > 1 and _has_mpi4py():
        gathered = lmp.get_mpi_comm().gather(lines, root=0)  # rank order; None on the other ranks
        lines = [line for part in gathered or [] for line in part]
    elif size > 1:
        if rank:
            print("\n".join(lines), file=sys.stderr, flush=True)
        else:
            lines.append(f"cgforge ML-IAP timers: ranks 1 to {size - 1} wrote theirs to their standard error "
                         "(with mpi4py importable they are gathered here)")
    if not lines:
        lines = ["cgforge ML-IAP timers: no timed calls (timers off: `cgforge lammps-model --timers`)"]
    text = "\n".join(lines).replace('"', "'").replace("$", "S")  # nothing LAMMPS's print would parse
    # through a string variable: the input echoes `print "${...}"` alone, not the table twice
    lmp.command('variable cgforge_timers_table string ""')
    set_string = getattr(lmp, "set_string_variable", None) or lmp.set_variable  # the latter before 7 Feb 2024
    set_string("cgforge_timers_table", text)
    lmp.command('print "${cgforge_timers_table}"')


def _has_mpi4py() -> bool:
    """Whether mpi4py imports (LAMMPS's ``get_mpi_comm`` needs it)."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return True


def _at_exit() -> None:
    try:
        lines = tables(launcher_rank(), launcher_ranks())
    except Exception as err:  # noqa: BLE001 - an exit hook must not raise (CUDA may be gone already)
        lines = [f"cgforge ML-IAP timers: not read at exit ({type(err).__name__}: {err})"] if _timed() else []
    if lines:
        print("\n".join(["cgforge ML-IAP timers (never reported into LAMMPS's log):"] + lines), file=sys.stderr,
              flush=True)
