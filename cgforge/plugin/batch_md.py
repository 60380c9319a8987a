"""Molecular dynamics of many independent structures at once: ``run_md_batch`` (NVE, NVT Langevin).

    from cgforge.plugin import Calculator, run_md_batch
    final = run_md_batch(Calculator("mace"), structures, ensemble="nvt", timestep_fs=0.5, steps=1000,
                         temperature_K=300, friction=0.01, seed=1)

Every structure moves by the device engine's integrators (``md.integrators``: ``VelocityVerlet`` for NVE,
``Langevin`` for NVT, the same arithmetic applied to the batch's atoms at once) with its own atoms' masses and
momenta (the ``Atoms``' own, zero where they have none), its own temperature and friction, and its own noise:
system b draws what ``Engine(calc, atoms_b, integrator, seed=seeds[b])`` draws alone (``noise.SystemNoise``;
``seed`` an int gives system b the seed ``seed + b``), so a structure's trajectory does not depend on the batch
it runs in. All structures' forces come from one model call per step (``runtime.batch.BatchStep``: one graph,
each structure's Verlet list kept while it is valid). Positions, momenta and forces stay on the model's device
in float64.

Not here: NPT (each step's cell change would search every structure's neighbours again: the batch's list is
kept per structure only while its cell is unchanged), the CSVR thermostat (its rescaling sums each system's
kinetic energy: a per-system reduction the single-system arithmetic does not have), and capture in a CUDA graph
(the batch step reads the neighbour list's state on the host every step). A structure that cannot be
evaluated, or whose energy or forces become NaN or inf, raises ``BatchStructureError`` naming it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from ase import Atoms
from ase.calculators.singlepoint import SinglePointCalculator
from torch import Tensor

from .batch import potential_of, structures_of
from .calculator import Calculator
from .md.integrators import Integrator, Langevin, MDState, VelocityVerlet, _langevin_first, _langevin_second
from .md.noise import SystemNoise
from .md.options import BATCH_ENSEMBLES as ENSEMBLES
from .md.options import OPTION_FIELDS, check_count, check_number
from .runtime.batch import BatchStructureError, check_finite
from .runtime.potential import Potential

__all__ = ["BatchLangevin", "ENSEMBLES", "run_md_batch", "run_nve_batch"]

FRICTION_PER_FS = OPTION_FIELDS["friction"]["value"]  # cgforge md's default


class BatchLangevin(Langevin):
    """``Langevin`` over a batch: ``temperature_K`` and ``friction_per_fs`` per atom ([N, 1] float64 tensors, each
    system's values on its atoms). ``Langevin.bind``'s formulas then give ASE's coefficients per atom, the same
    numbers as for each system alone, so system b moves as ``Langevin(timestep_fs, T_b, friction_b)`` moves it
    given the same forces and draws."""

    def __init__(self, timestep_fs: float, temperature_K: Tensor, friction_per_fs: Tensor) -> None:
        Integrator.__init__(self, timestep_fs)  # not Langevin's: its checks take one number (run_md_batch checks)
        self.temperature_K, self.friction_per_fs = temperature_K, friction_per_fs

    def fuse(self, compile) -> None:
        super().fuse(compile)
        if compile is None:  # c1, c2 are per atom here: the torch expressions (md_step's kernels take scalars)
            self._math.update(_langevin_first=_langevin_first, _langevin_second=_langevin_second)


def _per_system(name: str, value: float | Sequence[float], count: int) -> list[float]:
    """One number >= 0 per system: ``value`` for each, or one of the sequence each."""
    if not isinstance(value, Sequence | np.ndarray):
        return [check_number(name, value, strict=False)] * count
    if len(value) != count:
        raise ValueError(f"{name}: expected a number or one per structure ({count}), got {len(value)}")
    return [check_number(f"{name}[{b}]", v, strict=False) for b, v in enumerate(value)]


def _seeds(seed: int | Sequence[int], count: int) -> list[int]:
    if isinstance(seed, Sequence | np.ndarray):
        if len(seed) != count:
            raise ValueError(f"seed: expected an int or one per structure ({count}), got {len(seed)}")
        return [check_count(f"seed[{b}]", s, 0) for b, s in enumerate(seed)]
    return [check_count("seed", seed, 0) + b for b in range(count)]


def _integrator(ensemble: str, timestep_fs: float, temperature_K, friction, ptr: list[int]) -> Integrator:
    count = len(ptr) - 1
    if ensemble == "nve":
        for name, value in (("temperature_K", temperature_K), ("friction", friction)):
            if value is not None:
                raise ValueError(f"{name}: only for ensemble='nvt' (NVE has no thermostat), got {value!r}")
        return VelocityVerlet(timestep_fs)
    if temperature_K is None:
        raise ValueError("temperature_K: ensemble='nvt' needs the target temperature (K)")
    sizes = torch.as_tensor(np.diff(ptr))

    def per_atom(values: list[float]) -> Tensor:
        return torch.repeat_interleave(torch.as_tensor(values, dtype=torch.float64), sizes)[:, None]

    temperature = per_atom(_per_system("temperature_K", temperature_K, count))
    friction = per_atom(_per_system("friction", FRICTION_PER_FS if friction is None else friction, count))
    return BatchLangevin(timestep_fs, temperature, friction)


def run_md_batch(model: Potential | Calculator, atoms_list: Sequence[Atoms], *, ensemble: str = "nve",
                 timestep_fs: float, steps: int, temperature_K: float | Sequence[float] | None = None,
                 friction: float | Sequence[float] | None = None, seed: int | Sequence[int] = 0,
                 min_distance: float | None = 0.5) -> list[Atoms]:
    """``steps`` MD steps of ``timestep_fs`` fs for every structure of ``atoms_list`` in one batch (module doc);
    copies of the structures at the end, with their momenta and a single-point calculator holding their energy
    and forces there. The inputs are not changed.

    ensemble: "nve" (velocity Verlet) or "nvt" (Langevin; ``temperature_K`` needed). temperature_K (K) and
    friction (1/fs, default cgforge md's): one number for all, or one per structure. seed: the noise's seed of
    structure b is ``seed + b``, or ``seed[b]`` for a sequence (as ``Engine(..., seed=...)`` takes it).
    min_distance: as ``evaluate_batch``'s."""
    if not isinstance(ensemble, str) or ensemble.lower() not in ENSEMBLES:
        why = " (NPT is not batched: module doc)" if str(ensemble).lower() == "npt" else ""
        raise ValueError(f"ensemble: expected one of {', '.join(ENSEMBLES)}, got {ensemble!r}{why}")
    timestep_fs = check_number("timestep_fs", timestep_fs)
    steps = check_count("steps", steps, 0)
    structures = structures_of(atoms_list)
    if not structures:
        raise ValueError("atoms_list: expected at least one structure, got none")
    sizes = [len(s.numbers) for s in structures]
    if 0 in sizes:
        raise BatchStructureError(sizes.index(0), "expected a structure with at least one atom, got none")
    ptr = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    integrator = _integrator(ensemble.lower(), timestep_fs, temperature_K, friction, ptr)
    seeds = _seeds(seed, len(structures))
    step = potential_of(model).batch_step(min_distance)
    device = step.adapter.device
    cells = np.stack([np.asarray(s.cell, dtype=np.float64) for s in structures])
    pbcs = [tuple(s.pbc) for s in structures]
    host_positions = np.concatenate([np.asarray(s.positions, dtype=np.float64) for s in structures])
    check_finite(host_positions, cells, ptr)
    species = step.species(np.concatenate([np.asarray(s.numbers) for s in structures]), ptr)
    f64 = {"dtype": torch.float64, "device": device}
    count = len(structures)
    state = MDState(positions=torch.as_tensor(host_positions, **f64),
                    momenta=torch.as_tensor(np.concatenate([a.get_momenta() for a in atoms_list]), **f64),
                    forces=torch.zeros(ptr[-1], 3, **f64), energy=torch.zeros(count, **f64),
                    virial=torch.zeros(count, 3, 3, **f64), cell=torch.as_tensor(cells, **f64),
                    masses=torch.as_tensor(np.concatenate([a.get_masses() for a in atoms_list]), **f64)[:, None],
                    step=torch.zeros((), dtype=torch.int64, device=device))
    if isinstance(integrator, BatchLangevin):
        integrator.temperature_K = integrator.temperature_K.to(device)
        integrator.friction_per_fs = integrator.friction_per_fs.to(device)
    integrator.bind(state.masses)
    noise = SystemNoise(seeds, ptr, state.step)
    keys = list(range(count))

    def forces(at: int) -> None:
        out = step.run(state.positions, cells, pbcs, ptr, species, keys=keys)
        state.forces.copy_(out.forces.detach())
        state.energy.copy_(out.energy.detach())
        # one host read per step (the batch step reads the host more already): a blown-up structure is named
        # before its coordinates reach the next neighbour search
        if not bool(torch.isfinite(state.energy).all() & torch.isfinite(state.forces).all()):
            rows = (~torch.isfinite(state.forces)).any(1).to(torch.int64).cpu().numpy()
            bad = ~np.isfinite(state.energy.cpu().numpy()) | (np.add.reduceat(rows, ptr[:-1]) > 0)
            raise BatchStructureError(int(np.argmax(bad)), f"the model returned NaN or inf at step {at}")

    with torch.no_grad():
        forces(0)
        for at in range(1, steps + 1):
            integrator.before_forces(state, noise)
            forces(at)
            integrator.after_forces(state, noise)
            state.step.add_(1)
    energies = state.energy.cpu().numpy()
    x_host, p_host, f_host = (t.cpu().numpy() for t in (state.positions, state.momenta, state.forces))
    final = []
    for b, atoms in enumerate(atoms_list):
        copy = atoms.copy()
        rows = slice(ptr[b], ptr[b + 1])
        copy.set_positions(x_host[rows])
        copy.set_momenta(p_host[rows], apply_constraint=False)
        copy.calc = SinglePointCalculator(copy, energy=float(energies[b]), free_energy=float(energies[b]),
                                          forces=f_host[rows].copy())
        final.append(copy)
    return final


def run_nve_batch(model: Potential | Calculator, atoms_list: Sequence[Atoms], *, timestep_fs: float, steps: int,
                  min_distance: float | None = 0.5) -> list[Atoms]:
    """``run_md_batch`` with ``ensemble="nve"``."""
    return run_md_batch(model, atoms_list, ensemble="nve", timestep_fs=timestep_fs, steps=steps,
                        min_distance=min_distance)
