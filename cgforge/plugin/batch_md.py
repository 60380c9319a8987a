"""Molecular dynamics of many independent structures at once: ``run_md_batch`` (NVE, NVT, NPT; docs/batch.md).

Every structure moves by the engine's integrators (``md.integrators``) applied to the batch at once, with its own
masses, temperature, cell and noise: system b draws what ``Engine(calc, atoms_b, integrator, seed=seeds[b])``
draws alone (``noise.SystemNoise``). NVE and NVT run ``runtime.batch_capture.PaddedBatchStep``, NPT
``runtime.batch.BatchStep``. A bad structure raises ``BatchStructureError`` naming it.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np
import torch
from ase import Atoms, units
from ase.calculators.singlepoint import SinglePointCalculator
from torch import Tensor

from cgforge.kernels.md_rescale import cell_scaling_factor, csvr_alpha
from cgforge.kernels.md_step import langevin_first_reference, langevin_second_reference

from .batch import potential_of, structures_of
from .calculator import Calculator
from .md.integrators import (
    CSVR,
    Integrator,
    Langevin,
    MDState,
    SystemNoise,
    VelocityVerlet,
)
from .md.options import (
    ENSEMBLES,
    MODES,
    OPTION_FIELDS,
    THERMOSTATS,
    EngineOptions,
    check_choice,
    check_count,
    check_number,
)
from .runtime.batch import BatchStructureError, check_finite
from .runtime.batch_capture import PaddedBatchStep
from .runtime.capture import resolve_cuda_graph
from .runtime.potential import Potential

_AT_LEAST_0 = partial(check_number, strict=False)
__all__ = ["BatchCellRescaling", "BatchCSVR", "BatchLangevin", "ENSEMBLES", "run_md_batch"]


class BatchLangevin(Langevin):
    """``Langevin`` over a batch: ``temperature_K`` and ``friction_per_fs`` per atom ([N, 1] float64 tensors), so
    system b moves as ``Langevin(timestep_fs, T_b, friction_b)`` moves it alone."""

    def __init__(self, timestep_fs: float, temperature_K: Tensor, friction_per_fs: Tensor) -> None:
        Integrator.__init__(self, timestep_fs)  # not Langevin's: its checks take one number (run_md_batch checks)
        self.temperature_K, self.friction_per_fs = temperature_K, friction_per_fs

    def fuse(self, compile) -> None:
        super().fuse(compile)
        if compile is None:  # c1, c2 are per atom here: the torch expressions (md_step's kernels take scalars)
            self._math.update(_langevin_first=langevin_first_reference, _langevin_second=langevin_second_reference)

    def bind(self, masses: Tensor) -> None:
        self.temperature_K = self.temperature_K.to(masses.device)
        self.friction_per_fs = self.friction_per_fs.to(masses.device)
        super().bind(masses)


class BatchCSVR(CSVR):
    """``CSVR`` over a batch: each system its own degrees of freedom, temperature, coupling time, draws (as alone)
    and heat (``extra['heat']`` [B]), through the single system's ``csvr_alpha``."""

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
        systems = torch.arange(len(sizes), device=masses.device)
        self.atom_system = systems.repeat_interleave(torch.as_tensor(sizes, device=masses.device))
        self.draw_system = systems.repeat_interleave(torch.as_tensor(self.dofs, device=masses.device))
        self.first_draw = torch.as_tensor(np.concatenate([[0], np.cumsum(self.dofs)[:-1]]), device=masses.device)

    def initial_extra(self, device: torch.device) -> dict[str, Tensor]:
        return {"heat": torch.zeros(len(self.dofs), dtype=torch.float64, device=device)}

    def before_forces(self, s: MDState, noise: SystemNoise) -> None:
        self._rescale(s, noise, 0)  # CSVR's order: the half rescale, then velocity Verlet's kick and drift
        Integrator.before_forces(self, s, noise)

    def after_forces(self, s: MDState, noise: SystemNoise) -> None:
        Integrator.after_forces(self, s, noise)
        self._rescale(s, noise, 1)

    def _rescale(self, s: MDState, noise: SystemNoise, stream: int) -> None:
        draws = noise.per_system(stream, self.dofs)
        twice_kinetic = torch.zeros_like(self.c).index_add_(0, self.atom_system, (s.momenta.square() / s.masses).sum(1))
        squares = draws.square().index_fill_(0, self.first_draw, 0.0)  # S: the draws after each system's first
        rest = torch.zeros_like(self.c).index_add_(0, self.draw_system, squares)
        alpha, heat = csvr_alpha(0.5 * twice_kinetic, draws.index_select(0, self.first_draw), rest, self.c,
                                 self.kt_per_dof, self.sqrt_c, self.sqrt_kick)
        s.momenta.mul_(alpha.index_select(0, self.atom_system)[:, None])
        s.extra["heat"].add_(heat)


class BatchCellRescaling(BatchCSVR):
    """NPT: ``StochasticCellRescaling`` (isotropic) over a batch, each system its own cell, pressure tensor and
    draws (as alone); pressure_GPa, tau_p_fs, compressibility_per_GPa the same for every system."""

    needs_virial = True
    changes_cell = True

    def __init__(self, timestep_fs: float, temperature_K: list[float], tau_fs: list[float], ptr: list[int],
                 pressure_GPa: float, tau_p_fs: float, compressibility_per_GPa: float) -> None:
        super().__init__(timestep_fs, temperature_K, tau_fs, ptr)
        self.pressure_GPa, self.tau_p_fs, self.compressibility_per_GPa = pressure_GPa, tau_p_fs, compressibility_per_GPa

    def bind(self, masses: Tensor) -> None:
        super().bind(masses)
        self.p0 = self.pressure_GPa * units.GPa  # StochasticCellRescaling.bind's numbers
        self.rate = (self.compressibility_per_GPa / units.GPa) / (self.tau_p_fs * units.fs)
        self.kt = torch.tensor([units.kB * t for t in self.temperatures], dtype=torch.float64, device=masses.device)

    def before_forces(self, s: MDState, noise: SystemNoise) -> None:
        v = (s.cell[:, 0] * torch.linalg.cross(s.cell[:, 1], s.cell[:, 2])).sum(-1).abs()
        twice_kinetic = torch.zeros_like(s.virial).index_add_(
            0, self.atom_system, (s.momenta / s.masses)[:, :, None] * s.momenta[:, None, :])
        pressure = (twice_kinetic - s.virial) / v[:, None, None]
        draws = noise.per_system(2, [1] * len(self.dofs))[:, None]
        mu = cell_scaling_factor(torch.diagonal(pressure, dim1=-2, dim2=-1), v, draws, self.rate, self.kt, self.dt,
                                 self.p0, False)
        super().before_forces(s, noise)  # CSVR's half rescale, kick and drift
        per_atom = mu.index_select(0, self.atom_system)
        s.positions.mul_(per_atom)
        s.cell.mul_(mu[:, None, :])
        s.momenta.div_(per_atom)


def _per_system(name: str, value: Any, count: int, check: Callable = _AT_LEAST_0, what: str = "a number") -> list:
    """One checked value per system: ``value`` for each, or one of the sequence each."""
    if not isinstance(value, Sequence | np.ndarray):
        return [check(name, value)] * count
    if len(value) != count:
        raise ValueError(f"{name}: expected {what} or one per structure ({count}), got {len(value)}")
    return [check(f"{name}[{b}]", v) for b, v in enumerate(value)]


def _integrator(ensemble: str, given: dict, timestep_fs: float, ptr: list[int]) -> Integrator:
    """The batch's integrator for ``ensemble`` and the keywords ``given`` (None: not given)."""
    count = len(ptr) - 1
    thermostat = given["thermostat"]
    if ensemble == "nvt":
        thermostat = "langevin" if thermostat is None else check_choice("thermostat", thermostat, THERMOSTATS)
    mode = f"nvt-{thermostat}" if ensemble == "nvt" else ensemble
    for name, value in given.items():  # as MDOptions refuses an option of another mode
        # (the temperature too for NVE: NVE starts from the structures' own momenta)
        modes = OPTION_FIELDS[name]["modes"] or ("nvt-langevin", "nvt-csvr", "npt")
        if value is not None and mode not in modes:
            raise ValueError(f"{name}: not for {MODES[mode]}, only for {' and '.join(MODES[m] for m in modes)}; "
                             f"got {value!r}")
    if ensemble == "nve":
        return VelocityVerlet(timestep_fs)
    if given["temperature_K"] is None:
        raise ValueError(f"temperature_K: ensemble={ensemble!r} needs the target temperature (K)")
    given = {k: OPTION_FIELDS[k]["value"] if v is None else v for k, v in given.items()}  # cgforge md's defaults
    temperatures = _per_system("temperature_K", given["temperature_K"], count)
    if thermostat == "csvr" or ensemble == "npt":
        taus = _per_system("taut_fs", given["taut_fs"], count, check_number)
        if ensemble == "nvt":
            return BatchCSVR(timestep_fs, temperatures, taus, ptr)
        # MDOptions' units (bar, 1/bar) to StochasticCellRescaling's (GPa, 1/GPa), as cgforge md converts them
        return BatchCellRescaling(timestep_fs, temperatures, taus, ptr,
                                  check_number("pressure_bar", given["pressure_bar"], minimum=None) * 1e-4,
                                  check_number("taup_fs", given["taup_fs"]),
                                  check_number("compressibility_per_bar", given["compressibility_per_bar"]) * 1e4)
    sizes = torch.as_tensor(np.diff(ptr))

    def per_atom(values: list[float]) -> Tensor:
        return torch.repeat_interleave(torch.as_tensor(values, dtype=torch.float64), sizes)[:, None]

    frictions = _per_system("friction", given["friction"], count)
    return BatchLangevin(timestep_fs, per_atom(temperatures), per_atom(frictions))


def _padded_choice(cuda_graph: bool | None, padded: bool | None, potential: Potential, changes_cell: bool
                   ) -> tuple[bool, bool]:
    """(capture, padded) of a run: cuda_graph by the runtime's rule (``resolve_cuda_graph``); the padded step
    needs fixed cells and a step that reads no chunk ranges on the host (no streaming)."""
    why_not = ("NPT changes every cell every step, so its steps run eagerly" if changes_cell else
               "a streaming potential reads its chunk ranges on the host, so its steps run eagerly"
               if potential.streaming else None)
    if why_not is not None:
        for name, value in (("cuda_graph", cuda_graph), ("padded", padded)):
            if value:
                raise ValueError(f"{name}=True: {why_not}")
        return False, False
    use_graph = resolve_cuda_graph(cuda_graph, potential.device, potential.inert_edges_reason)
    return use_graph, use_graph if padded is None else bool(padded) or use_graph


def _renamed(engine_options: EngineOptions | dict[str, Any] | None, renamed: dict[str, Any]
             ) -> EngineOptions | dict[str, Any] | None:
    """engine_options with the keywords run_md_batch took before EngineOptions held them (cuda_graph, padded)."""
    if unknown := sorted(set(renamed) - {"cuda_graph", "padded"}):
        raise TypeError(f"run_md_batch() got an unexpected keyword argument {unknown[0]!r}")
    if not renamed:
        return engine_options
    if engine_options is not None:
        raise TypeError(f"run_md_batch: give {', '.join(sorted(renamed))} inside engine_options, not beside it")
    warnings.warn(f"run_md_batch({', '.join(f'{k}=' for k in sorted(renamed))}) is now "
                  f"run_md_batch(engine_options={renamed!r})", FutureWarning, stacklevel=3)
    return renamed


def run_md_batch(model: Potential | Calculator, atoms_list: Sequence[Atoms], *, ensemble: str = "nve",
                 timestep_fs: float, steps: int, temperature_K: float | Sequence[float] | None = None,
                 thermostat: str | None = None, friction: float | Sequence[float] | None = None,
                 taut_fs: float | Sequence[float] | None = None, pressure_bar: float | None = None,
                 taup_fs: float | None = None, compressibility_per_bar: float | None = None,
                 seed: int | Sequence[int] = 0, min_distance: float | None = 0.5,
                 engine_options: EngineOptions | dict[str, Any] | None = None, **renamed: Any) -> list[Atoms]:
    """``steps`` MD steps for every structure of ``atoms_list`` in one batch; copies at the end with momenta and
    a single-point calculator (energy, forces); the inputs are not changed. The keywords are ``run_md``'s
    (docs/batch.md's table); temperature_K, friction, taut_fs: one number or one per structure; structure b's
    seed is ``seed + b``, or ``seed[b]`` for a sequence. engine_options (``EngineOptions`` or a dict of its
    fields): its cuda_graph captures the force call (NVE, NVT) in a CUDA graph (None: on CUDA for a model inert
    beyond its cutoff); its padded runs the padded step without the capture (None: as cuda_graph). The keywords
    cuda_graph= and padded= of session 34 still work, with a FutureWarning."""
    ensemble = check_choice("ensemble", ensemble, ENSEMBLES)
    timestep_fs = check_number("timestep_fs", timestep_fs)
    steps = check_count("steps", steps, 0)
    options = EngineOptions.of(_renamed(engine_options, renamed)).only(("cuda_graph", "padded"), "run_md_batch")
    structures = structures_of(atoms_list)
    if not structures:
        raise ValueError("atoms_list: expected at least one structure, got none")
    sizes = [len(s.numbers) for s in structures]
    if 0 in sizes:
        raise BatchStructureError(sizes.index(0), "expected a structure with at least one atom, got none")
    ptr = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    given = {"thermostat": thermostat, "temperature_K": temperature_K, "friction": friction, "taut_fs": taut_fs,
             "pressure_bar": pressure_bar, "taup_fs": taup_fs, "compressibility_per_bar": compressibility_per_bar}
    integrator = _integrator(ensemble, given, timestep_fs, ptr)
    seeds = _per_system("seed", seed, len(structures), partial(check_count, minimum=0), "an int")
    seeds = seeds if isinstance(seed, Sequence | np.ndarray) else [s + b for b, s in enumerate(seeds)]
    potential = potential_of(model)
    step = potential.batch_step(min_distance)
    device = step.adapter.device
    use_graph, padded = _padded_choice(options.cuda_graph, options.padded, potential, integrator.changes_cell)
    cells = np.stack([np.asarray(s.cell, dtype=np.float64) for s in structures])
    pbcs = [s.pbc for s in structures]
    host_positions = np.concatenate([np.asarray(s.positions, dtype=np.float64) for s in structures])
    check_finite(host_positions, cells, ptr)
    species = step.species(np.concatenate([np.asarray(s.numbers) for s in structures]), ptr)
    host_momenta = np.concatenate([a.get_momenta() for a in atoms_list])
    if not np.isfinite(host_momenta).all():
        b = int(np.searchsorted(ptr, int(np.argmax(~np.isfinite(host_momenta).all(1))), side="right")) - 1
        raise BatchStructureError(b, "momenta contain NaN or inf")
    f64 = {"dtype": torch.float64, "device": device}
    count = len(structures)
    state = MDState(positions=torch.as_tensor(host_positions, **f64),
                    momenta=torch.as_tensor(host_momenta, **f64),
                    forces=torch.zeros(ptr[-1], 3, **f64), energy=torch.zeros(count, **f64),
                    virial=torch.zeros(count, 3, 3, **f64), cell=torch.as_tensor(cells, **f64),
                    masses=torch.as_tensor(np.concatenate([a.get_masses() for a in atoms_list]), **f64)[:, None],
                    step=torch.zeros((), dtype=torch.int64, device=device))
    if integrator.changes_cell:
        for b, structure in enumerate(structures):
            if not all(structure.pbc) or abs(np.linalg.det(cells[b])) == 0:
                raise BatchStructureError(b, f"NPT changes the cell and needs a periodic 3-D cell; this structure has "
                                             f"pbc={list(structure.pbc)} and volume {abs(np.linalg.det(cells[b])):g}")
    integrator.bind(state.masses)
    state.extra = integrator.initial_extra(device)
    noise = SystemNoise(seeds, ptr, state.step)
    keys = list(range(count))
    step.padded = None if not padded else PaddedBatchStep(
        step, cells, pbcs, ptr, species, cuda_graph=use_graph, inert_edges_reason=potential.inert_edges_reason,
        keys=keys)

    def forces(at: int) -> None:
        if step.padded is not None:  # its one host read per step says whether the results are finite
            out = step.padded.run(state.positions)
        else:  # the barostat's cells on the host for the neighbour search (which searches a changed cell again)
            host_cells = state.cell.cpu().numpy() if integrator.changes_cell else cells
            out = step.run(state.positions, host_cells, pbcs, ptr, species, stress=integrator.needs_virial, keys=keys)
        state.forces.copy_(out.forces.detach())
        state.energy.copy_(out.energy.detach())
        if integrator.needs_virial:
            state.virial.copy_(out.virial.detach())
        # a blown-up structure is named before its coordinates reach the next neighbour search
        finite = step.padded.finite if step.padded is not None else bool(
            torch.isfinite(state.energy).all() & torch.isfinite(state.forces).all())
        if not finite:
            rows = (~torch.isfinite(state.forces)).any(1).to(torch.int64).cpu().numpy()
            bad = ~np.isfinite(state.energy.cpu().numpy()) | (np.add.reduceat(rows, ptr[:-1]) > 0)
            raise BatchStructureError(int(np.argmax(bad)), f"the model returned NaN or inf at step {at}")

    try:
        with torch.no_grad():
            forces(0)
            for at in range(1, steps + 1):
                integrator.before_forces(state, noise)
                forces(at)
                integrator.after_forces(state, noise)
                state.step.add_(1)
    finally:
        if step.padded is not None:
            step.padded.release()  # its graph's and buffers' memory goes; its counts and capture_error stay
    energies, x_host, p_host, f_host, cell_host = (t.cpu().numpy() for t in (
        state.energy, state.positions, state.momenta, state.forces, state.cell))
    final = []
    for b, atoms in enumerate(atoms_list):
        copy = atoms.copy()
        rows = slice(ptr[b], ptr[b + 1])
        if integrator.changes_cell:
            copy.set_cell(cell_host[b], scale_atoms=False)
        copy.set_positions(x_host[rows])
        copy.set_momenta(p_host[rows], apply_constraint=False)
        copy.calc = SinglePointCalculator(copy, energy=float(energies[b]), free_energy=float(energies[b]),
                                          forces=f_host[rows].copy())
        final.append(copy)
    return final

