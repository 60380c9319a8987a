"""Batched FIRE relaxation of many structures: ``relax_batch`` (docs/batch.md).

Each structure has its own state of ASE's FIRE (``FireState``: one vectorised step on the model's device; with
``FireParameters(variant="torchsim")`` TorchSim's ``ase_fire`` step instead); the batch is evaluated in one model
call and refilled from the queue as structures finish. ``cell_filter`` relaxes
3-D periodic cells through ASE's ``FrechetCellFilter``. A structure that cannot be evaluated finishes "failed".
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from ase import Atoms
from ase.calculators.singlepoint import SinglePointCalculator
from torch import Tensor

from .batch import as_structure, evaluate_batch, potential_of, structures_of
from .calculator import Calculator
from .runtime.batch import BatchStep, BatchStructureError, check_finite, check_shapes
from .runtime.diagnosis import NonFiniteOutputError
from .runtime.potential import Potential

__all__ = ["FireParameters", "Relaxed", "relax_batch"]


FIRE_VARIANTS = ("ase", "torchsim")


@dataclass(frozen=True)
class FireParameters:
    """ASE's FIRE parameters (``ase.optimize.FIRE``), with its defaults and names, and the ``variant`` of its step:
    "ase", ASE's (a downhill step mixes the velocity with ``a``, then decays ``a`` and grows ``dt`` past ``Nmin``
    downhill steps), or "torchsim", TorchSim's ``ase_fire`` (the same, ``a`` decayed and ``dt`` grown before the
    mixing: positions relaxed as TorchSim's batched FIRE relaxes them; its cell filters are its own)."""

    dt: float = 0.1
    maxstep: float = 0.2
    dtmax: float = 1.0
    Nmin: int = 5
    finc: float = 1.1
    fdec: float = 0.5
    astart: float = 0.1
    fa: float = 0.99
    a: float = 0.1
    variant: str = "ase"

    def __post_init__(self) -> None:
        if self.variant not in FIRE_VARIANTS:
            raise ValueError(f"FireParameters.variant: expected one of {', '.join(FIRE_VARIANTS)}, got "
                             f"{self.variant!r}")
        for name in ("dt", "maxstep", "dtmax", "finc", "fdec", "fa"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and np.isfinite(value) and value > 0):
                raise ValueError(f"FireParameters.{name}: expected a finite number > 0, got {value!r}")


@dataclass
class Relaxed:
    """A finished structure: ``index`` in the input, ``status`` ("converged", "unconverged" or "failed" with
    ``error``), FIRE ``steps``, the final ``atoms`` (results in a single-point calculator), ``energy``, ``fmax``."""

    index: int
    status: str
    steps: int
    atoms: Atoms
    energy: float | None = None
    fmax: float | None = None
    error: str | None = None


class FireState:
    """ASE's FIRE state of B structures at once: velocities [M, 3] of their M coordinates; per structure dt, a,
    the downhill counter and whether it has stepped (float64 tensors on one device)."""

    def __init__(self, device: torch.device) -> None:
        f64 = {"dtype": torch.float64, "device": device}
        self.velocity = torch.zeros(0, 3, **f64)
        self.dt, self.a = torch.zeros(0, **f64), torch.zeros(0, **f64)
        self.downhill = torch.zeros(0, dtype=torch.int64, device=device)
        self.started = torch.zeros(0, dtype=torch.bool, device=device)

    def append(self, rows: int, fire: FireParameters) -> None:
        """A new structure of ``rows`` coordinates: FIRE's initial state."""
        self.velocity = torch.cat([self.velocity, self.velocity.new_zeros(rows, 3)])
        for name, value in (("dt", fire.dt), ("a", fire.a), ("downhill", 0), ("started", False)):
            setattr(self, name, torch.cat([getattr(self, name), getattr(self, name).new_full((1,), value)]))

    def keep(self, rows: Tensor, structures: Tensor) -> None:
        """Only the coordinates ``rows`` and the structures ``structures`` (bool masks) stay."""
        self.velocity = self.velocity[rows]
        self.dt, self.a = self.dt[structures], self.a[structures]
        self.downhill, self.started = self.downhill[structures], self.started[structures]

    def step(self, x: Tensor, forces: Tensor, segment: Tensor, fire: FireParameters) -> None:
        """ASE's ``FIRE.step`` (no downhill check; or TorchSim's order, ``fire.variant``) for every structure: ``x``
        [M, 3] moved in place."""
        count = self.dt.shape[0]

        def per(values: Tensor) -> Tensor:  # ASE's np.vdot over one structure's coordinates
            return values.new_zeros(count).index_add_(0, segment, values)

        v = self.velocity
        vf, grad2, vv = per((forces * v).sum(1)), per((forces * forces).sum(1)), per((v * v).sum(1))
        down = self.started & (vf > 0.0)
        up = self.started & ~(vf > 0.0)
        grow = down & (self.downhill > fire.Nmin)
        decayed = torch.where(grow, self.a * fire.fa, self.a)
        a = decayed if fire.variant == "torchsim" else self.a  # TorchSim mixes with alpha decayed, ASE before it decays
        scale = torch.where(down, a / grad2.clamp(min=torch.finfo(grad2.dtype).tiny).sqrt() * vv.sqrt(), 0.0)
        mixed = (1.0 - a).index_select(0, segment)[:, None] * v + scale.index_select(0, segment)[:, None] * forces
        v = torch.where(down.index_select(0, segment)[:, None], mixed, v)
        self.dt = torch.where(grow, torch.clamp(self.dt * fire.finc, max=fire.dtmax), self.dt)
        self.a = decayed
        self.downhill = torch.where(down, self.downhill + 1, self.downhill)
        v = torch.where(up.index_select(0, segment)[:, None], 0.0, v)  # uphill: stop, smaller steps, mix again
        self.a = torch.where(up, torch.full_like(self.a, fire.astart), self.a)
        self.dt = torch.where(up, self.dt * fire.fdec, self.dt)
        self.downhill = torch.where(up, 0, self.downhill)
        self.started = torch.ones_like(self.started)
        dt = self.dt.index_select(0, segment)[:, None]
        v = v + dt * forces
        dr = dt * v
        norm = per((dr * dr).sum(1)).sqrt()
        shrink = torch.where(norm > fire.maxstep, fire.maxstep / norm, 1.0)  # one maxstep on the whole step
        x += dr * shrink.index_select(0, segment)[:, None]
        self.velocity = v


@dataclass
class _Slot:
    """One structure in the batch (its FIRE state lives in a ``FireState``)."""

    index: int
    atoms: Atoms
    nsteps: int = 0  # FIRE steps taken (ASE's Optimizer.nsteps)
    species: Tensor | None = None  # the model's species input of its atoms (device path)
    optimizable: object = None  # cell path: ASE's FrechetCellFilter of the atoms, or the atoms
    state: FireState | None = None  # cell path: the structure's own FIRE state


def relax_batch(model: Potential | Calculator, structures: Iterable[Atoms], *, fmax: float = 0.05,
                steps: int = 1000, batch_size: int = 64, max_atoms: int | None = None,
                fire: FireParameters | None = None, min_distance: float | None = 0.5,
                cell_filter: bool = False) -> Iterator[Relaxed]:
    """Relax every structure of ``structures`` (read lazily) with FIRE, ``batch_size`` (and at most ``max_atoms``
    atoms) at a time; yields a ``Relaxed`` as each finishes. The inputs are not changed (module doc)."""
    if not (isinstance(fmax, int | float) and np.isfinite(fmax) and fmax > 0):
        raise ValueError(f"fmax: expected a finite number > 0 (eV/Å), got {fmax!r}")
    for name, value in (("steps", steps), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "steps" else 1):
            raise ValueError(f"{name}: expected an integer >= {0 if name == 'steps' else 1}, got {value!r}")
    if max_atoms is not None and (isinstance(max_atoms, bool) or not isinstance(max_atoms, int) or max_atoms < 1):
        raise ValueError(f"max_atoms: expected None or an integer >= 1, got {max_atoms!r}")
    fire = FireParameters() if fire is None else fire
    potential = potential_of(model)
    queue = _Queue(iter(enumerate(structures)), batch_size, max_atoms)
    return (_relax_cells(potential, queue, fmax, steps, fire, min_distance) if cell_filter else
            _relax_positions(potential.batch_step(min_distance), queue, fmax, steps, fire))


class _Queue:
    """The structures still to relax, handed out while the batch has room."""

    def __init__(self, source: Iterator[tuple[int, object]], batch_size: int, max_atoms: int | None) -> None:
        self.source, self.batch_size, self.max_atoms = source, batch_size, max_atoms
        self.waiting: tuple[int, object] | None = None  # the next structure, read but not yet admitted

    def take(self, active: list[_Slot]) -> Iterator[tuple[int, object]]:
        """(index, structure) while ``active`` has room (one over ``max_atoms`` runs alone)."""
        while len(active) < self.batch_size:
            if self.waiting is None:
                self.waiting = next(self.source, None)
            if self.waiting is None:
                return
            size = len(self.waiting[1]) if isinstance(self.waiting[1], Atoms) else 0
            if self.max_atoms is not None and active and sum(len(s.atoms) for s in active) + size > self.max_atoms:
                return
            item, self.waiting = self.waiting, None
            yield item


def _refused(index: int, atoms: object, err: BatchStructureError) -> Relaxed:
    """A structure that failed before it entered the batch."""
    return Relaxed(index, "failed", 0, atoms.copy() if isinstance(atoms, Atoms) else Atoms(), error=err.reason)


def _copy(index: int, atoms: object) -> Atoms:
    """A copy to relax, without calculator; what cannot be one raises ``BatchStructureError``."""
    structures_of([atoms])  # not an Atoms, constraints: named by the caller's index below
    copy = atoms.copy()
    copy.calc = None
    return copy


def _relax_positions(step: BatchStep, queue: _Queue, fmax: float, steps: int, fire: FireParameters
                     ) -> Iterator[Relaxed]:
    """Positions only: coordinates, forces and FIRE state on the model's device."""
    device = step.adapter.device
    active: list[_Slot] = []
    x = torch.zeros(0, 3, dtype=torch.float64, device=device)
    state = FireState(device)
    while True:
        for index, atoms in queue.take(active):
            try:
                slot = _admit(step, index, atoms)
            except BatchStructureError as err:
                yield _refused(index, atoms, err)
                continue
            active.append(slot)
            x = torch.cat([x, torch.as_tensor(slot.atoms.positions, dtype=torch.float64, device=device)])
            state.append(len(slot.atoms), fire)
        if not active:
            return
        sizes = [len(s.atoms) for s in active]
        ptr = np.concatenate([[0], np.cumsum(sizes)]).tolist()
        segment = torch.arange(len(active), device=device).repeat_interleave(torch.as_tensor(sizes, device=device))
        try:
            out = step.run(x, np.stack([np.asarray(s.atoms.cell) for s in active]),
                           [tuple(bool(p) for p in s.atoms.pbc) for s in active], ptr,
                           torch.cat([s.species for s in active]), keys=[s.index for s in active])
        except BatchStructureError as err:
            failed = [b == err.index for b in range(len(active))]
            yield from _finished(active, failed, x, None, ptr, None, None, err.reason)
            x, active = _keep(active, failed, x, state, segment)
            continue
        forces = out.forces.detach().to(torch.float64)
        largest = forces.new_zeros(len(active)).scatter_reduce(0, segment, (forces * forces).sum(1), "amax").sqrt()
        not_finite = forces.new_zeros(len(active)).index_add_(0, segment, (~forces.isfinite().all(1)).double())
        host = torch.stack([out.energy.detach().double(), largest, not_finite]).cpu().numpy()  # the step's sync
        bad = (host[2] > 0) | ~np.isfinite(host[0])
        done = bad | (host[1] < fmax) | (np.array([s.nsteps for s in active]) >= steps)
        if done.any():
            yield from _finished(active, done, x, forces, ptr, host, bad, "the model returned NaN or inf (check its "
                                 "atoms for overlaps and the model file)", fmax)
            x, active = _keep(active, done, x, state, segment)
            forces = forces[~torch.as_tensor(done, device=device).index_select(0, segment)]
            segment = torch.arange(len(active), device=device).repeat_interleave(
                torch.as_tensor([len(s.atoms) for s in active], dtype=torch.int64, device=device))
        if active:
            state.step(x, forces, segment, fire)
            for slot in active:
                slot.nsteps += 1


def _admit(step: BatchStep, index: int, atoms: object) -> _Slot:
    """A structure entering the batch, checked alone (shapes, finite values, known elements, constraints)."""
    copy = _copy(index, atoms)
    try:
        check_shapes(0, as_structure(copy))
        check_finite(np.asarray(copy.positions, dtype=np.float64), np.asarray(copy.cell)[None], [0, len(copy)])
        species = step.species(np.asarray(copy.numbers), [0, len(copy)])
    except BatchStructureError as err:
        raise BatchStructureError(index, err.reason) from None
    return _Slot(index, copy, species=species)


def _finished(active: list[_Slot], done: list | np.ndarray, x: Tensor, forces: Tensor | None, ptr: list,
              host: np.ndarray | None, bad: np.ndarray | None, reason: str, fmax: float = 0.0) -> Iterator[Relaxed]:
    """The structures ``done`` leave, with their final positions and results (``bad``: failed, ``reason``)."""
    for b, slot in enumerate(active):
        if not done[b]:
            continue
        slot.atoms.set_positions(x[ptr[b]:ptr[b + 1]].cpu().numpy())
        if forces is None or bad[b]:
            yield Relaxed(slot.index, "failed", slot.nsteps, slot.atoms, error=reason)
            continue
        energy, largest = float(host[0][b]), float(host[1][b])
        slot.atoms.calc = SinglePointCalculator(slot.atoms, energy=energy, free_energy=energy,
                                                forces=forces[ptr[b]:ptr[b + 1]].cpu().numpy())
        yield Relaxed(slot.index, "converged" if largest < fmax else "unconverged", slot.nsteps, slot.atoms,
                      energy=energy, fmax=largest)


def _keep(active: list[_Slot], leaving: list | np.ndarray, x: Tensor, state: FireState, segment: Tensor
          ) -> tuple[Tensor, list[_Slot]]:
    """The batch without the structures ``leaving``: coordinates, FIRE state and slots."""
    stay = torch.as_tensor(~np.asarray(leaving, dtype=bool), device=x.device)
    rows = stay.index_select(0, segment)
    state.keep(rows, stay)
    return x[rows], [s for s, gone in zip(active, leaving) if not gone]


def _relax_cells(potential: Potential, queue: _Queue, fmax: float, steps: int, fire: FireParameters,
                 min_distance: float | None) -> Iterator[Relaxed]:
    """With cells: each 3-D periodic structure through ASE's FrechetCellFilter, on the host."""
    from ase.filters import FrechetCellFilter

    active: list[_Slot] = []
    while True:
        for index, atoms in queue.take(active):
            try:
                copy = _copy(index, atoms)
            except BatchStructureError as err:
                yield _refused(index, atoms, err)
                continue
            slot = _Slot(index, copy, optimizable=FrechetCellFilter(copy) if copy.pbc.all() else copy,
                         state=FireState(torch.device("cpu")))
            slot.state.append(len(slot.optimizable.get_positions()), fire)
            active.append(slot)
        if not active:
            return
        try:
            outs = evaluate_batch(potential, [s.atoms for s in active], min_distance=min_distance,
                                  keys=[s.index for s in active])
        except (BatchStructureError, NonFiniteOutputError) as err:
            index = getattr(err, "index", None)
            if index is None:
                raise
            slot = active.pop(index)
            reason = getattr(err, "reason", str(err).removeprefix(f"structure {index}: "))
            yield Relaxed(slot.index, "failed", slot.nsteps, slot.atoms, error=reason)
            continue
        finished = []
        for slot, out in zip(active, outs, strict=True):
            stress = {} if out.stress is None else {"stress": out.stress}  # a cell filter reads the results here
            slot.atoms.calc = SinglePointCalculator(slot.atoms, energy=out.energy, free_energy=out.energy,
                                                    forces=out.forces, **stress)
            forces = out.forces if slot.optimizable is slot.atoms else slot.optimizable.get_forces()
            largest = float(np.sqrt((forces ** 2).sum(1).max()))
            if largest < fmax or slot.nsteps >= steps:
                finished.append(slot)
                yield Relaxed(slot.index, "converged" if largest < fmax else "unconverged", slot.nsteps,
                              slot.atoms, energy=out.energy, fmax=largest)
                continue
            x = torch.as_tensor(slot.optimizable.get_positions(), dtype=torch.float64)
            slot.state.step(x, torch.as_tensor(forces, dtype=torch.float64), torch.zeros(len(x), dtype=torch.int64),
                            fire)
            slot.optimizable.set_positions(x.numpy())
            slot.nsteps += 1
        active = [s for s in active if s not in finished]

