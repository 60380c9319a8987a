"""MD integrators in torch for the engine (``engine.Engine``): the same code on CPU tensors and in a CUDA graph.

Each splits a step around the force call (``before_forces``, forces and, with ``needs_virial``, the virial,
``after_forces``), works in place on an ``MDState`` (float64, ASE units) and draws random numbers only through
the ``noise(stream, shape)`` it is given (tests feed ASE's draws). The arithmetic between draws and updates is
pure functions (Langevin's halves in ``cgforge.kernels.md_step``, CSVR's factor and the cell scaling in
``cgforge.kernels.md_rescale``), which ``Integrator.fuse(compile)`` compiles; unfused, on CUDA, those modules' kernels
take the half steps (three launches a half step for CSVR and NPT instead of about fifty scalar torch kernels).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from ase import units
from torch import Tensor

from cgforge.kernels.md_rescale import (
    BussiTerms,
    CellRescalingTerms,
    bussi_first,
    bussi_first_reference,
    bussi_second,
    bussi_second_reference,
    cell_scaling,
    cell_volume,
    csvr_factor,
)
from cgforge.kernels.md_step import (
    kinetic,
    langevin_first,
    langevin_first_reference,
    langevin_second,
    langevin_second_reference,
)
from cgforge.kernels.noise import hashed_bits, normal_noise, polar, stream_key

from .options import check_number


@dataclass
class MDState:
    """The engine's state, float64 on the device: positions, momenta, forces [N, 3], energy [], virial [3, 3]
    (sym(dE/d strain); zero unless computed), cell [3, 3] (rows), masses [N, 1], step [] int64, and the
    integrator's own scalars (``extra``: thermostat heat, ...)."""

    positions: Tensor
    momenta: Tensor
    forces: Tensor
    energy: Tensor
    virial: Tensor
    cell: Tensor
    masses: Tensor
    step: Tensor
    extra: dict[str, Tensor] = field(default_factory=dict)


class NoiseSource:
    """Draws for the current step: ``source(stream, shape)`` -> float64 normals of ``shape``. The engine points
    ``step`` at its device step counter; tests may replace a source with one that replays given numbers."""

    def __init__(self, seed: int, step: Tensor) -> None:
        self.seed = int(seed)
        self.step = step

    def __call__(self, stream: int, shape: tuple[int, ...]) -> Tensor:
        return normal_noise(self.seed, self.step, stream, math.prod(shape), self.step.device).view(shape)


class SystemNoise:
    """The draws of a batch of independent systems, system b with its own seed ``seeds[b]``: each system gets
    exactly the numbers that ``NoiseSource(seeds[b], step)`` gives it alone, whatever the batch's other members.

    ``source(stream, shape)``, ``shape`` (..., N, 3) over the batch's atoms end to end (system b owns atoms
    ptr[b] .. ptr[b + 1] - 1): system b's draws at its atoms' rows. ``source.per_system(stream, counts)``: system
    b's ``counts[b]`` draws, the systems' end to end."""

    def __init__(self, seeds: list[int], ptr: list[int], step: Tensor) -> None:
        if len(seeds) != len(ptr) - 1:
            raise ValueError(f"seeds: expected one per system ({len(ptr) - 1}), got {len(seeds)}")
        self.seeds, self.ptr, self.step = [int(s) for s in seeds], list(ptr), step
        self._layouts: dict[tuple, tuple[Tensor, ...]] = {}

    def _layout(self, stream: int, draws: list[Tensor], counts: list[int]) -> tuple[Tensor, ...]:
        """Per output element: its system's stream key, the hashed indices of its radius and angle, and whether it
        is a sine; ``draws[b]``: which of system b's ``counts[b]`` draws each of its elements is."""
        keys, radius, angle, sine = [], [], [], []
        for seed, j, n in zip(self.seeds, draws, counts, strict=True):
            half = (n + 1) // 2  # as normal_noise_reference: cosines of the first half, then sines
            k = torch.where(j < half, j, j - half)
            keys.append(torch.full_like(j, stream_key(seed, int(stream))))
            radius.append(k)
            angle.append(k + half)
            sine.append(j >= half)
        return tuple(torch.cat(parts, -1).reshape(-1) for parts in (keys, radius, angle, sine))

    def _draw(self, cache_key: tuple, make: Callable[[], tuple[Tensor, ...]]) -> Tensor:
        layout = self._layouts.get(cache_key)
        if layout is None:
            layout = self._layouts[cache_key] = make()
        keys, radius_index, angle_index, sine = layout
        radius, angle = polar(hashed_bits(keys, self.step, radius_index), hashed_bits(keys, self.step, angle_index))
        return radius * torch.where(sine, torch.sin(angle), torch.cos(angle))

    def __call__(self, stream: int, shape: tuple[int, ...]) -> Tensor:
        if len(shape) < 2 or tuple(shape[-2:]) != (self.ptr[-1], 3):
            raise ValueError(f"shape: expected (..., {self.ptr[-1]}, 3) over the batch's atoms, got {shape}")
        lead, device = math.prod(shape[:-2]), self.step.device
        sizes = [3 * (end - start) for start, end in zip(self.ptr[:-1], self.ptr[1:])]

        def make() -> tuple[Tensor, ...]:
            # element (l, atom, c) of system b is its draw l * 3 n_b + 3 atom + c, as the system alone lays them
            draws = [torch.arange(lead, device=device)[:, None] * size + torch.arange(size, device=device)
                     for size in sizes]
            return self._layout(stream, draws, [lead * size for size in sizes])

        return self._draw(("atoms", stream, tuple(shape)), make).view(shape)

    def per_system(self, stream: int, counts: list[int]) -> Tensor:
        def make() -> tuple[Tensor, ...]:
            return self._layout(stream, [torch.arange(n, device=self.step.device) for n in counts], list(counts))

        return self._draw(("systems", stream, tuple(counts)), make)


def kinetic_energy(state: MDState) -> Tensor:
    return kinetic(state.momenta, state.masses)


class Integrator:
    """Base: ``bind`` once per run (masses known), then ``before_forces`` / ``after_forces`` per step; these are
    velocity Verlet's (p += dt/2 F; r += dt p/m | forces | p += dt/2 F), which the thermostats wrap."""

    name = "integrator"
    needs_virial = False  # the engine computes the virial every step (NPT)
    changes_cell = False
    temperature_K: float | None = None

    def __init__(self, timestep_fs: float) -> None:
        self.timestep_fs = check_number("timestep_fs", timestep_fs)
        self.dt = self.timestep_fs * units.fs
        self.fuse(None)

    def fuse(self, compile: Callable[[Callable], Callable] | None) -> None:
        """Run the scheme's pure arithmetic through ``compile`` (e.g. ``torch.compile``), or as written (None)."""
        if compile is not None and not callable(compile):
            raise TypeError(f"compile: expected None or a callable such as torch.compile, got {compile!r}")
        self.fused = compile is not None
        self._math = {"_csvr_factor": csvr_factor, "_cell_scaling": cell_scaling,  # as written, or compiled
                      "_langevin_first": langevin_first_reference if compile else langevin_first,
                      "_langevin_second": langevin_second_reference if compile else langevin_second}
        if compile is not None:
            self._math = {name: compile(fn) for name, fn in self._math.items()}

    def params(self) -> dict[str, float | int | bool | str | None]:
        """The physical settings, for a restart's record (and a check that a restart continues the same run)."""
        return {"timestep_fs": self.timestep_fs}

    def bind(self, masses: Tensor) -> None:
        self.masses = masses
        self.n_atoms = int(masses.shape[0])

    def initial_extra(self, device: torch.device) -> dict[str, Tensor]:
        return {}

    def before_forces(self, s: MDState, noise) -> None:
        s.momenta.add_(0.5 * self.dt * s.forces)
        s.positions.add_(self.dt * s.momenta / s.masses)

    def after_forces(self, s: MDState, noise) -> None:
        s.momenta.add_(0.5 * self.dt * s.forces)

    def conserved(self, s: MDState) -> Tensor:
        """The quantity the scheme conserves (NVE: total energy; CSVR: total energy minus the heat put in)."""
        return s.energy + kinetic_energy(s)


class VelocityVerlet(Integrator):
    """NVE: ASE's ``VelocityVerlet``, the same operations (``Integrator``'s step)."""

    name = "velocity_verlet"


class Langevin(Integrator):
    """NVT: ASE's ``Langevin`` scheme (``fixcm=False``), ``friction_per_fs`` in 1/fs as ``run_md`` takes it.

    Per step, with xi, eta = noise(0, (2, N, 3)) (standard normals, xi first as ASE draws them):
        v += c1 F/m - c2 v + (c3 xi - c4 eta);  r' = r + dt v + c5 eta;  v = (r' - r - c5 eta) / dt
        forces at r';  v += c1 F'/m - c2 v + (c3 xi - c4 eta);  p = m v
    with ASE's coefficients c1..c5 (``ase.md.langevin.Langevin.updatevars``)."""

    name = "langevin"

    def __init__(self, timestep_fs: float, temperature_K: float, friction_per_fs: float) -> None:
        super().__init__(timestep_fs)
        self.temperature_K = check_number("temperature_K", temperature_K, strict=False)
        self.friction_per_fs = check_number("friction_per_fs", friction_per_fs, strict=False)

    def params(self) -> dict:
        return {**super().params(), "temperature_K": self.temperature_K, "friction_per_fs": self.friction_per_fs}

    def bind(self, masses: Tensor) -> None:
        super().bind(masses)
        dt, fr, kt = self.dt, self.friction_per_fs / units.fs, units.kB * self.temperature_K
        sigma = torch.sqrt(2 * kt * fr / masses)
        self.c1 = dt / 2.0 - dt * dt * fr / 8.0
        self.c2 = dt * fr / 2 - dt * dt * fr * fr / 8.0
        self.c3 = math.sqrt(dt) * sigma / 2.0 - dt**1.5 * fr * sigma / 8.0
        self.c5 = dt**1.5 * sigma / (2 * math.sqrt(3))
        self.c4 = fr / 2.0 * self.c5

    def before_forces(self, s: MDState, noise) -> None:
        xi, eta = noise(0, (2, self.n_atoms, 3)).unbind(0)  # ASE's order: xi, then eta
        positions, momenta, self._v, self._rnd_vel = self._math["_langevin_first"](
            s.positions, s.momenta, s.forces, s.masses, xi, eta, self.c1, self.c2, self.c3, self.c4, self.c5, self.dt)
        s.positions.copy_(positions)
        s.momenta.copy_(momenta)

    def after_forces(self, s: MDState, noise) -> None:
        s.momenta.copy_(self._math["_langevin_second"](self._v, s.forces, s.masses, self._rnd_vel, self.c1, self.c2))


class CSVR(Integrator):
    """NVT: velocity Verlet with Bussi's stochastic velocity rescaling, half a step (dt/2) each side.

    One rescaling over a time h draws R1 and S = sum of (dof - 1) squared normals and sets
        K' = c K + (1 - c) Kt (R1^2 + S) / dof + 2 R1 sqrt(c (1 - c) K Kt / dof),  c = exp(-h / tau),
    Kt = dof kT / 2; momenta scale by alpha = sign(sqrt(c K) + sqrt((1 - c) Kt / dof) R1) sqrt(K' / K).
    ``dof``: None is 3N - 3 (the total momentum stays zero); 3N under an external field. ``extra['heat']`` sums
    K' - K (``conserved`` = E_pot + E_kin - heat). A system at rest (K = 0) cannot be rescaled."""

    name = "csvr"

    def __init__(self, timestep_fs: float, temperature_K: float, tau_fs: float = 100.0, dof: int | None = None) -> None:
        super().__init__(timestep_fs)
        self.temperature_K = check_number("temperature_K", temperature_K, strict=False)
        self.tau_fs = check_number("tau_fs", tau_fs)
        if dof is not None and (isinstance(dof, bool) or not isinstance(dof, int) or dof < 2):
            raise ValueError(f"dof: expected None or an int >= 2, got {dof!r}")
        self.dof_requested = dof

    def params(self) -> dict:
        return {**super().params(), "temperature_K": self.temperature_K, "tau_fs": self.tau_fs,
                "dof": self.dof_requested}

    def bind(self, masses: Tensor) -> None:
        super().bind(masses)
        self.dof = self.dof_requested or max(3 * self.n_atoms - 3, 2)
        self.target_kinetic = 0.5 * self.dof * units.kB * self.temperature_K
        self.c = math.exp(-0.5 * self.timestep_fs / self.tau_fs)
        self.bussi = BussiTerms(self.c, self.target_kinetic / self.dof)

    def initial_extra(self, device: torch.device) -> dict[str, Tensor]:
        return {"heat": torch.zeros((), dtype=torch.float64, device=device)}

    def before_forces(self, s: MDState, noise) -> None:
        args = (s.positions, s.momenta, s.forces, s.masses, s.extra["heat"], noise(0, (self.dof,)), self.bussi, self.dt)
        if self.fused:
            bussi_first_reference(*args, factor=self._math["_csvr_factor"])
        else:
            bussi_first(*args)

    def after_forces(self, s: MDState, noise) -> None:
        args = (s.momenta, s.forces, s.masses, s.extra["heat"], noise(1, (self.dof,)), self.bussi, self.dt)
        if self.fused:
            bussi_second_reference(*args, factor=self._math["_csvr_factor"])
        else:
            bussi_second(*args)

    def conserved(self, s: MDState) -> Tensor:
        return s.energy + kinetic_energy(s) - s.extra["heat"]


class StochasticCellRescaling(CSVR):
    """NPT: Bernetti-Bussi stochastic cell rescaling (C-rescale) with the CSVR thermostat.

    The pressure tensor is P = (sum p (x) p / m - W) / V, W = sym(dE/d strain) (the model's virial). Once per
    step, from the state at its start (GROMACS's placement), the log-volume eps = ln V moves by (Itô)
        d eps = (beta / tau_p) (P - P0) dt + sqrt(2 kT beta dt / (V tau_p)) R
    and positions, cell and momenta scale by mu = exp(d eps / 3), mu, 1 / mu. Anisotropic: each Cartesian axis a
    has its own log-length x_a with d x_a = (beta / (3 tau_p)) (P_aa - P0) dt + sqrt(2 kT beta dt / (3 V tau_p)) R_a
    (the axes' sum is the isotropic equation; the cell's columns scale: no shear).

    pressure_GPa: P0. compressibility_per_GPa: beta (only beta / tau_p matters). tau_p_fs: the barostat's
    relaxation time. tau_fs, dof: the thermostat's (``CSVR``).
    """

    name = "stochastic_cell_rescaling"
    needs_virial = True
    changes_cell = True

    def __init__(self, timestep_fs: float, temperature_K: float, pressure_GPa: float = 1e-4, *,
                 tau_fs: float = 100.0, tau_p_fs: float = 1000.0, compressibility_per_GPa: float = 0.45,
                 anisotropic: bool = False, dof: int | None = None) -> None:
        super().__init__(timestep_fs, temperature_K, tau_fs, dof)
        self.pressure_GPa = check_number("pressure_GPa", pressure_GPa, minimum=None)
        self.tau_p_fs = check_number("tau_p_fs", tau_p_fs)
        self.compressibility_per_GPa = check_number("compressibility_per_GPa", compressibility_per_GPa)
        self.anisotropic = bool(anisotropic)

    def params(self) -> dict:
        return {**super().params(), "pressure_GPa": self.pressure_GPa, "tau_p_fs": self.tau_p_fs,
                "compressibility_per_GPa": self.compressibility_per_GPa, "anisotropic": self.anisotropic}

    def bind(self, masses: Tensor) -> None:
        super().bind(masses)
        self.p0 = self.pressure_GPa * units.GPa
        self.beta = self.compressibility_per_GPa / units.GPa
        self.kt = units.kB * self.temperature_K
        self.rate = self.beta / (self.tau_p_fs * units.fs)  # beta / tau_p, Å^3 / (eV ASE-time)
        self.barostat = CellRescalingTerms(self.rate, self.kt, self.dt, self.p0, self.anisotropic)

    def before_forces(self, s: MDState, noise) -> None:
        # mu from the state at the step's start (pressure and volume), applied after the thermostat and the drift
        cell_draws = noise(2, (3,) if self.anisotropic else (1,))
        args = (s.positions, s.momenta, s.forces, s.masses, s.extra["heat"], noise(0, (self.dof,)), self.bussi, self.dt,
                s.cell, s.virial, cell_draws, self.barostat)
        if self.fused:
            bussi_first_reference(*args, factor=self._math["_csvr_factor"], scaling=self._math["_cell_scaling"])
        else:
            bussi_first(*args)

    def conserved(self, s: MDState) -> Tensor:
        """E_pot + E_kin + P0 V - heat (the barostat's own work is not tracked: not a conserved quantity)."""
        return super().conserved(s) + self.p0 * cell_volume(s.cell)
