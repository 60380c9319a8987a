"""The MD engine's commit rule (``cgforge.plugin.md.commit.commit_step``, which owns its meaning and its reference)
as two CUDA kernels.

The torch expression is ~130 tiny kernels a step on 0-d tensors, and inside the engine's CUDA graph each costs a
few microseconds however little it does. Here one kernel reduces the atoms (kinetic energy, the forces' largest
magnitude, whether any is not finite) into one partial per block, and a second, one block, sums the partials and
applies the rule in one thread. The sums run in a fixed order for a given atom count (grid-stride loops, fixed
trees): the same bits on every run, though not torch's (its own reduction order), so the reported temperature may
differ from the torch expression's in the last bits.

    temperature = sum_i |p_i|^2 / (2 m_i) * temperature_per_kinetic
    kind        = 1 if the energy is not finite, else 2 if a force is not, else 3 if not temperature <= limit, else 0
    bad         = stopped before | stale | overflow | (kind > 0)       (see commit_step for the report's fields)
"""

from __future__ import annotations

import torch
from torch import Tensor

from .core.registry import SourceKernels

__all__ = ["COMMIT_SOURCE", "REPORT", "commit_step_cuda"]

# The report's fields, in the order of the float64 vector the engine keeps (the kernel indexes it by these).
REPORT = ("committed", "stopped", "stale", "overflow", "blow_kind", "blow_step", "blow_value", "count_max",
          "slack", "temperature")

_THREADS = 256
_MAX_PARTIALS = 256  # blocks of the first kernel: the second reduces their partials in one block of _THREADS

COMMIT_SOURCE = r"""
#define THREADS 256

struct Partial { double kinetic; double max_abs; int not_finite; int nan; };

__device__ __forceinline__ void add_element(Partial& acc, double p, double m, double f) {
    acc.kinetic += p * p / m;
    acc.not_finite |= !isfinite(f);
    acc.nan |= isnan(f);
    acc.max_abs = fmax(acc.max_abs, fabs(f));
}

__device__ __forceinline__ void combine(Partial& acc, const Partial& other) {
    acc.kinetic += other.kinetic;
    acc.max_abs = fmax(acc.max_abs, other.max_abs);
    acc.not_finite |= other.not_finite;
    acc.nan |= other.nan;
}

// The rule on the summed partial (one thread). report / new_report: committed, stopped, stale, overflow,
// blow_kind, blow_step, blow_value, count_max, slack, temperature (commit.REPORT).
__device__ void apply_rule(const Partial all, double energy, long long step, bool stale, bool overflow,
                           long long count, double slack, const double* report, double temperature_per_kinetic,
                           double max_temperature, bool* bad_out, long long* step_out, double* new_report) {
    const double temperature = 0.5 * all.kinetic * temperature_per_kinetic;
    const bool bad_energy = !isfinite(energy);
    const bool bad_forces = all.not_finite != 0;
    const bool hot = !(temperature <= max_temperature);
    const double kind = bad_energy ? 1.0 : (bad_forces ? 2.0 : (hot ? 3.0 : 0.0));
    const double force_value = all.nan ? nan("") : all.max_abs;  // torch's amax propagates NaN
    const double value = bad_energy ? energy : (bad_forces ? force_value : temperature);
    const bool invalid = stale || overflow;
    const bool blow = !invalid && kind > 0.0;
    const bool fresh = !(report[1] > 0.0);
    const bool bad = !fresh || invalid || blow;
    const bool new_blow = blow && fresh;
    const bool good = !bad;
    new_report[0] = report[0] + (good ? 1.0 : 0.0);
    new_report[1] = bad ? 1.0 : 0.0;
    new_report[2] = (report[2] > 0.0 || (stale && fresh)) ? 1.0 : 0.0;
    new_report[3] = (report[3] > 0.0 || (overflow && fresh)) ? 1.0 : 0.0;
    new_report[4] = new_blow ? kind : report[4];
    new_report[5] = new_blow ? (double)(step + 1) : report[5];
    new_report[6] = new_blow ? value : report[6];
    const double counted = fresh ? (double)count : 0.0;
    new_report[7] = (isnan(report[7]) || report[7] > counted) ? report[7] : counted;  // torch.maximum keeps NaN
    new_report[8] = good ? slack : report[8];
    new_report[9] = good ? temperature : report[9];
    *bad_out = bad;
    *step_out = step + (good ? 1 : 0);
}

__device__ void reduce_block(Partial mine, Partial* shared) {
    // a fixed tree over the block's threads: shared[0] holds the block's partial afterwards
    const int t = threadIdx.x;
    shared[t] = mine;
    __syncthreads();
    for (int half = THREADS / 2; half > 0; half >>= 1) {
        if (t < half) combine(shared[t], shared[t + half]);
        __syncthreads();
    }
}

// momenta, forces [atoms * 3]; masses [atoms]: one partial per block
extern "C" __global__ void commit_partials(const double* __restrict__ momenta, const double* __restrict__ masses,
                                           const double* __restrict__ forces, long long elements,
                                           Partial* __restrict__ partials) {
    __shared__ Partial shared[THREADS];
    Partial mine = {0.0, 0.0, 0, 0};
    for (long long e = (long long)blockIdx.x * THREADS + threadIdx.x; e < elements;
         e += (long long)gridDim.x * THREADS)
        add_element(mine, momenta[e], masses[e / 3], forces[e]);
    reduce_block(mine, shared);
    if (threadIdx.x == 0) partials[blockIdx.x] = shared[0];
}

extern "C" __global__ void commit_finish(const Partial* __restrict__ partials, int count_partials,
                                         const double* __restrict__ energy, const long long* __restrict__ step,
                                         const bool* __restrict__ stale, const bool* __restrict__ overflow,
                                         const long long* __restrict__ count, const double* __restrict__ slack,
                                         const double* __restrict__ report, double temperature_per_kinetic,
                                         double max_temperature, bool* __restrict__ bad_out,
                                         long long* __restrict__ step_out, double* __restrict__ new_report) {
    __shared__ Partial shared[THREADS];
    Partial mine = {0.0, 0.0, 0, 0};
    for (int b = threadIdx.x; b < count_partials; b += THREADS) combine(mine, partials[b]);
    reduce_block(mine, shared);
    if (threadIdx.x == 0)
        apply_rule(shared[0], energy[0], step[0], stale[0], overflow[0], count[0], slack[0], report,
                   temperature_per_kinetic, max_temperature, bad_out, step_out, new_report);
}
"""

_KERNELS = SourceKernels(COMMIT_SOURCE, ["commit_partials", "commit_finish"], "md_commit")
_PARTIAL_BYTES = 24  # struct Partial: two doubles, two ints


def commit_step_cuda(energy: Tensor, forces: Tensor, momenta: Tensor, masses: Tensor, step: Tensor, stale: Tensor,
                     overflow: Tensor, count: Tensor, slack: Tensor, max_temperature_K: float, report: Tensor,
                     temperature_per_kinetic: float) -> tuple[Tensor, Tensor, Tensor]:
    """``commit_step``'s (bad, step, report) from CUDA tensors as the engine keeps them: energy, slack float64 0-d;
    forces, momenta float64 [N, 3]; masses float64 [N, 1]; step, count int64 0-d; stale, overflow bool 0-d; report
    float64 [len(REPORT)]. ``temperature_per_kinetic``: kelvin per eV of kinetic energy, 1 / (1.5 N k_B) in the
    caller's units. No host read: capture-safe."""
    from .core.runtime import F64, I32, I64

    device = forces.device
    n = forces.shape[0]
    for name, t, dtype in (("energy", energy, torch.float64), ("forces", forces, torch.float64),
                           ("momenta", momenta, torch.float64), ("masses", masses, torch.float64),
                           ("step", step, torch.int64), ("stale", stale, torch.bool),
                           ("overflow", overflow, torch.bool), ("count", count, torch.int64),
                           ("slack", slack, torch.float64), ("report", report, torch.float64)):
        if t.dtype != dtype or t.device != device:
            raise ValueError(f"commit_step_cuda: {name} must be {dtype} on {device}, got {t.dtype} on {t.device}")
    if momenta.shape != (n, 3) or masses.numel() != n or report.shape != (len(REPORT),):
        raise ValueError(f"commit_step_cuda: forces {tuple(forces.shape)}, momenta {tuple(momenta.shape)}, masses "
                         f"{tuple(masses.shape)}, report {tuple(report.shape)} do not match")
    elements = 3 * n
    blocks = max(1, min(_MAX_PARTIALS, -(-elements // _THREADS)))
    partials = torch.empty(blocks * _PARTIAL_BYTES, dtype=torch.uint8, device=device)
    bad = torch.empty((), dtype=torch.bool, device=device)
    new_step = torch.empty((), dtype=torch.int64, device=device)
    new_report = torch.empty(len(REPORT), dtype=torch.float64, device=device)
    momenta, masses, forces = momenta.contiguous(), masses.contiguous(), forces.contiguous()
    _KERNELS.get("commit_partials", device).launch(
        (blocks,), (_THREADS,), [momenta, masses, forces, I64(elements), partials])
    _KERNELS.get("commit_finish", device).launch(
        (1,), (_THREADS,), [partials, I32(blocks), energy.contiguous(), step.contiguous(), stale.contiguous(),
                            overflow.contiguous(), count.contiguous(), slack.contiguous(), report.contiguous(),
                            F64(temperature_per_kinetic), F64(max_temperature_K), bad, new_step,
                            new_report])
    return bad, new_step, new_report
