"""The MD engine's arithmetic around the force call as CUDA kernels: ASE's Langevin halves (one elementwise
kernel each) and the engine's commit check (partial sums per warp, then one warp that finishes).

The torch expressions (``*_reference``) are the references, the CPU path and what torch.compile traces;
``langevin_first``, ``langevin_second`` and ``commit_check`` take the kernels on CUDA outside torch.compile. All
arrays are float64: positions, momenta, forces [N, 3]; masses and the Langevin coefficients c3, c4, c5 [N, 1]. Per
element, xi and eta the step's standard normals:

    first:  v = p/m + (c1 F/m - c2 p/m + c3 xi - c4 eta);  r' = r + dt v + c5 eta;  v = (r' - r - c5 eta)/dt
    second: p = (v + (c1 F/m - c2 v + rnd_vel)) m          (rnd_vel = c3 xi - c4 eta, kept from the first)

The commit check's partial sums run in a fixed order for a given N (bits repeat from run to run); the kernels
agree with the torch expressions to rounding (fused multiply-adds), not bit for bit.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from .core.launch import thread_blocks
from .core.registry import SourceKernels

__all__ = ["COMMIT_REPORT", "MD_STEP_SOURCE", "commit_check", "commit_check_cuda", "commit_check_reference",
           "commit_plan", "kinetic", "langevin_first", "langevin_first_cuda", "langevin_first_reference",
           "langevin_second", "langevin_second_cuda", "langevin_second_reference"]

# The commit report's fields, one float64 each, in the order the finishing kernel writes them.
COMMIT_REPORT = ("committed", "stopped", "stale", "overflow", "blow_kind", "blow_step", "blow_value", "count_max",
                 "slack", "temperature")

MD_STEP_SOURCE = r"""
// ASE's Langevin first half: a thread per element of the [n, 3] arrays, coefficients c3..c5 and masses per atom.
extern "C" __global__ void langevin_first(
        const double* __restrict__ r, const double* __restrict__ p, const double* __restrict__ f,
        const double* __restrict__ masses, const double* __restrict__ xi, const double* __restrict__ eta,
        const double* __restrict__ c3, const double* __restrict__ c4, const double* __restrict__ c5,
        double c1, double c2, double dt, long long n3,
        double* __restrict__ r_out, double* __restrict__ p_out, double* __restrict__ v_out,
        double* __restrict__ rnd_vel_out) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n3) return;
    const long long atom = i / 3;
    const double m = masses[atom];
    const double rnd_pos = c5[atom] * eta[i];
    const double rnd_vel = c3[atom] * xi[i] - c4[atom] * eta[i];
    double v = p[i] / m;
    v = v + (c1 * f[i] / m - c2 * v + rnd_vel);
    const double moved = r[i] + dt * v + rnd_pos;
    v = (moved - r[i] - rnd_pos) / dt;  // as ASE: the velocity the drift implies
    r_out[i] = moved;
    p_out[i] = v * m;
    v_out[i] = v;
    rnd_vel_out[i] = rnd_vel;
}

// ASE's Langevin second half, after the force call.
extern "C" __global__ void langevin_second(
        const double* __restrict__ v, const double* __restrict__ f, const double* __restrict__ masses,
        const double* __restrict__ rnd_vel, double c1, double c2, long long n3, double* __restrict__ p_out) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n3) return;
    const double m = masses[i / 3];
    p_out[i] = (v[i] + (c1 * f[i] / m - c2 * v[i] + rnd_vel[i])) * m;
}

// The commit check's sums: warp w takes elements [w * per_warp, (w + 1) * per_warp) of the flat [n, 3] arrays
// and writes 4 doubles: sum p^2/m, max |F| over the forces that are not NaN, any force not finite, any NaN.
extern "C" __global__ void commit_partials(
        const double* __restrict__ p, const double* __restrict__ masses, const double* __restrict__ f,
        long long n3, long long per_warp, long long warps, double* __restrict__ partials) {
    const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x & 31;
    if (warp >= warps) return;  // whole warps only: the butterfly below needs all 32 lanes
    const long long end = min((warp + 1) * per_warp, n3);
    double twice_kinetic = 0.0, largest = 0.0, nonfinite = 0.0, nan = 0.0;
    for (long long i = warp * per_warp + lane; i < end; i += 32) {
        twice_kinetic += p[i] * p[i] / masses[i / 3];
        const double size = fabs(f[i]);
        if (!isfinite(size)) nonfinite = 1.0;
        if (isnan(size)) nan = 1.0; else largest = fmax(largest, size);
    }
    for (int lanes = 16; lanes > 0; lanes /= 2) {
        twice_kinetic += __shfl_xor_sync(0xffffffffu, twice_kinetic, lanes);
        largest = fmax(largest, __shfl_xor_sync(0xffffffffu, largest, lanes));
        nonfinite = fmax(nonfinite, __shfl_xor_sync(0xffffffffu, nonfinite, lanes));
        nan = fmax(nan, __shfl_xor_sync(0xffffffffu, nan, lanes));
    }
    if (lane == 0) {
        partials[4 * warp + 0] = twice_kinetic;
        partials[4 * warp + 1] = largest;
        partials[4 * warp + 2] = nonfinite;
        partials[4 * warp + 3] = nan;
    }
}

// One warp: the partials summed, then the step judged and the block's report updated (commit_step's rule).
// report / report_out: committed, stopped, stale, overflow, blow_kind, blow_step, blow_value, count_max, slack,
// temperature.
extern "C" __global__ void commit_finish(
        const double* __restrict__ partials, long long warps, const double* __restrict__ energy,
        const long long* __restrict__ step, const unsigned char* __restrict__ stale,
        const unsigned char* __restrict__ overflow, const long long* __restrict__ count,
        const double* __restrict__ slack, const double* __restrict__ report, double temperature_denominator,
        double max_temperature, unsigned char* __restrict__ bad_out, long long* __restrict__ step_out,
        double* __restrict__ report_out) {
    const int lane = threadIdx.x & 31;
    double twice_kinetic = 0.0, largest = 0.0, nonfinite = 0.0, nan = 0.0;
    for (long long w = lane; w < warps; w += 32) {
        twice_kinetic += partials[4 * w + 0];
        largest = fmax(largest, partials[4 * w + 1]);
        nonfinite = fmax(nonfinite, partials[4 * w + 2]);
        nan = fmax(nan, partials[4 * w + 3]);
    }
    for (int lanes = 16; lanes > 0; lanes /= 2) {
        twice_kinetic += __shfl_xor_sync(0xffffffffu, twice_kinetic, lanes);
        largest = fmax(largest, __shfl_xor_sync(0xffffffffu, largest, lanes));
        nonfinite = fmax(nonfinite, __shfl_xor_sync(0xffffffffu, nonfinite, lanes));
        nan = fmax(nan, __shfl_xor_sync(0xffffffffu, nan, lanes));
    }
    if (lane != 0) return;
    const double temperature = 0.5 * twice_kinetic / temperature_denominator;
    const double e = energy[0];
    const bool bad_energy = !isfinite(e), bad_forces = nonfinite > 0.0;
    const bool hot = !(temperature <= max_temperature);
    const double kind = bad_energy ? 1.0 : bad_forces ? 2.0 : hot ? 3.0 : 0.0;
    const double value = bad_energy ? e : bad_forces ? (nan > 0.0 ? ::nan("") : largest) : temperature;
    const bool invalid = stale[0] || overflow[0];
    const bool blow = !invalid && kind > 0.0;
    const bool fresh = !(report[1] > 0.0);  // no earlier step of the block stopped it
    const bool bad = !fresh || invalid || blow;
    const bool new_blow = blow && fresh;
    const double good = bad ? 0.0 : 1.0;
    report_out[0] = report[0] + good;
    report_out[1] = bad ? 1.0 : 0.0;
    report_out[2] = (report[2] > 0.0 || (stale[0] && fresh)) ? 1.0 : 0.0;
    report_out[3] = (report[3] > 0.0 || (overflow[0] && fresh)) ? 1.0 : 0.0;
    report_out[4] = new_blow ? kind : report[4];
    report_out[5] = new_blow ? (double)(step[0] + 1) : report[5];
    report_out[6] = new_blow ? value : report[6];
    report_out[7] = fmax(report[7], fresh ? (double)count[0] : 0.0);
    report_out[8] = bad ? report[8] : slack[0];
    report_out[9] = bad ? report[9] : temperature;
    bad_out[0] = bad ? 1 : 0;
    step_out[0] = step[0] + (bad ? 0 : 1);
}
"""

_KERNELS = SourceKernels(MD_STEP_SOURCE, ["langevin_first", "langevin_second", "commit_partials", "commit_finish"],
                         "md_step")
_THREADS = 128
_MAX_WARPS = 1024  # the finishing warp's loop stays short at any N
_MIN_PER_WARP = 256  # elements a warp sums at least (8 a lane): a 5,184-atom box takes 61 warps


def commit_plan(n3: int) -> tuple[int, int]:
    """(elements a warp sums, warps) for ``n3`` elements: a multiple of 32 per warp, at most 1024 warps."""
    per_warp = max(_MIN_PER_WARP, -(-n3 // _MAX_WARPS))
    per_warp = -(-per_warp // 32) * 32
    return per_warp, max(1, -(-n3 // per_warp))


def _state_arrays(name: str, *arrays: Tensor) -> None:
    for i, a in enumerate(arrays):
        if a.dtype != torch.float64 or not a.is_cuda or not a.is_contiguous():
            raise ValueError(f"{name}: argument {i} must be a contiguous float64 CUDA tensor, got {a.dtype} on "
                             f"{a.device}{'' if a.is_contiguous() else ' (not contiguous)'}")


def _grid(n3: int) -> tuple[int]:
    return (thread_blocks(n3, _THREADS),)


def langevin_first_cuda(positions: Tensor, momenta: Tensor, forces: Tensor, masses: Tensor, xi: Tensor,
                        eta: Tensor, c1: float, c2: float, c3: Tensor, c4: Tensor, c5: Tensor, dt: float
                        ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """ASE's Langevin first half in one kernel: (positions, momenta, v, random velocity) after the drift."""
    _state_arrays("langevin_first_cuda", positions, momenta, forces, masses, xi, eta, c3, c4, c5)
    n3 = positions.numel()
    out = torch.empty((4, *positions.shape), dtype=torch.float64, device=positions.device)
    if n3:
        _KERNELS.get("langevin_first", positions.device).launch(
            _grid(n3), (_THREADS,), [positions, momenta, forces, masses, xi, eta, c3, c4, c5, np.float64(c1),
                                     np.float64(c2), np.float64(dt), np.int64(n3), out[0], out[1], out[2], out[3]])
    return out[0], out[1], out[2], out[3]


def langevin_second_cuda(v: Tensor, forces: Tensor, masses: Tensor, rnd_vel: Tensor, c1: float, c2: float) -> Tensor:
    """ASE's Langevin second half in one kernel: the momenta after the force call."""
    _state_arrays("langevin_second_cuda", v, forces, masses, rnd_vel)
    n3 = v.numel()
    out = torch.empty_like(v)
    if n3:
        _KERNELS.get("langevin_second", v.device).launch(
            _grid(n3), (_THREADS,), [v, forces, masses, rnd_vel, np.float64(c1), np.float64(c2), np.int64(n3), out])
    return out


def commit_check_cuda(energy: Tensor, forces: Tensor, momenta: Tensor, masses: Tensor, step: Tensor,
                      stale: Tensor, overflow: Tensor, count: Tensor, slack: Tensor, report: Tensor,
                      temperature_denominator: float, max_temperature: float) -> tuple[Tensor, Tensor, Tensor]:
    """The engine's commit check in two kernels: (bad [] bool, step [] int64, report [10] float64), the same
    values as ``commit_check_reference`` (module doc). energy, slack: float64 0-d; step, count:
    int64 0-d; stale, overflow: bool 0-d; report: float64 [10]; temperature = sum p^2/m / 2 / the denominator."""
    _state_arrays("commit_check_cuda", forces, momenta, masses, energy, slack, report)
    for name, t, dtype in (("step", step, torch.int64), ("count", count, torch.int64), ("stale", stale, torch.bool),
                           ("overflow", overflow, torch.bool)):
        if t.dtype != dtype or t.numel() != 1 or not t.is_cuda:
            raise ValueError(f"commit_check_cuda: {name} must be a one-element {dtype} CUDA tensor, got "
                             f"{t.dtype} of shape {tuple(t.shape)} on {t.device}")
    if report.numel() != len(COMMIT_REPORT):
        raise ValueError(f"commit_check_cuda: report must hold {len(COMMIT_REPORT)} values, got {report.numel()}")
    device, n3 = forces.device, forces.numel()
    per_warp, warps = commit_plan(n3)
    partials = torch.empty(4 * warps, dtype=torch.float64, device=device)
    bad = torch.empty((), dtype=torch.bool, device=device)
    step_out = torch.empty((), dtype=torch.int64, device=device)
    report_out = torch.empty_like(report)
    _KERNELS.get("commit_partials", device).launch(
        (-(-warps * 32 // _THREADS),), (_THREADS,),
        [momenta, masses, forces, np.int64(n3), np.int64(per_warp), np.int64(warps), partials])
    _KERNELS.get("commit_finish", device).launch(
        (1,), (32,), [partials, np.int64(warps), energy, step, stale, overflow, count, slack, report,
                      np.float64(temperature_denominator), np.float64(max_temperature), bad, step_out, report_out])
    return bad, step_out, report_out


def kinetic(momenta: Tensor, masses: Tensor) -> Tensor:
    """sum_i p_i^2 / (2 m_i)."""
    return 0.5 * (momenta.square() / masses).sum()


def langevin_first_reference(positions: Tensor, momenta: Tensor, forces: Tensor, masses: Tensor, xi: Tensor,
                             eta: Tensor, c1: float, c2: float, c3: Tensor, c4: Tensor, c5: Tensor, dt: float
                             ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """ASE's Langevin first half: (positions, momenta, v, random velocity) after the drift."""
    rnd_pos = c5 * eta
    rnd_vel = c3 * xi - c4 * eta
    v = momenta / masses
    v = v + (c1 * forces / masses - c2 * v + rnd_vel)
    new_positions = positions + dt * v + rnd_pos
    v = (new_positions - positions - rnd_pos) / dt  # as ASE: the velocity the drift implies
    return new_positions, v * masses, v, rnd_vel


def langevin_second_reference(v: Tensor, forces: Tensor, masses: Tensor, rnd_vel: Tensor, c1: float, c2: float
                              ) -> Tensor:
    """ASE's Langevin second half: the momenta after the force call."""
    return (v + (c1 * forces / masses - c2 * v + rnd_vel)) * masses


def _on_step_kernels(*tensors: Tensor, dtypes: tuple[torch.dtype, ...] | None = None) -> bool:
    """Whether the kernels take the arithmetic: contiguous CUDA arrays of the kernel's ``dtypes`` (float64 each
    unless named), no tracing."""
    dtypes = (torch.float64,) * len(tensors) if dtypes is None else dtypes
    return not torch.compiler.is_compiling() and all(
        t.is_cuda and t.dtype == d and t.is_contiguous() for t, d in zip(tensors, dtypes, strict=True))


def langevin_first(positions: Tensor, momenta: Tensor, forces: Tensor, masses: Tensor, xi: Tensor, eta: Tensor,
                   c1: float, c2: float, c3: Tensor, c4: Tensor, c5: Tensor, dt: float
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``langevin_first_reference``, one kernel on CUDA."""
    if _on_step_kernels(positions, momenta, forces, masses, xi, eta, c3, c4, c5):
        return langevin_first_cuda(positions, momenta, forces, masses, xi, eta, c1, c2, c3, c4, c5, dt)
    return langevin_first_reference(positions, momenta, forces, masses, xi, eta, c1, c2, c3, c4, c5, dt)


def langevin_second(v: Tensor, forces: Tensor, masses: Tensor, rnd_vel: Tensor, c1: float, c2: float) -> Tensor:
    """``langevin_second_reference``, one kernel on CUDA."""
    if _on_step_kernels(v, forces, masses, rnd_vel):
        return langevin_second_cuda(v, forces, masses, rnd_vel, c1, c2)
    return langevin_second_reference(v, forces, masses, rnd_vel, c1, c2)


_COMMIT_DTYPES = (torch.float64,) * 5 + (torch.int64, torch.bool, torch.bool, torch.int64, torch.float64)


def commit_check(energy: Tensor, forces: Tensor, momenta: Tensor, masses: Tensor, step: Tensor, stale: Tensor,
                 overflow: Tensor, count: Tensor, slack: Tensor, report: Tensor, temperature_denominator: float,
                 max_temperature: float) -> tuple[Tensor, Tensor, Tensor]:
    """After a step: (bad, step, report). bad: a stale list, overflowed buffers, a blow-up, or an earlier step of
    the block stopped it; step + 1 if not; the block's report (float64 [len(COMMIT_REPORT)]) updated. Pure."""
    if _on_step_kernels(energy, forces, momenta, masses, report, step, stale, overflow, count, slack,
                        dtypes=_COMMIT_DTYPES):
        return commit_check_cuda(energy, forces, momenta, masses, step, stale, overflow, count, slack, report,
                                 temperature_denominator, max_temperature)
    return commit_check_reference(energy, forces, momenta, masses, step, stale, overflow, count, slack, report,
                                  temperature_denominator, max_temperature)


def commit_check_reference(energy: Tensor, forces: Tensor, momenta: Tensor, masses: Tensor, step: Tensor,
                           stale: Tensor, overflow: Tensor, count: Tensor, slack: Tensor, report: Tensor,
                           temperature_denominator: float, max_temperature: float) -> tuple[Tensor, Tensor, Tensor]:
    """``commit_check`` as torch operations (any device; what torch.compile traces)."""
    rep = dict(zip(COMMIT_REPORT, report.unbind(0), strict=True))
    temperature = kinetic(momenta, masses) / temperature_denominator
    bad_energy = ~torch.isfinite(energy)
    bad_forces = ~torch.isfinite(forces).all()
    hot = ~(temperature <= max_temperature)
    kind = torch.where(bad_energy, 1.0, torch.where(bad_forces, 2.0, torch.where(hot, 3.0, 0.0)))
    value = torch.where(bad_energy, energy, torch.where(bad_forces, forces.abs().amax(), temperature))
    invalid = stale | overflow
    blow = ~invalid & (kind > 0)
    stopped = rep["stopped"] > 0
    fresh = ~stopped
    bad = stopped | invalid | blow
    new_blow = blow & fresh
    good = ~bad
    new = {"committed": rep["committed"] + good.to(report.dtype), "stopped": bad.to(report.dtype),
           "stale": ((rep["stale"] > 0) | (stale & fresh)).to(report.dtype),
           "overflow": ((rep["overflow"] > 0) | (overflow & fresh)).to(report.dtype),
           "blow_kind": torch.where(new_blow, kind, rep["blow_kind"]),
           "blow_step": torch.where(new_blow, (step + 1).to(report.dtype), rep["blow_step"]),
           "blow_value": torch.where(new_blow, value.to(report.dtype), rep["blow_value"]),
           "count_max": torch.maximum(rep["count_max"], torch.where(fresh, count.to(report.dtype), 0.0)),
           "slack": torch.where(good, slack.to(report.dtype), rep["slack"]),
           "temperature": torch.where(good, temperature, rep["temperature"])}
    return bad, step + good.to(step.dtype), torch.stack([new[name] for name in COMMIT_REPORT])
