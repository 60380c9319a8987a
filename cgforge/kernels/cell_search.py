"""The candidate loop of the cell-list neighbour search as two CUDA kernels (a warp per receiver atom), beside
its torch reference (``candidate_pairs_reference``: the CPU path); ``candidate_pairs`` picks one.

The binning (a ``Bins`` value) is the caller's (``cgforge.plugin.runtime.neighbours``). For receiver ``a`` in
bin ``coord[a]`` the candidates are, in this order,

    for each bin offset o in [-reach, reach]^3 (lexicographic), the bin t = coord[a] + o brought into the box
    along periodic directions by the image I = floor(t / bins) (t outside the box along a non-periodic one: no
    candidates), for each atom c of bin t in bin order:
        vector = (wrapped[a] - I @ cell) - wrapped[c]      kept when |vector|^2 < cutoff^2, and not c == a, I == 0
        shift  = wrap[a] - wrap[c] - I                     (the image back to the positions as given)

Pass 1 counts each receiver's kept candidates, a prefix sum gives the rows, pass 2 writes them; a stable sort by
(receiver, sender) then gives the torch search's list. Memory is O(N) and the output.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from .core.launch import thread_blocks
from .core.registry import DTYPE_SUFFIX, SourceKernels

__all__ = ["CELL_SEARCH_SOURCE", "Bins", "candidate_pairs", "candidate_pairs_reference", "cell_pairs_cuda",
           "empty_pairs"]

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

class Bins(NamedTuple):
    """Atoms binned for the search (by the caller): what the candidate loop, torch or CUDA, reads."""

    wrapped: Tensor  # [N, 3] the positions wrapped into the cell (periodic directions), positions' dtype
    wrap: Tensor  # int64 [N, 3]: the images that wrapped them
    coord: Tensor  # int64 [N, 3]: each atom's bin coordinates
    bin_of_atom: Tensor  # int64 [N]
    atoms_by_bin: Tensor  # int64 [N]: the atoms in bin order (stable)
    atoms_in_bin: Tensor  # int64 [B]
    first_in_bin: Tensor  # int64 [B]
    bins: tuple[int, int, int]
    reach: tuple[int, int, int]  # bins each side a neighbour can be in
    search_cutoff: float  # the cutoff with room for rounding (the exact cut comes after the loop)


_KERNELS = SourceKernels(CELL_SEARCH_SOURCE, ["cell_pairs_f32", "cell_pairs_f64"], "cell_search")
_THREADS = 128  # four receivers a block


def cell_pairs_cuda(wrapped: Tensor, atoms_by_bin: Tensor, coord: Tensor, first_in_bin: Tensor, atoms_in_bin: Tensor,
                    cell: Tensor, wrap: Tensor, bins: tuple[int, int, int], reach: tuple[int, int, int],
                    pbc: tuple[bool, bool, bool], cutoff: float) -> tuple[Tensor, Tensor, Tensor]:
    """The pairs of the module doc: (sender, receiver, shifts) int64 [E], [E], [E, 3], sorted by (receiver, sender);
    one host read (the count). wrapped [N, 3] (float, CUDA) and cell [3, 3] (rows) in one dtype; int64
    atoms_by_bin [N], coord [N, 3], first_in_bin and atoms_in_bin [prod(bins)], wrap [N, 3] (the wrapping images)."""
    dtype, device = wrapped.dtype, wrapped.device
    suffix = DTYPE_SUFFIX.get(dtype)
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


def empty_pairs(device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """No pairs: (sender, receiver, shifts) of length 0 on ``device``."""
    empty = torch.zeros(0, dtype=torch.int64, device=device)
    return empty, empty.clone(), torch.zeros(0, 3, dtype=torch.int64, device=device)


def candidate_pairs(binned: Bins, cell: Tensor, pbc: tuple[bool, bool, bool], candidates_per_chunk: int
                    ) -> tuple[Tensor, Tensor, Tensor]:
    """The candidate loop: ``cell_pairs_cuda`` on a CUDA device, ``candidate_pairs_reference`` elsewhere (the
    same pairs in the same order)."""
    if binned.wrapped.is_cuda:
        return cell_pairs_cuda(binned.wrapped, binned.atoms_by_bin, binned.coord, binned.first_in_bin,
                               binned.atoms_in_bin, cell.contiguous(), binned.wrap, binned.bins, binned.reach, pbc,
                               binned.search_cutoff)
    return candidate_pairs_reference(binned, cell, pbc, candidates_per_chunk)


def candidate_pairs_reference(binned: Bins, cell: Tensor, pbc: tuple[bool, bool, bool], candidates_per_chunk: int
                     ) -> tuple[Tensor, Tensor, Tensor]:
    """The candidate loop in torch (CPU, or CUDA on request): the pairs closer than the search cutoff on the
    wrapped coordinates, sorted by (receiver, sender); ``cell_pairs_cuda``'s module doc defines them."""
    wrapped, wrap_int, bins, reach, search_cutoff = (binned.wrapped, binned.wrap, binned.bins, binned.reach,
                                                     binned.search_cutoff)
    atoms_by_bin, atoms_in_bin, first_in_bin = binned.atoms_by_bin, binned.atoms_in_bin, binned.first_in_bin
    n_atoms, device, dtype = wrapped.shape[0], wrapped.device, wrapped.dtype
    bins_t = torch.tensor(bins, device=device)
    periodic = torch.tensor(pbc, device=device)
    n_offsets = math.prod(2 * r + 1 for r in reach)
    # Tables over occupied bins x bin offsets: which bin (and periodic image of it) each offset lands in.
    occupied = torch.nonzero(atoms_in_bin).squeeze(1)
    row_of_bin = torch.full_like(atoms_in_bin, -1)
    row_of_bin[occupied] = torch.arange(occupied.numel(), device=device)
    row_of_atom = row_of_bin[binned.bin_of_atom]
    occupied_coord = torch.stack([occupied // (bins[1] * bins[2]), (occupied // bins[2]) % bins[1], occupied % bins[2]],
                                 dim=1)
    axes = [torch.arange(-r, r + 1, device=device) for r in reach]
    offsets = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, 3)
    target = occupied_coord[:, None, :] + offsets[None, :, :]
    image = torch.where(periodic, torch.div(target, bins_t, rounding_mode="floor"), torch.zeros_like(target))
    target = target - image * bins_t
    valid = ((target >= 0) & (target < bins_t)).all(-1)
    target_bin = torch.where(valid, (target[..., 0] * bins[1] + target[..., 1]) * bins[2] + target[..., 2], 0)
    pair_count = torch.where(valid, atoms_in_bin[target_bin], 0).reshape(-1)
    pair_first = first_in_bin[target_bin].reshape(-1)
    pair_image = image.reshape(-1, 3)
    pair_image_vector = pair_image.to(dtype) @ cell
    pair_is_home = (pair_image == 0).all(-1)

    # Chunks of receivers with a bounded number of candidate senders each.
    per_atom = pair_count.reshape(-1, n_offsets).sum(1)[row_of_atom]
    cumulative = torch.cumsum(per_atom, 0)
    total = int(cumulative[-1])
    n_chunks = max(1, math.ceil(total / candidates_per_chunk))
    cuts = torch.searchsorted(cumulative, torch.arange(1, n_chunks, device=device) * candidates_per_chunk, right=True)
    bounds = sorted({0, n_atoms, *cuts.tolist()})
    ends = cumulative[torch.tensor(bounds[1:], device=device) - 1].tolist()

    # Coordinates as three 1-D rows (structure of arrays): 1-D index_select is the fastest gather on CPU.
    sender_rows = wrapped.index_select(0, atoms_by_bin).T.contiguous()  # senders are read bin by bin
    offset_ids = torch.arange(n_offsets, device=device)
    senders, receivers, shifts = [], [], []
    start_total = 0
    for begin, end, end_total in zip(bounds[:-1], bounds[1:], ends, strict=True):
        chunk_total = end_total - start_total
        start_total = end_total
        if chunk_total == 0:
            continue
        # Receiver a meets every atom c of every (bin, image) its offsets reach:
        # vector = wrapped[a] - image @ cell - wrapped[c], the first two terms once per (a, offset).
        pairs = (row_of_atom[begin:end, None] * n_offsets + offset_ids).reshape(-1)
        image_vector = pair_image_vector.index_select(0, pairs).view(-1, n_offsets, 3)
        pair_base = wrapped[begin:end, None, :] - image_vector
        pair_rows = pair_base.reshape(-1, 3).T.contiguous()
        counts = pair_count.index_select(0, pairs)
        slot = torch.repeat_interleave(torch.arange(pairs.numel(), device=device), counts, output_size=chunk_total)
        pair_offset = pair_first.index_select(0, pairs) - torch.cumsum(counts, 0) + counts
        sorted_index = torch.arange(chunk_total, device=device).add_(pair_offset.index_select(0, slot))
        distance_sq = torch.zeros(chunk_total, dtype=dtype, device=device)
        for d in range(3):
            component = pair_rows[d].index_select(0, slot).sub_(sender_rows[d].index_select(0, sorted_index))
            distance_sq.addcmul_(component, component)
        keep = torch.nonzero(distance_sq < search_cutoff * search_cutoff).squeeze(1)
        slot = slot.index_select(0, keep)
        pair = pairs.index_select(0, slot)
        receiver = begin + torch.div(slot, n_offsets, rounding_mode="floor")
        sender = atoms_by_bin.index_select(0, sorted_index.index_select(0, keep))
        not_self = torch.nonzero((receiver != sender) | ~pair_is_home.index_select(0, pair)).squeeze(1)
        receiver, sender, pair = (t.index_select(0, not_self) for t in (receiver, sender, pair))
        receivers.append(receiver)
        senders.append(sender)
        # Back from wrapped to the positions as given: vector = p[a] - p[c] + (W[a] - W[c] - image) @ cell.
        shifts.append(wrap_int.index_select(0, receiver) - wrap_int.index_select(0, sender)
                      - pair_image.index_select(0, pair))
    if not receivers:
        return empty_pairs(device)
    sender, receiver, shift = torch.cat(senders), torch.cat(receivers), torch.cat(shifts)
    # Receivers are already ascending (chunks and slots go receiver by receiver); order senders within them.
    order = torch.argsort(receiver * n_atoms + sender, stable=True)
    return tuple(t.index_select(0, order) for t in (sender, receiver, shift))
