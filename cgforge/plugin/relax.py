"""Batched FIRE relaxation of many structures: ``relax_batch``.

    from cgforge.plugin import Calculator, relax_batch
    for done in relax_batch(Calculator("mace"), structures, fmax=0.05, batch_size=64):
        done.index, done.status, done.energy, done.atoms          # as each structure finishes

Each structure relaxes its positions with its own FIRE state, ASE's ``ase.optimize.FIRE`` (its parameters,
``FireParameters``, and its arithmetic: the velocity mixing, the time step and the mixing factor that grow
after ``Nmin`` downhill steps, the reset on an uphill step, one ``maxstep`` on the norm of the whole step) and
ASE's ``Optimizer.irun`` loop: forces, then stop when the largest atomic force is below ``fmax`` (strictly) or
``steps`` steps were taken, else one FIRE step. All structures of the batch are evaluated in one model call
(``plugin.batch``); a structure that has finished leaves the batch and the next from the queue takes its place,
so the batch stays full (``batch_size`` structures, at most ``max_atoms`` atoms). With ``cell_filter`` a
structure periodic in all three directions relaxes its cell too, through ASE's own ``FrechetCellFilter`` on it
(positions and the log of the cell's deformation as FIRE's coordinates; its generalised forces from the
batch's forces and stress; the cell rows count in ``fmax``), as ``FIRE(FrechetCellFilter(atoms))`` would; other
structures relax their positions only. A structure that cannot be
evaluated (``BatchStructureError``: unknown element, NaN, overlapping atoms, no atoms; or NaN or inf from the
model) finishes with status ``"failed"`` and its reason; the others go on.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
from ase import Atoms
from ase.calculators.singlepoint import SinglePointCalculator
from ase.stress import full_3x3_to_voigt_6_stress

from .batch import potential_of, structures_of
from .calculator import Calculator
from .runtime.batch import BatchStructureError
from .runtime.diagnosis import NonFiniteOutputError
from .runtime.potential import Potential

__all__ = ["FireParameters", "Relaxed", "relax_batch"]


@dataclass(frozen=True)
class FireParameters:
    """ASE's FIRE parameters, with its defaults (``ase.optimize.FIRE``): initial and largest time step (ASE
    time units), the largest step (Å, on the norm of the whole structure's step), steps before the time step
    grows, its growth and cut factors, the mixing coefficient at a reset (``astart``) and at the start (``a``),
    and its decay."""

    dt: float = 0.1
    maxstep: float = 0.2
    dtmax: float = 1.0
    Nmin: int = 5
    finc: float = 1.1
    fdec: float = 0.5
    astart: float = 0.1
    fa: float = 0.99
    a: float = 0.1

    def __post_init__(self) -> None:
        for name in ("dt", "maxstep", "dtmax", "finc", "fdec", "fa"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and np.isfinite(value) and value > 0):
                raise ValueError(f"FireParameters.{name}: expected a finite number > 0, got {value!r}")


@dataclass
class Relaxed:
    """A finished structure: ``index`` in the input, ``status`` ("converged", "unconverged": ``steps``
    reached, or "failed" with ``error``), the FIRE steps taken, and the final ``atoms`` (a copy of the
    input with the relaxed positions and a single-point calculator holding energy, forces and, for a 3-D cell,
    stress) with ``energy`` (eV) and ``fmax`` (eV/Å, the largest atomic force). A failed structure keeps the
    positions it had when it failed, without results."""

    index: int
    status: str
    steps: int
    atoms: Atoms
    energy: float | None = None
    fmax: float | None = None
    error: str | None = None


@dataclass
class _Slot:
    """One structure in the batch with its FIRE state (ASE's names)."""

    index: int
    atoms: Atoms
    dt: float
    a: float
    optimizable: object = None  # what FIRE moves: the atoms, or ASE's FrechetCellFilter of them
    nsteps: int = 0  # FIRE steps taken (ASE's Optimizer.nsteps)
    downhill: int = 0  # ASE's FIRE.Nsteps: downhill steps since the last reset
    velocity: np.ndarray | None = None
    results: dict = field(default_factory=dict)


def relax_batch(model: Potential | Calculator, structures: Iterable[Atoms], *, fmax: float = 0.05,
                steps: int = 1000, batch_size: int = 64, max_atoms: int | None = None,
                fire: FireParameters | None = None, min_distance: float | None = 0.5,
                cell_filter: bool = False) -> Iterator[Relaxed]:
    """Relax the positions of every structure of ``structures`` (any iterable: read lazily, as the batch has
    room) with FIRE, ``batch_size`` structures (and at most ``max_atoms`` atoms, beyond a single structure)
    at a time; yields a ``Relaxed`` as each structure finishes (module doc), not in input order. The inputs
    are not changed. ``min_distance``: as ``evaluate_batch``'s. ``cell_filter``: relax the cells of the 3-D
    periodic structures too (module doc)."""
    if not (isinstance(fmax, int | float) and np.isfinite(fmax) and fmax > 0):
        raise ValueError(f"fmax: expected a finite number > 0 (eV/Å), got {fmax!r}")
    for name, value in (("steps", steps), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "steps" else 1):
            raise ValueError(f"{name}: expected an integer >= {0 if name == 'steps' else 1}, got {value!r}")
    if max_atoms is not None and (isinstance(max_atoms, bool) or not isinstance(max_atoms, int) or max_atoms < 1):
        raise ValueError(f"max_atoms: expected None or an integer >= 1, got {max_atoms!r}")
    fire = FireParameters() if fire is None else fire
    potential = potential_of(model)
    queue = iter(enumerate(structures))
    waiting: deque[tuple[int, Atoms]] = deque()
    active: list[_Slot] = []
    while True:
        _fill(active, queue, waiting, fire, batch_size, max_atoms, cell_filter)
        if not active:
            return
        try:  # structures_of inside: a non-Atoms or constrained input fails with its index too
            outs = potential.evaluate_batch(structures_of([s.atoms for s in active]), stress=cell_filter,
                                            min_distance=min_distance, keys=[s.index for s in active])
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
            _attach(slot.atoms, out)
            forces = out.forces if slot.optimizable is slot.atoms else slot.optimizable.get_forces()
            largest = float(np.sqrt((forces ** 2).sum(1).max()))
            if largest < fmax or slot.nsteps >= steps:
                finished.append(slot)
                yield Relaxed(slot.index, "converged" if largest < fmax else "unconverged", slot.nsteps,
                              slot.atoms, energy=out.energy, fmax=largest)
            else:
                _fire_step(slot, forces, fire)
        active = [s for s in active if s not in finished]


def _fill(active: list[_Slot], queue: Iterator[tuple[int, Atoms]], waiting: deque, fire: FireParameters,
          batch_size: int, max_atoms: int | None, cell_filter: bool) -> None:
    """Take structures from the queue while the batch has room (a structure over ``max_atoms`` alone runs
    alone)."""
    atoms_in = sum(len(s.atoms) for s in active)
    while len(active) < batch_size:
        if not waiting:
            nxt = next(queue, None)
            if nxt is None:
                return
            waiting.append(nxt)
        index, atoms = waiting[0]
        size = len(atoms) if isinstance(atoms, Atoms) else 0
        if max_atoms is not None and active and atoms_in + size > max_atoms:
            return
        waiting.popleft()
        copy = atoms.copy() if isinstance(atoms, Atoms) else atoms  # evaluate_batch names a non-Atoms
        if isinstance(copy, Atoms):
            copy.calc = None
        slot = _Slot(index, copy, fire.dt, fire.a, copy)
        if cell_filter and isinstance(copy, Atoms) and copy.pbc.all() and not copy.constraints:
            from ase.filters import FrechetCellFilter

            slot.optimizable = FrechetCellFilter(copy)
        active.append(slot)
        atoms_in += size


def _attach(atoms: Atoms, out: object) -> None:
    """The batch's results for the atoms as they are, as their calculator (a cell filter reads them there)."""
    results = {"energy": out.energy, "free_energy": out.energy, "forces": out.forces}
    volume = abs(float(atoms.cell.volume))
    if out.virial is not None and volume > 0:
        results["stress"] = full_3x3_to_voigt_6_stress(out.virial / volume)
    atoms.calc = SinglePointCalculator(atoms, **results)


def _fire_step(slot: _Slot, forces: np.ndarray, fire: FireParameters) -> None:
    """One step of ASE's FIRE (``ase.optimize.FIRE.step``, without its downhill check) on this structure's
    coordinates (``optimizable``'s positions) with these (generalised) ``forces``."""
    gradient = forces.ravel()  # ASE's name for the negative gradient
    if slot.velocity is None:
        slot.velocity = np.zeros(gradient.shape[0])
    else:
        vf = np.vdot(gradient, slot.velocity)
        grad2 = np.vdot(gradient, gradient)
        if vf > 0.0:
            slot.velocity = ((1.0 - slot.a) * slot.velocity
                             + slot.a * gradient / np.sqrt(grad2) * np.sqrt(np.vdot(slot.velocity, slot.velocity)))
            if slot.downhill > fire.Nmin:
                slot.dt = min(slot.dt * fire.finc, fire.dtmax)
                slot.a *= fire.fa
            slot.downhill += 1
        else:
            slot.velocity[:] *= 0.0
            slot.a = fire.astart
            slot.dt *= fire.fdec
            slot.downhill = 0
    slot.velocity += slot.dt * gradient
    dr = slot.dt * slot.velocity
    normdr = np.sqrt(np.vdot(dr, dr))
    if normdr > fire.maxstep:
        dr = fire.maxstep * dr / normdr
    slot.optimizable.set_positions(slot.optimizable.get_positions() + dr.reshape(-1, 3))
    slot.nsteps += 1
