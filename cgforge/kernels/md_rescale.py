"""Bussi's stochastic velocity rescaling (CSVR) and Bernetti-Bussi stochastic cell rescaling: the half steps of the
engine's CSVR and NPT integrators (``cgforge.plugin.md.integrators``) as torch expressions (``*_reference``: the CPU
path, what torch.compile traces and what the kernels are tested against) and as three CUDA kernels a half step,
where the torch expressions are about fifty scalar kernels; ``bussi_first`` and ``bussi_second`` pick one. In
place, on float64 arrays (momenta, forces, positions [N, 3], masses [N, 1], heat and the cell's [3, 3]):

    first:  mu from the step's start (with a barostat), p *= alpha, heat += (alpha^2 - 1) K, p += dt/2 F,
            r += dt p / m, then r *= mu, cell *= mu (columns), p /= mu;
    second: p += dt/2 F, then p *= alpha, heat += (alpha^2 - 1) K.

alpha is Bussi's factor from K = sum p^2 / 2m and the draws (``csvr_alpha``), mu the cell scaling from the pressure
tensor's diagonal (``cell_scaling_factor``). The kernels:

    sums:   S_a = sum over atoms of p_a^2 / m (a = x, y, z; after an optional kick p += kick F) and
            R = sum of draws[1:]^2, as partial sums per warp (a fixed order for a given N: bits repeat);
    finish: one warp: K = (S_x + S_y + S_z) / 2, alpha from K, draws[0] and R, heat += (alpha^2 - 1) K;
            with a barostat, from the same S (the step's start) the pressure's diagonal P_aa = (S_a - W_aa) / V and
            mu [3] (isotropic or per axis), cell columns scaled by mu; writes (alpha, mu_x, mu_y, mu_z);
    apply:  per element p *= alpha, then optionally p += kick F and r += dt p / m, then r *= mu_a, p /= mu_a.

They agree with the torch expressions to rounding (fused multiply-adds, the sums' order), not bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .core.launch import thread_blocks
from .core.registry import SourceKernels
from .md_step import _on_step_kernels, _state_arrays, commit_plan, kinetic

__all__ = ["BussiTerms", "CellRescalingTerms", "MD_RESCALE_SOURCE", "bussi_first", "bussi_first_cuda",
           "bussi_first_reference", "bussi_second", "bussi_second_cuda", "bussi_second_reference", "cell_scaling",
           "cell_scaling_factor", "cell_volume", "csvr_alpha", "csvr_factor", "pressure_tensor"]

MD_RESCALE_SOURCE = r"""
// Warp w sums elements [w * per_warp, (w + 1) * per_warp) of the flat [n, 3] momenta, each kicked first when
// kick != 0 (p += kick f, written back), per Cartesian axis p^2 / m, and the squares of draws[1 + j] over the same
// range of j < n_rest: 4 doubles a warp.
extern "C" __global__ void rescale_partials(
        double* __restrict__ p, const double* __restrict__ f, const double* __restrict__ masses, double kick,
        long long n3, const double* __restrict__ draws, long long n_rest, long long per_warp, long long warps,
        double* __restrict__ partials) {
    const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x & 31;
    if (warp >= warps) return;  // whole warps only: the butterfly below needs all 32 lanes
    const long long first = warp * per_warp, last = first + per_warp;
    double axis[3] = {0.0, 0.0, 0.0}, rest = 0.0;
    for (long long i = first + lane; i < min(last, n3); i += 32) {
        double pi = p[i];
        if (kick != 0.0) {
            pi = pi + kick * f[i];
            p[i] = pi;
        }
        const double term = pi * pi / masses[i / 3];
        const int a = (int)(i % 3);
        axis[0] += a == 0 ? term : 0.0;
        axis[1] += a == 1 ? term : 0.0;
        axis[2] += a == 2 ? term : 0.0;
    }
    for (long long j = first + lane; j < min(last, n_rest); j += 32) rest += draws[1 + j] * draws[1 + j];
    for (int lanes = 16; lanes > 0; lanes /= 2) {
        axis[0] += __shfl_xor_sync(0xffffffffu, axis[0], lanes);
        axis[1] += __shfl_xor_sync(0xffffffffu, axis[1], lanes);
        axis[2] += __shfl_xor_sync(0xffffffffu, axis[2], lanes);
        rest += __shfl_xor_sync(0xffffffffu, rest, lanes);
    }
    if (lane == 0) {
        partials[4 * warp + 0] = axis[0];
        partials[4 * warp + 1] = axis[1];
        partials[4 * warp + 2] = axis[2];
        partials[4 * warp + 3] = rest;
    }
}

__device__ __forceinline__ double sign_of(double x) { return (double)((x > 0.0) - (x < 0.0)); }

// One warp: the partials summed; Bussi's alpha and the heat it puts in; with a barostat (1 isotropic,
// 2 per axis) mu from the same sums (the step's start), the cell's columns scaled. factors: alpha, mu[3].
extern "C" __global__ void rescale_finish(
        const double* __restrict__ partials, long long warps, const double* __restrict__ draws, double c,
        double kt_per_dof, double sqrt_c, double sqrt_kick, double* __restrict__ heat, int barostat,
        const double* __restrict__ cell_draws, const double* __restrict__ virial, double* __restrict__ cell,
        double rate, double kt, double dt, double p0, double* __restrict__ factors) {
    const int lane = threadIdx.x & 31;
    double axis[3] = {0.0, 0.0, 0.0}, rest = 0.0;
    for (long long w = lane; w < warps; w += 32) {
        axis[0] += partials[4 * w + 0];
        axis[1] += partials[4 * w + 1];
        axis[2] += partials[4 * w + 2];
        rest += partials[4 * w + 3];
    }
    for (int lanes = 16; lanes > 0; lanes /= 2) {
        axis[0] += __shfl_xor_sync(0xffffffffu, axis[0], lanes);
        axis[1] += __shfl_xor_sync(0xffffffffu, axis[1], lanes);
        axis[2] += __shfl_xor_sync(0xffffffffu, axis[2], lanes);
        rest += __shfl_xor_sync(0xffffffffu, rest, lanes);
    }
    if (lane != 0) return;
    const double k = 0.5 * (axis[0] + axis[1] + axis[2]);
    const double r1 = draws[0];
    const double target = c * k + (1.0 - c) * kt_per_dof * (r1 * r1 + rest)
                          + 2.0 * r1 * sqrt(c * (1.0 - c) * k * kt_per_dof);
    const double alpha = k > 0.0 ? sign_of(sqrt_c * sqrt(k) + sqrt_kick * r1) * sqrt(target / fmax(k, 1e-300)) : 1.0;
    heat[0] += (alpha * alpha - 1.0) * k;
    double mu[3] = {1.0, 1.0, 1.0};
    if (barostat != 0) {
        // |det(cell)| as the triple product cell[0] . (cell[1] x cell[2]) (rows)
        const double v = fabs(cell[0] * (cell[4] * cell[8] - cell[5] * cell[7])
                              + cell[1] * (cell[5] * cell[6] - cell[3] * cell[8])
                              + cell[2] * (cell[3] * cell[7] - cell[4] * cell[6]));
        double pressure[3];
        for (int a = 0; a < 3; ++a) pressure[a] = (axis[a] - virial[4 * a]) / v;
        if (barostat == 2) {
            const double width = sqrt(2.0 * kt * rate * dt / (3.0 * v));
            for (int a = 0; a < 3; ++a) mu[a] = exp((rate / 3.0) * (pressure[a] - p0) * dt + width * cell_draws[a]);
        } else {
            const double mean = (pressure[0] + pressure[1] + pressure[2]) / 3.0;
            const double m = exp((rate * (mean - p0) * dt + sqrt(2.0 * kt * rate * dt / v) * cell_draws[0]) / 3.0);
            mu[0] = mu[1] = mu[2] = m;
        }
        for (int row = 0; row < 3; ++row)
            for (int a = 0; a < 3; ++a) cell[3 * row + a] *= mu[a];
    }
    factors[0] = alpha;
    factors[1] = mu[0];
    factors[2] = mu[1];
    factors[3] = mu[2];
}

// A thread per element of the [n, 3] arrays: p *= alpha; with drift != 0 velocity Verlet's kick and drift
// (p += kick f; r += drift p / m); then r *= mu_a, p /= mu_a (a barostat's mu, else 1).
extern "C" __global__ void rescale_apply(
        double* __restrict__ r, double* __restrict__ p, const double* __restrict__ f,
        const double* __restrict__ masses, const double* __restrict__ factors, double kick, double drift,
        long long n3) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n3) return;
    const double mu = factors[1 + i % 3];
    double pi = p[i] * factors[0];
    if (drift != 0.0) {
        pi = pi + kick * f[i];
        r[i] = (r[i] + drift * pi / masses[i / 3]) * mu;
    } else if (mu != 1.0) {
        r[i] = r[i] * mu;
    }
    p[i] = pi / mu;
}
"""

_KERNELS = SourceKernels(MD_RESCALE_SOURCE, ["rescale_partials", "rescale_finish", "rescale_apply"], "md_rescale")
_THREADS = 128


@dataclass(frozen=True)
class BussiTerms:
    """One Bussi rescaling over a time h: c = exp(-h / tau), kT per degree of freedom (``CSVR``)."""

    c: float
    kt_per_dof: float


@dataclass(frozen=True)
class CellRescalingTerms:
    """Stochastic cell rescaling's constants (``StochasticCellRescaling``): rate = beta / tau_p, kT, dt, P0, and
    whether each axis has its own log-length (else isotropic)."""

    rate: float
    kt: float
    dt: float
    p0: float
    anisotropic: bool


def _rescale(positions: Tensor, momenta: Tensor, forces: Tensor, masses: Tensor, heat: Tensor, draws: Tensor,
             bussi: BussiTerms, sum_kick: float, apply_kick: float, drift: float, cell: Tensor | None = None,
             virial: Tensor | None = None, cell_draws: Tensor | None = None,
             barostat: CellRescalingTerms | None = None) -> None:
    device, n3 = momenta.device, momenta.numel()
    n_rest = draws.numel() - 1
    per_warp, warps = commit_plan(max(n3, n_rest, 1))
    partials = torch.empty(4 * warps, dtype=torch.float64, device=device)
    factors = torch.empty(4, dtype=torch.float64, device=device)
    _KERNELS.get("rescale_partials", device).launch(
        (-(-warps * 32 // _THREADS),), (_THREADS,),
        [momenta, forces, masses, np.float64(sum_kick), np.int64(n3), draws, np.int64(n_rest), np.int64(per_warp),
         np.int64(warps), partials])
    c, kt_per_dof = bussi.c, bussi.kt_per_dof
    mode = 0 if barostat is None else 2 if barostat.anisotropic else 1
    b = barostat or CellRescalingTerms(0.0, 0.0, 0.0, 0.0, False)
    unused = factors  # a valid pointer where there is no barostat (never read)
    _KERNELS.get("rescale_finish", device).launch(
        (1,), (32,),
        [partials, np.int64(warps), draws, np.float64(c), np.float64(kt_per_dof), np.float64(np.sqrt(c)),
         np.float64(np.sqrt((1 - c) * kt_per_dof)), heat, np.int32(mode),
         unused if cell_draws is None else cell_draws, unused if virial is None else virial,
         unused if cell is None else cell, np.float64(b.rate), np.float64(b.kt), np.float64(b.dt), np.float64(b.p0),
         factors])
    if n3:
        _KERNELS.get("rescale_apply", device).launch(
            (thread_blocks(n3, _THREADS),), (_THREADS,),
            [positions, momenta, forces, masses, factors, np.float64(apply_kick), np.float64(drift), np.int64(n3)])


def bussi_first_cuda(positions: Tensor, momenta: Tensor, forces: Tensor, masses: Tensor, heat: Tensor,
                     draws: Tensor, bussi: BussiTerms, dt: float, cell: Tensor | None = None,
                     virial: Tensor | None = None, cell_draws: Tensor | None = None,
                     barostat: CellRescalingTerms | None = None) -> None:
    """CSVR's first half in place (``CSVR.before_forces``): momenta rescaled by Bussi's alpha (``draws`` [dof]
    standard normals), heat += (alpha^2 - 1) K, velocity Verlet's kick (dt / 2) and drift (dt); with ``barostat``
    (``StochasticCellRescaling.before_forces``) mu from the start state (``virial``, ``cell``, ``cell_draws`` [3]
    or [1]), then positions and cell scaled by mu, momenta by 1 / mu. Three kernels."""
    arrays = {"positions": positions, "momenta": momenta, "forces": forces, "masses": masses, "heat": heat,
              "draws": draws}  # checked in this order (an error names the argument's position)
    if barostat is not None:
        if cell is None or virial is None or cell_draws is None:
            raise ValueError("bussi_first_cuda: a barostat needs cell, virial and cell_draws")
        if cell_draws.numel() != (3 if barostat.anisotropic else 1) or cell.numel() != 9 or virial.numel() != 9:
            raise ValueError(f"bussi_first_cuda: expected cell [3, 3], virial [3, 3] and cell_draws of "
                             f"{3 if barostat.anisotropic else 1}, got {tuple(cell.shape)}, {tuple(virial.shape)}, "
                             f"{tuple(cell_draws.shape)}")
        arrays |= {"cell": cell, "virial": virial, "cell_draws": cell_draws}
    _state_arrays("bussi_first_cuda", *arrays.values())
    _rescale(positions, momenta, forces, masses, heat, draws, bussi, 0.0, 0.5 * dt, dt, cell, virial, cell_draws,
             barostat)


def bussi_second_cuda(momenta: Tensor, forces: Tensor, masses: Tensor, heat: Tensor, draws: Tensor,
                      bussi: BussiTerms, dt: float) -> None:
    """CSVR's second half in place (``CSVR.after_forces``): velocity Verlet's kick (dt / 2), then the momenta
    rescaled by Bussi's alpha (``draws`` [dof]) and heat += (alpha^2 - 1) K. Three kernels."""
    _state_arrays("bussi_second_cuda", momenta, forces, masses, heat, draws)
    _rescale(momenta, momenta, forces, masses, heat, draws, bussi, 0.5 * dt, 0.0, 0.0)


# The torch expressions: the references, the CPU path, and what torch.compile fuses.


def cell_volume(cell: Tensor) -> Tensor:
    """|det(cell)| as a triple product (elementwise ops: safe in a CUDA-graph capture, unlike an LU)."""
    return torch.dot(cell[0], torch.linalg.cross(cell[1], cell[2])).abs()


def pressure_tensor(momenta: Tensor, masses: Tensor, virial: Tensor, volume: Tensor) -> Tensor:
    """The pressure tensor (sum p (x) p / m - W) / V."""
    return ((momenta / masses).T @ momenta - virial) / volume


def csvr_factor(momenta: Tensor, masses: Tensor, draws: Tensor, c: float, kt_per_dof: float
                ) -> tuple[Tensor, Tensor]:
    """Bussi's rescaling factor alpha for the momenta and the heat it puts in, (alpha^2 - 1) K."""
    return csvr_alpha(kinetic(momenta, masses), draws[0], draws[1:].square().sum(), c, kt_per_dof,
                      math.sqrt(c), math.sqrt((1 - c) * kt_per_dof))


def csvr_alpha(kinetic_now: Tensor, r1: Tensor, rest: Tensor, c: float | Tensor, kt_per_dof: float | Tensor,
               sqrt_c: float | Tensor, sqrt_kick: float | Tensor) -> tuple[Tensor, Tensor]:
    """``csvr_factor`` from the kinetic energy K, the first draw R1 and the sum S of the other draws' squares,
    elementwise: of one system, or of a batch's systems ([B] tensors, with c, kt_per_dof and the square roots
    sqrt(c), sqrt((1 - c) kt_per_dof) per system)."""
    new = (c * kinetic_now + (1 - c) * kt_per_dof * (r1 * r1 + rest)
           + 2 * r1 * torch.sqrt(c * (1 - c) * kinetic_now * kt_per_dof))
    sign = torch.sign(sqrt_c * torch.sqrt(kinetic_now) + sqrt_kick * r1)
    alpha = torch.where(kinetic_now > 0, sign * torch.sqrt(new / kinetic_now.clamp(min=1e-300)), 1.0)
    return alpha, (alpha * alpha - 1) * kinetic_now


def cell_scaling(momenta: Tensor, masses: Tensor, virial: Tensor, cell: Tensor, draws: Tensor, rate: float,
                 kt: float, dt: float, p0: float, anisotropic: bool) -> Tensor:
    """Stochastic cell rescaling's factor mu [3] per Cartesian axis from the step's start state; ``draws`` [3]
    standard normals (the isotropic scheme reads the first)."""
    v = cell_volume(cell)
    return cell_scaling_factor(torch.diagonal(pressure_tensor(momenta, masses, virial, v)), v, draws, rate, kt, dt,
                               p0, anisotropic)


def cell_scaling_factor(pressure_diagonal: Tensor, v: Tensor, draws: Tensor, rate: float, kt: float | Tensor,
                        dt: float, p0: float, anisotropic: bool) -> Tensor:
    """``cell_scaling`` from the pressure tensor's diagonal [..., 3] and the volume [...]: of one system, or of
    a batch's systems ([B, 3], [B], with ``kt`` and ``draws`` [B, 3] or [B, 1] per system); mu [..., 3]."""
    if anisotropic:
        drift = (rate / 3) * (pressure_diagonal - p0) * dt
        return torch.exp(drift + torch.sqrt(2 * kt * rate * dt / (3 * v))[..., None] * draws)
    drift = rate * (pressure_diagonal.mean(-1) - p0) * dt
    mu = torch.exp((drift + torch.sqrt(2 * kt * rate * dt / v) * draws[..., 0]) / 3)
    return mu[..., None].expand(*draws.shape[:-1], 3)


Factor = Callable[..., tuple[Tensor, Tensor]]


def bussi_first_reference(positions: Tensor, momenta: Tensor, forces: Tensor, masses: Tensor, heat: Tensor,
                          draws: Tensor, bussi: BussiTerms, dt: float, cell: Tensor | None = None,
                          virial: Tensor | None = None, cell_draws: Tensor | None = None,
                          barostat: CellRescalingTerms | None = None, *, factor: Factor = csvr_factor,
                          scaling: Callable[..., Tensor] = cell_scaling) -> None:
    """``bussi_first_cuda``'s half step as torch operations, in place; ``factor`` and ``scaling`` the arithmetic
    (``csvr_factor``, ``cell_scaling``, or those compiled)."""
    mu = None
    if barostat is not None:  # from the step's start state
        b = barostat
        mu = scaling(momenta, masses, virial, cell, cell_draws, b.rate, b.kt, b.dt, b.p0, b.anisotropic)
    alpha, heat_in = factor(momenta, masses, draws, bussi.c, bussi.kt_per_dof)
    momenta.mul_(alpha)
    heat.add_(heat_in)
    momenta.add_(0.5 * dt * forces)
    positions.add_(dt * momenta / masses)
    if mu is not None:
        positions.mul_(mu)
        cell.mul_(mu)
        momenta.div_(mu)


def bussi_second_reference(momenta: Tensor, forces: Tensor, masses: Tensor, heat: Tensor, draws: Tensor,
                           bussi: BussiTerms, dt: float, *, factor: Factor = csvr_factor) -> None:
    """``bussi_second_cuda``'s half step as torch operations, in place."""
    momenta.add_(0.5 * dt * forces)
    alpha, heat_in = factor(momenta, masses, draws, bussi.c, bussi.kt_per_dof)
    momenta.mul_(alpha)
    heat.add_(heat_in)


def _on_kernels(*tensors: Tensor | None) -> bool:
    """md_step's rule (contiguous float64 CUDA arrays, no tracing) over the arrays a half step is given."""
    return _on_step_kernels(*(t for t in tensors if t is not None))


def bussi_first(positions: Tensor, momenta: Tensor, forces: Tensor, masses: Tensor, heat: Tensor, draws: Tensor,
                bussi: BussiTerms, dt: float, cell: Tensor | None = None, virial: Tensor | None = None,
                cell_draws: Tensor | None = None, barostat: CellRescalingTerms | None = None) -> None:
    """``bussi_first_reference``, three kernels on CUDA."""
    args = (positions, momenta, forces, masses, heat, draws, bussi, dt, cell, virial, cell_draws, barostat)
    if _on_kernels(positions, momenta, forces, masses, heat, draws, cell, virial, cell_draws):
        bussi_first_cuda(*args)
    else:
        bussi_first_reference(*args)


def bussi_second(momenta: Tensor, forces: Tensor, masses: Tensor, heat: Tensor, draws: Tensor, bussi: BussiTerms,
                 dt: float) -> None:
    """``bussi_second_reference``, three kernels on CUDA."""
    if _on_kernels(momenta, forces, masses, heat, draws):
        bussi_second_cuda(momenta, forces, masses, heat, draws, bussi, dt)
    else:
        bussi_second_reference(momenta, forces, masses, heat, draws, bussi, dt)
