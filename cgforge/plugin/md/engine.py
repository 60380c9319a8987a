"""The MD engine: integrator and model step on the device, the host sees the state only between blocks.

A *block* of ``block`` steps runs without a host sync (on CUDA as replays of a graph of ``steps_per_graph``
steps), then one copy of a small report; a step not committed (``commit``) is redone after a rebuild or growth, or
raises ``MDBlowUp``. Pipelined rebuilds search the next list during the list's last ``_HIDE_STEPS`` steps; random
numbers are a function of (seed, step) (``noise``), so redone steps and restarts draw the same (docs/md.md).
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from ase import Atoms, units
from torch import Tensor

from cgforge.atomic import atomic_path

from ..runtime.capture import capture_or_fall_back
from ..runtime.compiled import compile_or_eager
from ..runtime.potential import Potential
from .commit import BLOW_KINDS, REPORT, MDBlowUp, commit_step
from .forces import EnergyFunctionForces, ForceResult, ModelForces
from .integrators import Integrator, MDState, NoiseSource, kinetic_energy
from .options import EngineOptions, check_count
from .state import ENGINE_INFO_KEY, read_state, write_atoms

__all__ = ["Engine", "MDBlowUp", "ENGINE_INFO_KEY"]

_FORMAT = 1
# Pipelined, the next list is searched from a snapshot queued this many steps before the end of the list's last block
# (enough to cover the search's host work; few, as the list ages meanwhile): one block boundary a list, each an idle
# device while the host reads the report (issue 62).
_HIDE_STEPS = 3

class Engine:
    """MD on the device (module doc). forces: a cgforge ``Calculator``, its ``Potential`` or a force provider
    (``forces.EnergyFunctionForces``'s interface); atoms: no constraints, written back every ``every`` steps;
    max_temperature_K: blow-up limit (None: 5x the target or initial temperature, at least 2000 K; inf: off);
    engine_options: an ``EngineOptions`` or its fields as keywords (``settings``)."""

    def __init__(self, forces: object, atoms: Atoms, integrator: Integrator, *, seed: int = 0,
                 max_temperature_K: float | None = None, engine_options: EngineOptions | None = None,
                 **settings: Any) -> None:
        if engine_options is not None and settings:
            raise TypeError(f"Engine: give engine_options or its fields as keywords, not both ({sorted(settings)})")
        o = EngineOptions.of(engine_options) if engine_options is not None else EngineOptions(**settings)
        o.for_one_structure("Engine")
        if not isinstance(atoms, Atoms):
            raise TypeError(f"atoms: expected an ase.Atoms, got {type(atoms).__name__}")
        if len(atoms) == 0:
            raise ValueError("atoms: expected a structure with at least one atom, got an empty Atoms")
        if atoms.constraints:
            raise ValueError(f"atoms: the engine does not apply constraints ({atoms.constraints}); remove them or run "
                             "ASE's own dynamics with the calculator")
        if not isinstance(integrator, Integrator):
            raise TypeError(f"integrator: expected a cgforge.plugin.md.integrators integrator, got "
                            f"{type(integrator).__name__}")
        potential = forces if isinstance(forces, Potential) else getattr(forces, "potential", None)
        provider = callable(getattr(forces, "compute", None))  # a provider (ModelForces has a potential too)
        self.provider = ModelForces(potential) if isinstance(potential, Potential) and not provider else forces
        if not callable(getattr(self.provider, "compute", None)):
            raise TypeError(f"forces: expected a cgforge Calculator or a force provider, got {type(forces).__name__}")
        self.atoms, self.integrator = atoms, integrator
        self.seed = check_count("seed", seed, 0)
        self.block = o.block if o.block is not None else 10
        self.steps_per_graph, self.rebuild_margin = o.steps_per_graph, o.rebuild_margin
        self.pbc = tuple(bool(p) for p in atoms.pbc)
        if integrator.changes_cell and not all(self.pbc):
            raise ValueError(f"integrator: {integrator.name} changes the cell, which needs pbc on all axes; atoms.pbc "
                             f"is {self.pbc}")
        self.device = torch.device(self.provider.device)
        self.cuda_graph = self._want_graph(o.cuda_graph)
        self.pipelined_rebuild = self._want_pipelined(o.pipelined_rebuild)
        self._defaults = (o.cuda_graph is None, o.pipelined_rebuild is None)  # what the memory plan may turn off
        self.fuse_integrator = self._want_fused(o.fuse_integrator)
        options = getattr(self.provider, "options", None)
        backend = "inductor" if options is None else options.compile_backend
        fused = lambda fn: compile_or_eager(fn, backend)
        integrator.fuse(fused if self.fuse_integrator else None)
        self._commit = fused(commit_step) if self.fuse_integrator else commit_step
        self.capture_error: str | None = None
        n = len(atoms)
        f64 = {"dtype": torch.float64, "device": self.device}
        masses = torch.as_tensor(atoms.get_masses(), **f64).reshape(n, 1)
        integrator.bind(masses)
        extra = integrator.initial_extra(self.device)
        # One flat buffer holds what a step changes (the fields are views): save, restore, snapshot are one copy each
        shapes = {"positions": (n, 3), "momenta": (n, 3), "forces": (n, 3), "energy": (), "virial": (3, 3),
                  "cell": (3, 3), **{f"extra.{k}": () for k in extra}}
        self._flat = torch.zeros(sum(math.prod(v) for v in shapes.values()), **f64)
        views = dict(zip(shapes, (part.view(shape) for part, shape in zip(
            self._flat.split([math.prod(v) for v in shapes.values()]), shapes.values(), strict=True)), strict=True))
        self.state = MDState(**{k: v for k, v in views.items() if not k.startswith("extra.")}, masses=masses,
                             step=torch.zeros((), dtype=torch.int64, device=self.device),
                             extra={k: views[f"extra.{k}"] for k in extra})
        with torch.no_grad():
            for name, value in (("positions", atoms.get_positions()), ("momenta", atoms.get_momenta()),
                                ("cell", np.array(atoms.cell))):
                getattr(self.state, name).copy_(torch.as_tensor(value, **f64))
            for k, v in extra.items():
                self.state.extra[k].copy_(v)
        self.noise = NoiseSource(self.seed, self.state.step)
        reference = integrator.temperature_K if integrator.temperature_K is not None else atoms.get_temperature()
        self.max_temperature_K = (max(2000.0, 5.0 * float(reference)) if max_temperature_K is None
                                  else float(max_temperature_K))
        if not self.max_temperature_K > 0:
            raise ValueError(f"max_temperature_K: expected a number > 0, got {max_temperature_K!r}")
        self._step = 0  # host mirror of state.step
        self._forces_known = self._started = False
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._graph_generation: int | None = None
        self._pool = None
        # the block's report, one float64 per name of REPORT (flags 0/1, counts exact): one copy to the host
        self._report_values = torch.zeros(len(REPORT), dtype=torch.float64, device=self.device)
        self._report_start = torch.tensor([float("nan") if name == "slack" else 0.0 for name in REPORT],
                                          dtype=torch.float64, device=self.device)
        self._host_report = torch.zeros(len(REPORT), dtype=torch.float64, pin_memory=self.device.type == "cuda")
        self._host_snapshot: Tensor | None = None
        self._snapshot_step: int | None = None
        self._slack_per_step = 0.0  # the largest slack used per step, seen so far (for early rebuilds)
        self._last_slack: float | None = None  # the list's slack (Å) when last known ...
        self._unseen = 0  # ... and the committed steps since, which used some of it
        self._fresh_list = True
        self._search_next = False  # this block searches the next list (pipelined rebuild; set by _plan_block)
        self._search_after = 0  # ... from the state after this many of its steps
        self.stats = {"steps": 0, "blocks": 0, "discarded": 0, "rebuilds": 0, "overlapped_rebuilds": 0, "captures": 0,
                      "grows": 0, "wall_s": 0.0}
        self._follow_memory_plan()  # run_md has planned this box already: the header says what will run

    @property
    def step(self) -> int:
        """Steps committed since the start (continued across a restart)."""
        return self._step

    def run(self, steps: int, every: int = 0, callback: Callable[[Engine], None] | None = None) -> None:
        """Advance ``steps`` steps; every ``every`` steps write ``atoms`` and call ``callback(self)``."""
        steps, every = check_count("steps", steps, 0), check_count("every", every, 0)
        start = time.perf_counter()
        self._start()
        target = self._step + steps
        stuck = 0
        while self._step < target:
            size = min(self.block, target - self._step)
            if every:
                size = min(size, every - self._step % every)
            size = self._plan_block(size)
            observe = bool(every) and (self._step + size) % every == 0
            committed = self._run_block(size, observe)
            stuck = 0 if committed else stuck + 1
            if stuck > 3:
                raise RuntimeError(f"the engine made no progress at step {self._step + 1} in {stuck} blocks (edge "
                                   f"buffers kept overflowing); stats {self.stats}")
            if observe and committed == size:
                self._write_atoms()
                if callback is not None:
                    callback(self)
        if not every or self._step % every:
            self._snapshot_step = None
        self.stats["wall_s"] += time.perf_counter() - start

    def sync_atoms(self) -> Atoms:
        """Write the current state into ``atoms`` (one device-to-host copy) and return it."""
        self._start()
        if self._snapshot_step != self._step:
            self._take_snapshot()
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
        self._write_atoms()
        return self.atoms

    def temperature(self) -> float:
        """Kinetic temperature in K (3N degrees of freedom, as ASE's ``get_temperature``); syncs."""
        return float(kinetic_energy(self.state)) / (1.5 * len(self.atoms) * units.kB)

    def conserved_energy(self) -> float:
        """The integrator's conserved quantity in eV (``Integrator.conserved``); syncs."""
        self._start()
        return float(self.integrator.conserved(self.state))

    def state_dict(self) -> dict:
        """Everything a restart needs (host arrays and plain values): equal continuation after ``load_state``."""
        self._start()
        s = self.state
        return {"format": _FORMAT, "step": self._step, "seed": self.seed, "integrator": self.integrator.name,
                "params": self.integrator.params(), "numbers": self.atoms.numbers.copy(),
                "positions": s.positions.cpu().numpy(), "momenta": s.momenta.cpu().numpy(),
                "forces": s.forces.cpu().numpy(), "energy": float(s.energy), "virial": s.virial.cpu().numpy(),
                "cell": s.cell.cpu().numpy(), "extra": {k: float(v) for k, v in s.extra.items()}}

    def save(self, path: str | os.PathLike) -> Path:
        """``state_dict`` as a .npz file (written to a temporary name, then renamed: never half a file)."""
        path = Path(path)
        if path.suffix != ".npz":
            raise ValueError(f"path: expected a .npz file name, got {path}")
        d = self.state_dict()
        meta = {k: d[k] for k in ("format", "step", "seed", "integrator", "params", "energy", "extra")}
        with atomic_path(path, suffix=".npz") as tmp:
            np.savez(tmp, meta=np.array(json.dumps(meta)), **{k: d[k] for k in ("numbers", "positions", "momenta",
                                                                                 "forces", "virial", "cell")})
        return path

    def load_state(self, source: dict | str | os.PathLike | Atoms) -> None:
        """Continue from a ``state_dict``, a .npz written by ``save``, or an Atoms written by this engine."""
        d = read_state(source, self.integrator.needs_virial)
        n = len(self.atoms)
        if np.asarray(d["positions"]).shape != (n, 3):
            raise ValueError(f"restart: {np.asarray(d['positions']).shape[0]} atoms, the engine has {n}")
        if "numbers" in d and not np.array_equal(np.asarray(d["numbers"]), self.atoms.numbers):
            raise ValueError("restart: the atomic numbers differ from the engine's atoms")
        if d.get("integrator") not in (None, self.integrator.name):
            raise ValueError(f"restart: written by integrator {d['integrator']!r}, this engine runs "
                             f"{self.integrator.name!r}")
        if d.get("params") is not None and d["params"] != self.integrator.params():
            warnings.warn(f"restart: integrator settings changed from {d['params']} to {self.integrator.params()}",
                          RuntimeWarning, stacklevel=2)
        s = self.state
        with torch.no_grad():
            for name in ("positions", "momenta", "cell"):
                getattr(s, name).copy_(torch.as_tensor(np.asarray(d[name]), dtype=torch.float64))
            self._forces_known = d.get("forces") is not None
            if self._forces_known:
                s.forces.copy_(torch.as_tensor(np.asarray(d["forces"]), dtype=torch.float64))
                s.energy.fill_(float(d["energy"]))
                if d.get("virial") is not None:
                    s.virial.copy_(torch.as_tensor(np.asarray(d["virial"]), dtype=torch.float64))
            for k, v in (d.get("extra") or {}).items():
                if k in s.extra:
                    s.extra[k].fill_(float(v))
            step = int(d.get("step", 0))
            s.step.fill_(step)
        self._step = step
        if d.get("seed") is not None and int(d["seed"]) != self.seed:
            warnings.warn(f"restart: seed {d['seed']} replaces the engine's seed {self.seed}", RuntimeWarning,
                          stacklevel=2)
            self.seed = self.noise.seed = int(d["seed"])
        self._started = False  # the list is rebuilt at the restored positions
        self._snapshot_step = None

    def _want_graph(self, cuda_graph: bool | None) -> bool:
        capturable = self.device.type == "cuda" and getattr(self.provider, "capturable", True)
        if cuda_graph is None:
            return capturable
        if cuda_graph and not capturable:
            raise ValueError(f"cuda_graph=True needs a CUDA device and a capturable model step (device "
                             f"{self.device}; a calculator with cuda_graph on)")
        return bool(cuda_graph)

    def _want_fused(self, fuse: bool | None) -> bool:
        # default: with the model compiled, Inductor is known to work here (its compilation is paid at the first step)
        compiled = self.device.type == "cuda" and bool(getattr(self.provider, "compiled", False))
        return bool(fuse) if fuse is not None else compiled

    def _want_pipelined(self, pipelined: bool | None) -> bool:
        able = callable(getattr(self.provider, "snapshot", None))
        if pipelined is None:
            return able and self.device.type == "cuda"  # on a CPU the search cannot overlap the steps
        if pipelined and not able:
            raise ValueError(f"pipelined_rebuild=True needs a provider with snapshot/search/install (a cgforge "
                             f"Calculator); {type(self.provider).__name__} has none")
        return pipelined

    def _follow_memory_plan(self) -> None:
        """A box near a full device: no CUDA graph and no side-stream search unless asked for (memory it lacks)."""
        near_full = getattr(self.provider, "near_full_device", None)
        if not callable(near_full) or not near_full(len(self.atoms)):
            return
        self.cuda_graph = self.cuda_graph and not self._defaults[0]
        self.pipelined_rebuild = self.pipelined_rebuild and not self._defaults[1]
        if not self.cuda_graph:
            self._graphs.clear()

    def _start(self) -> None:
        if self._started:
            return
        s = self.state
        self.provider.start(s.positions, s.cell, self.pbc, self.atoms.numbers, self.integrator.changes_cell)
        self._follow_memory_plan()
        self._slack_per_step = 0.0
        self._fresh()
        if not self._forces_known:
            for _ in range(4):
                result = self.provider.compute(s.positions, s.cell, virial=self.integrator.needs_virial)
                if not bool(result.overflow):
                    break
                self.provider.grow(int(result.count))
            self._store(result)
            if not (math.isfinite(float(s.energy)) and bool(torch.isfinite(s.forces).all())):
                raise MDBlowUp(self._step, "energy", float(s.energy), " (or non-finite forces) at the start")
            self._forces_known = True
        self._started = True

    def _store(self, result: ForceResult) -> None:
        s = self.state
        s.forces.copy_(result.forces)
        s.energy.copy_(result.energy)
        if result.virial is not None:
            s.virial.copy_(result.virial)

    def _steps(self, count: int) -> None:
        """``count`` steps, capture-safe (no host reads)."""
        s, integrator = self.state, self.integrator
        for _ in range(count):
            saved = self._flat.clone()
            integrator.before_forces(s, self.noise)
            result = self.provider.compute(s.positions, s.cell, virial=integrator.needs_virial)
            self._store(result)
            integrator.after_forces(s, self.noise)
            bad, step, report = self._commit(s.energy, s.forces, s.momenta, s.masses, s.step, result.stale,
                                             result.overflow, result.count, result.slack, self.max_temperature_K,
                                             self._report_values)
            self._flat.copy_(torch.where(bad, saved, self._flat))
            s.step.copy_(step)
            self._report_values.copy_(report)

    def _run_block(self, size: int, observe: bool) -> int:
        self._report_values.copy_(self._report_start)
        # pipelined: in the list's last block the next list is searched from its start state while it runs
        first = self._search_after if self._search_next else size
        self._advance(first)
        pending = self.provider.snapshot(self.state.positions, self.state.cell) if self._search_next else None
        self._advance(size - first)
        ahead = False
        if pending is not None:
            self.provider.search(pending)
            # queued behind the block before its report is read: the install's host work runs while the block does,
            # not with the device idle; only a list that keeps its buffers (no captured graph dropped mid-block)
            ahead = self.provider.can_install_ahead(pending)
            if ahead:
                self.provider.install(pending)
        if observe:
            self._take_snapshot()
        host = self._read_report()
        committed = int(host["committed"])
        self._step += committed
        for key, count in (("blocks", 1), ("steps", committed), ("discarded", size - committed)):
            self.stats[key] += count
        if observe and committed == size:
            self._snapshot_step = self._step
        if host["blow_kind"]:
            kind = BLOW_KINDS[int(host["blow_kind"])]
            detail = (f" K, above max_temperature_K={self.max_temperature_K:g}" if kind == "temperature"
                      else " (not finite)")
            raise MDBlowUp(int(host["blow_step"]), kind, host["blow_value"], detail)
        if committed and math.isfinite(host["slack"]):
            if self._last_slack is not None:  # the fastest use of slack per step, slowly forgetting old highs
                used = (self._last_slack - host["slack"]) / (committed + self._unseen)
                self._slack_per_step = max(used, 0.95 * self._slack_per_step)
            self._last_slack, self._unseen = host["slack"], 0
        if host["overflow"]:
            self.provider.grow(int(host["count_max"]))
            self.stats["grows"] += 1
        if host["stale"] and committed == 0 and self._fresh_list:
            raise MDBlowUp(self._step + 1, "displacement", float("nan"),
                           " (atoms moved or the cell deformed beyond the neighbour list's skin within one "
                           "step: a blow-up, a timestep or barostat rate far too large, or a skin too small)")
        if pending is not None:
            self._install(pending, max(0, committed - first), done=ahead)
            return committed  # a stale step of this block is redone with the new list
        if host["stale"]:
            self._rebuild()
        elif committed:
            self._fresh_list = False
        return committed

    def _plan_block(self, size: int) -> int:
        """The block's length: what the list's slack should last; pipelined, the next list is searched during the
        last ``_HIDE_STEPS`` steps of the list's last block, from a snapshot queued between its steps."""
        self._search_next, self._search_after = False, 0
        if getattr(self.provider, "foreign_rebuild", False):
            self._rebuild()
        rate = self.rebuild_margin * self._slack_per_step
        slack = None if self._last_slack is None else self._last_slack - self._unseen * self._slack_per_step
        if slack is None or not rate > 0:
            return size
        safe = math.floor(slack / rate)
        if safe < 1:
            self._rebuild()
            safe = math.floor(self._last_slack / rate) if self._last_slack is not None else size
        if self.pipelined_rebuild and safe >= 1:
            hide = min(safe, _HIDE_STEPS)
            if safe - hide >= size:  # the list outlives this block by its hiding steps
                return size
            length = min(size, safe)
            self._search_next, self._search_after = True, max(0, length - hide)
            return length
        return max(1, min(size, safe))

    def _install(self, pending, committed: int, done: bool = False) -> None:
        """Take the list searched during this block (``done``: already queued behind the block); its slack is what
        is left after the steps committed since its snapshot."""
        if not done:
            self.provider.install(pending)
        self.stats["overlapped_rebuilds"] += 1
        self._fresh(committed)

    def _rebuild(self) -> None:
        self.provider.rebuild(self.state.positions, self.state.cell)
        self._fresh()

    def _fresh(self, committed: int = 0) -> None:
        """A new list: its slack is a fresh list's less what the ``committed`` steps since its state used."""
        self.stats["rebuilds"] += 1
        self._fresh_list = committed == 0  # then the list is at the current state
        initial = getattr(self.provider, "initial_slack", None)
        self._last_slack = None if initial is None or not math.isfinite(initial) else initial
        self._unseen = committed

    def _read_report(self) -> dict[str, float]:
        self._host_report.copy_(self._report_values, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the one sync of the block
        return dict(zip(REPORT, self._host_report.tolist(), strict=True))

    def _advance(self, count: int) -> None:
        """Queue ``count`` steps (graph replays on CUDA)."""
        if count == 0:
            return
        if self.cuda_graph:
            self._replay(count)
        else:
            with torch.no_grad():
                self._steps(count)

    def _replay(self, size: int) -> None:
        generation = getattr(self.provider, "generation", 0)
        if generation != self._graph_generation:
            self.invalidate()
            self._graph_generation = generation
        k = self.steps_per_graph
        for count, times in ((k, size // k), (1, size % k)):
            if times == 0:
                continue
            graph = self._graphs.get(count) or self._capture(count)
            if graph is None:  # capture failed: eager from now on
                with torch.no_grad():
                    self._steps(count * times)
                continue
            for _ in range(times):
                graph.replay()

    def invalidate(self) -> None:
        """Drop the captured graphs (the next block captures again)."""
        self._graphs.clear()
        self._pool = None

    def _capture(self, count: int) -> torch.cuda.CUDAGraph | None:
        """A graph of ``count`` steps (None when the capture failed: eager from now on); the state is as before."""
        saved = [(t, t.clone()) for t in (self._flat, self.state.step, self._report_values)]

        def restore() -> None:
            for live, copy in saved:
                live.copy_(copy)

        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.no_grad():
            entry = capture_or_fall_back(self, lambda: self._steps(count), self._pool, "the engine's steps",
                                         warmups=1, restore=restore)
        if entry is None:
            return None
        self._graphs[count] = entry[0]
        self.stats["captures"] += 1
        return entry[0]

    def _take_snapshot(self) -> None:
        """Queue a copy of the state into a pinned host buffer (read after the block's sync)."""
        if self._host_snapshot is None:
            self._host_snapshot = torch.zeros(self._flat.numel(), dtype=torch.float64,
                                              pin_memory=self.device.type == "cuda")
        self._host_snapshot.copy_(self._flat, non_blocking=True)
        self._snapshot_step = self._step

    def _write_atoms(self) -> None:
        info = {"step": self._step, "seed": self.seed, "integrator": self.integrator.name}
        write_atoms(self.atoms, self._host_snapshot.numpy(), list(self.state.extra), info, self.integrator.needs_virial)


def energy_function_engine(energy_fn: Callable[[Tensor, Tensor], Tensor], atoms: Atoms, integrator: Integrator,
                           **kwargs) -> Engine:
    """An engine over ``energy_fn(positions, cell) -> energy`` (``device=``, ``options=``; the rest the Engine's)."""
    device = kwargs.pop("device", "cpu")
    options = kwargs.pop("options", None)
    return Engine(EnergyFunctionForces(energy_fn, device=device, options=options), atoms, integrator, **kwargs)
