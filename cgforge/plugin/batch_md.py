"""Molecular dynamics of many independent structures at once: ``run_md_batch`` (NVE, NVT: Langevin or CSVR).

    from cgforge.plugin import Calculator, run_md_batch
    final = run_md_batch(Calculator("mace"), structures, ensemble="nvt", timestep_fs=0.5, steps=1000,
                         temperature_K=300, friction=0.01, seed=1)

Every structure moves by the device engine's integrators (``md.integrators``: ``VelocityVerlet`` for NVE,
``Langevin`` or ``CSVR`` for NVT, their arithmetic applied to the batch's atoms at once) with its own atoms'
masses and momenta (the ``Atoms``' own, zero where they have none), its own temperature, friction or coupling
time, and its own noise: system b draws what ``Engine(calc, atoms_b, integrator, seed=seeds[b])`` draws alone
(``noise.SystemNoise``; ``seed`` an int gives system b the seed ``seed + b``), so a structure's trajectory does
not depend on the batch it runs in. All structures' forces come from one model call per step
(``runtime.batch.BatchStep``: one graph, each structure's Verlet list kept while it is valid). Positions,
momenta and forces stay on the model's device in float64.

Not here: NPT (the barostat changes every cell at every step, and the batch's Verlet list is kept per structure
only while its cell is unchanged: each step would search every structure again), and capture in a CUDA graph
(the batch step reads the neighbour list's state on the host every step). A structure that cannot be
evaluated, or whose energy or forces become NaN or inf, raises ``BatchStructureError`` naming it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from ase import Atoms, units
from ase.calculators.singlepoint import SinglePointCalculator
from torch import Tensor

from .batch import potential_of, structures_of
from .calculator import Calculator
from .md.integrators import (
    CSVR,
    Integrator,
    Langevin,
    MDState,
    VelocityVerlet,
    _langevin_first,
    _langevin_second,
    csvr_alpha,
)
from .md.noise import SystemNoise
from .md.options import BATCH_ENSEMBLES as ENSEMBLES
from .md.options import MODES, OPTION_FIELDS, THERMOSTATS, check_choice, check_count, check_number
from .runtime.batch import BatchStructureError, check_finite
from .runtime.potential import Potential

__all__ = ["BatchCSVR", "BatchLangevin", "ENSEMBLES", "run_md_batch", "run_nve_batch"]


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

    def bind(self, masses: Tensor) -> None:
        self.temperature_K = self.temperature_K.to(masses.device)
        self.friction_per_fs = self.friction_per_fs.to(masses.device)
        super().bind(masses)


class BatchCSVR(CSVR):
    """``CSVR`` over a batch: each system its own degrees of freedom (3 n_b - 3, at least 2, as ``CSVR``'s
    default), target temperature, coupling time ``tau_fs``, kinetic energy, draws (``SystemNoise.per_system``:
    the numbers it draws alone) and heat (``extra['heat']`` [B]). The factor is ``csvr_alpha``, the single
    system's arithmetic, of each system's sums (summed in another order than alone: equal to rounding)."""

    def __init__(self, timestep_fs: float, temperature_K: list[float], tau_fs: list[float], ptr: list[int]) -> None:
        Integrator.__init__(self, timestep_fs)  # not CSVR's: its checks take one number (run_md_batch checks)
        self.temperatures, self.taus, self.ptr = temperature_K, tau_fs, ptr

    def bind(self, masses: Tensor) -> None:
        Integrator.bind(self, masses)
        f64 = {"dtype": torch.float64, "device": masses.device}
        sizes = np.diff(self.ptr).tolist()
        self.dofs = [max(3 * n - 3, 2) for n in sizes]
        # CSVR.bind's numbers, per system
        kt_per_dof = [0.5 * dof * units.kB * t / dof for dof, t in zip(self.dofs, self.temperatures)]
        c = [math.exp(-0.5 * self.timestep_fs / tau) for tau in self.taus]
        self.c, self.kt_per_dof = torch.tensor(c, **f64), torch.tensor(kt_per_dof, **f64)
        self.sqrt_c = torch.tensor([math.sqrt(x) for x in c], **f64)
        self.sqrt_kick = torch.tensor([math.sqrt((1 - x) * k) for x, k in zip(c, kt_per_dof)], **f64)
        count = len(sizes)
        self.atom_system = torch.repeat_interleave(torch.arange(count, device=masses.device),
                                                   torch.as_tensor(sizes, device=masses.device))
        self.draw_system = torch.repeat_interleave(torch.arange(count, device=masses.device),
                                                   torch.as_tensor(self.dofs, device=masses.device))
        self.first_draw = torch.as_tensor(np.concatenate([[0], np.cumsum(self.dofs)[:-1]]), device=masses.device)

    def initial_extra(self, device: torch.device) -> dict[str, Tensor]:
        return {"heat": torch.zeros(len(self.dofs), dtype=torch.float64, device=device)}

    def _rescale(self, s: MDState, noise: SystemNoise, stream: int) -> None:
        draws = noise.per_system(stream, self.dofs)
        twice_kinetic = torch.zeros_like(self.c).index_add_(0, self.atom_system, (s.momenta.square() / s.masses).sum(1))
        squares = draws.square().index_fill_(0, self.first_draw, 0.0)  # S: the draws after each system's first
        rest = torch.zeros_like(self.c).index_add_(0, self.draw_system, squares)
        alpha, heat = csvr_alpha(0.5 * twice_kinetic, draws.index_select(0, self.first_draw), rest, self.c,
                                 self.kt_per_dof, self.sqrt_c, self.sqrt_kick)
        s.momenta.mul_(alpha.index_select(0, self.atom_system)[:, None])
        s.extra["heat"].add_(heat)


def _per_system(name: str, value: float | Sequence[float], count: int, strict: bool = False) -> list[float]:
    """One number >= 0 (> 0 when ``strict``) per system: ``value`` for each, or one of the sequence each."""
    if not isinstance(value, Sequence | np.ndarray):
        return [check_number(name, value, strict=strict)] * count
    if len(value) != count:
        raise ValueError(f"{name}: expected a number or one per structure ({count}), got {len(value)}")
    return [check_number(f"{name}[{b}]", v, strict=strict) for b, v in enumerate(value)]


def _seeds(seed: int | Sequence[int], count: int) -> list[int]:
    if isinstance(seed, Sequence | np.ndarray):
        if len(seed) != count:
            raise ValueError(f"seed: expected an int or one per structure ({count}), got {len(seed)}")
        return [check_count(f"seed[{b}]", s, 0) for b, s in enumerate(seed)]
    return [check_count("seed", seed, 0) + b for b in range(count)]


def _integrator(ensemble: str, thermostat: str | None, timestep_fs: float, temperature_K, friction, taut_fs,
                ptr: list[int]) -> Integrator:
    count = len(ptr) - 1
    if ensemble == "nvt":
        thermostat = "langevin" if thermostat is None else check_choice("thermostat", thermostat, THERMOSTATS)
    mode = f"nvt-{thermostat}" if ensemble == "nvt" else ensemble
    nvt = ("nvt-langevin", "nvt-csvr")  # the temperature too: NVE starts from the structures' own momenta
    for name, value in (("thermostat", thermostat if ensemble == "nve" else None), ("temperature_K", temperature_K),
                        ("friction", friction), ("taut_fs", taut_fs)):
        modes = [m for m in OPTION_FIELDS[name]["modes"] or nvt if m != "npt"]
        if value is not None and mode not in modes:  # as MDOptions refuses an option of another mode
            raise ValueError(f"{name}: not for {MODES[mode]}, only for {' and '.join(MODES[m] for m in modes)}; "
                             f"got {value!r}")
    if ensemble == "nve":
        return VelocityVerlet(timestep_fs)
    if temperature_K is None:
        raise ValueError("temperature_K: ensemble='nvt' needs the target temperature (K)")
    temperatures = _per_system("temperature_K", temperature_K, count)
    if thermostat == "csvr":
        taus = _per_system("taut_fs", OPTION_FIELDS["taut_fs"]["value"] if taut_fs is None else taut_fs, count,
                           strict=True)
        return BatchCSVR(timestep_fs, temperatures, taus, ptr)
    sizes = torch.as_tensor(np.diff(ptr))

    def per_atom(values: list[float]) -> Tensor:
        return torch.repeat_interleave(torch.as_tensor(values, dtype=torch.float64), sizes)[:, None]

    frictions = _per_system("friction", OPTION_FIELDS["friction"]["value"] if friction is None else friction, count)
    return BatchLangevin(timestep_fs, per_atom(temperatures), per_atom(frictions))


def run_md_batch(model: Potential | Calculator, atoms_list: Sequence[Atoms], *, ensemble: str = "nve",
                 timestep_fs: float, steps: int, temperature_K: float | Sequence[float] | None = None,
                 thermostat: str | None = None, friction: float | Sequence[float] | None = None,
                 taut_fs: float | Sequence[float] | None = None, seed: int | Sequence[int] = 0,
                 min_distance: float | None = 0.5) -> list[Atoms]:
    """``steps`` MD steps of ``timestep_fs`` fs for every structure of ``atoms_list`` in one batch (module doc);
    copies of the structures at the end, with their momenta and a single-point calculator holding their energy
    and forces there. The inputs are not changed.

    ensemble: "nve" (velocity Verlet) or "nvt" (``temperature_K`` needed). thermostat (NVT): "langevin" (the
    default; ``friction`` in 1/fs) or "csvr" (``taut_fs``, its coupling time in fs). temperature_K (K),
    friction and taut_fs (default cgforge md's): one number for all, or one per structure. seed: the noise's
    seed of structure b is ``seed + b``, or ``seed[b]`` for a sequence (as ``Engine(..., seed=...)`` takes it).
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
    integrator = _integrator(ensemble.lower(), thermostat, timestep_fs, temperature_K, friction, taut_fs, ptr)
    seeds = _seeds(seed, len(structures))
    step = potential_of(model).batch_step(min_distance)
    device = step.adapter.device
    cells = np.stack([np.asarray(s.cell, dtype=np.float64) for s in structures])
    pbcs = [s.pbc for s in structures]
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
    integrator.bind(state.masses)
    state.extra = integrator.initial_extra(device)
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
