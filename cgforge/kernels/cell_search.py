"""The candidate loop of the cell-list neighbour search as two CUDA kernels: a warp per receiver atom.

The binning (which bin each atom is in, the atoms of each bin in order, how many bins each side a neighbour can
be) is done by the caller, the torch search of ``cgforge.plugin.runtime.neighbours``, whose chunked candidate
loop this replaces on a CUDA device. For receiver ``a`` in bin ``coord[a]`` the candidates are, in this order,

    for each bin offset o in [-reach, reach]^3 (lexicographic), the bin t = coord[a] + o brought into the box
    along periodic directions by the image I = floor(t / bins) (t outside the box along a non-periodic one: no
    candidates), for each atom c of bin t in bin order:
        vector = (wrapped[a] - I @ cell) - wrapped[c]      kept when |vector|^2 < cutoff^2, and not c == a, I == 0
        shift  = wrap[a] - wrap[c] - I                     (the image back to the positions as given)

A warp per receiver, its lanes over a bin's atoms. Pass 1 counts each receiver's kept candidates; a prefix sum
gives the rows; pass 2 writes each row in the order above; a stable sort by (receiver, sender) then orders each
row by sender, as the torch search does, so both give the same list. Memory is the output and O(N), where the
torch loop needs ~60 bytes per candidate.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from .core.launch import thread_blocks
from .core.registry import SourceKernels

__all__ = ["CELL_SEARCH_SOURCE", "cell_pairs_cuda"]

CELL_SEARCH_SOURCE = r"""
__device__ __forceinline__ long long floor_div(long long a, long long b) {
    return a >= 0 ? a / b : -((-a + b - 1) / b);
}

// A warp per receiver a = atoms_by_bin[warp] (bin order: neighbouring warps read the same bins); its lanes take a
// bin's atoms 32 at a time and a ballot keeps the candidates' order. rowptr == nullptr: count into count[a];
// else write row a from rowptr[a] on. Every lane of a warp runs the same loops (bounds are per receiver).
template <typename T>
__device__ __forceinline__ void cell_pairs(
        const T* __restrict__ sorted_pos, const long long* __restrict__ atoms_by_bin,
        const long long* __restrict__ coord, const long long* __restrict__ first_in_bin,
        const long long* __restrict__ atoms_in_bin, const T* __restrict__ cell, const long long* __restrict__ wrap,
        long long b0, long long b1, long long b2, int r0, int r1, int r2, int p0, int p1, int p2, T cutoff2,
        long long n, const long long* __restrict__ rowptr, long long* __restrict__ count,
        long long* __restrict__ sender, long long* __restrict__ shifts) {
    const long long t = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (t >= n) return;  // the whole warp
    const long long a = atoms_by_bin[t];
    const T x = sorted_pos[3 * t], y = sorted_pos[3 * t + 1], z = sorted_pos[3 * t + 2];
    const long long base = rowptr != nullptr ? rowptr[a] : 0;
    const unsigned below = (1u << lane) - 1u;  // the lanes before this one
    long long written = 0;
    for (int o0 = -r0; o0 <= r0; ++o0) {
        long long t0 = coord[3 * a] + o0, i0 = 0;
        if (p0) { i0 = floor_div(t0, b0); t0 -= i0 * b0; } else if (t0 < 0 || t0 >= b0) continue;
        for (int o1 = -r1; o1 <= r1; ++o1) {
            long long t1 = coord[3 * a + 1] + o1, i1 = 0;
            if (p1) { i1 = floor_div(t1, b1); t1 -= i1 * b1; } else if (t1 < 0 || t1 >= b1) continue;
            for (int o2 = -r2; o2 <= r2; ++o2) {
                long long t2 = coord[3 * a + 2] + o2, i2 = 0;
                if (p2) { i2 = floor_div(t2, b2); t2 -= i2 * b2; } else if (t2 < 0 || t2 >= b2) continue;
                const long long bin = (t0 * b1 + t1) * b2 + t2;
                const T f0 = (T)i0, f1 = (T)i1, f2 = (T)i2;
                const T bx = x - (f0 * cell[0] + f1 * cell[3] + f2 * cell[6]);
                const T by = y - (f0 * cell[1] + f1 * cell[4] + f2 * cell[7]);
                const T bz = z - (f0 * cell[2] + f1 * cell[5] + f2 * cell[8]);
                const bool home = i0 == 0 && i1 == 0 && i2 == 0;
                const long long first = first_in_bin[bin], last = first + atoms_in_bin[bin];
                for (long long k0 = first; k0 < last; k0 += 32) {
                    const long long k = k0 + lane;
                    bool keep = false;
                    long long c = 0;
                    if (k < last) {
                        const T dx = bx - sorted_pos[3 * k], dy = by - sorted_pos[3 * k + 1],
                                dz = bz - sorted_pos[3 * k + 2];
                        c = atoms_by_bin[k];
                        keep = dx * dx + dy * dy + dz * dz < cutoff2 && !(home && c == a);
                    }
                    const unsigned kept = __ballot_sync(0xffffffffu, keep);
                    if (keep && rowptr != nullptr) {
                        const long long s = base + written + __popc(kept & below);
                        sender[s] = c;
                        shifts[3 * s] = wrap[3 * a] - wrap[3 * c] - i0;
                        shifts[3 * s + 1] = wrap[3 * a + 1] - wrap[3 * c + 1] - i1;
                        shifts[3 * s + 2] = wrap[3 * a + 2] - wrap[3 * c + 2] - i2;
                    }
                    written += __popc(kept);
                }
            }
        }
    }
    if (rowptr == nullptr && lane == 0) count[a] = written;
}

#define CELL_PAIRS_KERNEL(T, SUFFIX)                                                                            \
extern "C" __global__ void cell_pairs_##SUFFIX(const T* sorted_pos, const long long* atoms_by_bin,            \
        const long long* coord, const long long* first_in_bin, const long long* atoms_in_bin, const T* cell,    \
        const long long* wrap, long long b0, long long b1, long long b2, int r0, int r1, int r2, int p0, int p1, \
        int p2, T cutoff2, long long n, const long long* rowptr, long long* count, long long* sender,           \
        long long* shifts) {                                                                                   \
    cell_pairs<T>(sorted_pos, atoms_by_bin, coord, first_in_bin, atoms_in_bin, cell, wrap, b0, b1, b2, r0, r1, \
                  r2, p0, p1, p2, cutoff2, n, rowptr, count, sender, shifts);                                  \
}
CELL_PAIRS_KERNEL(float, f32)
CELL_PAIRS_KERNEL(double, f64)
"""

_KERNELS = SourceKernels(CELL_SEARCH_SOURCE, ["cell_pairs_f32", "cell_pairs_f64"], "cell_search")
_THREADS = 128  # four receivers a block
_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}


def cell_pairs_cuda(wrapped: Tensor, atoms_by_bin: Tensor, coord: Tensor, first_in_bin: Tensor,
                    atoms_in_bin: Tensor, cell: Tensor, wrap: Tensor, bins: tuple[int, int, int],
                    reach: tuple[int, int, int], pbc: tuple[bool, bool, bool], cutoff: float
                    ) -> tuple[Tensor, Tensor, Tensor]:
    """The pairs of the module doc: (sender, receiver, shifts), int64 [E], [E], [E, 3], sorted by (receiver,
    sender). One host read (the number of pairs, to size the output).

    wrapped [N, 3] (float32/float64, on CUDA): the positions wrapped into the cell; cell [3, 3] (rows) in that
    dtype; atoms_by_bin [N], coord [N, 3] (each atom's bin coordinates), first_in_bin and atoms_in_bin [B] (B =
    the product of ``bins``), wrap [N, 3] (the integer images that wrapped the positions): int64.
    """
    dtype, device = wrapped.dtype, wrapped.device
    suffix = _SUFFIX.get(dtype)
    if suffix is None or not wrapped.is_cuda:
        raise ValueError(f"cell_pairs_cuda: positions must be float32 or float64 on a CUDA device, got {dtype} on "
                         f"{device}")
    n, n_bins = wrapped.shape[0], int(np.prod(bins))
    for name, t, want, shape in (("cell", cell, dtype, (3, 3)), ("atoms_by_bin", atoms_by_bin, torch.int64, (n,)),
                                 ("coord", coord, torch.int64, (n, 3)), ("wrap", wrap, torch.int64, (n, 3)),
                                 ("first_in_bin", first_in_bin, torch.int64, (n_bins,)),
                                 ("atoms_in_bin", atoms_in_bin, torch.int64, (n_bins,))):
        if t.dtype != want or t.device != device or tuple(t.shape) != shape:
            raise ValueError(f"cell_pairs_cuda: {name} must be a {want} tensor of shape {shape} on {device}, got "
                             f"{t.dtype} {tuple(t.shape)} on {t.device}")
    sorted_pos = wrapped.index_select(0, atoms_by_bin).contiguous()
    kernel = _KERNELS.get(f"cell_pairs_{suffix}", device)
    cutoff2 = np.float32(cutoff * cutoff) if dtype == torch.float32 else np.float64(cutoff * cutoff)
    head = [sorted_pos, atoms_by_bin.contiguous(), coord.contiguous(), first_in_bin.contiguous(),
            atoms_in_bin.contiguous(), cell.contiguous(), wrap.contiguous(), *(np.int64(b) for b in bins),
            *(np.int32(r) for r in reach), *(np.int32(bool(p)) for p in pbc), cutoff2, np.int64(n)]
    grid = (thread_blocks(n * 32, _THREADS),)
    counts = torch.empty(n, dtype=torch.int64, device=device)
    kernel.launch(grid, (_THREADS,), [*head, None, counts, None, None])
    ends = torch.cumsum(counts, 0)
    total = int(ends[-1]) if n else 0
    rowptr = ends - counts
    sender = torch.empty(total, dtype=torch.int64, device=device)
    shifts = torch.empty(total, 3, dtype=torch.int64, device=device)
    if total:
        kernel.launch(grid, (_THREADS,), [*head, rowptr, counts, sender, shifts])
    receiver = torch.repeat_interleave(torch.arange(n, device=device), counts, output_size=total)
    order = torch.argsort(receiver * n + sender, stable=True)  # senders in order within each row
    return sender.index_select(0, order), receiver, shifts.index_select(0, order)
