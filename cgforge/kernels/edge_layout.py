"""A step's model edges cut from a skin-padded pair list and laid out in fixed-capacity slots, in three kernels.

Input: a pair list of ``V`` entries (sender, receiver, integer image shifts [V, 3] as floats, ``valid``), sorted
by receiver, whose every valid pair (s -> r, S) has its reverse (r -> s, -S) at ``reverse``, with ``rowptr``
[N + 1] its receiver rows; positions [N, 3] and the cell [3, 3] (rows) of this step. Output: the pairs within
the cutoff, in their order, in ``capacity`` slots, the ``capacity - count`` free slots holding padding
self-edges spread evenly over the atoms, each at the end of its atom's row (the layout's rules are those of
``layout_edges`` in the MD runtime, whose torch expression is the reference and the CPU path):

    keep[e]   = valid[e] and |pos[r] - pos[s] + S @ cell| < cutoff       (kernel 1, a thread per pair)
    rank      = the inclusive prefix sum of keep                          (torch.cumsum: one scan)
    slot[e]   = rank[e] - 1 + pads_before(receiver[e]),  pads_before(r) = ceil(r * free / N)
    padding j < free sits on atom floor(j * N / free), in slot j + (pairs kept in rows up to that atom)
    rowptr'[r] = (pairs kept before row r) + pads_before(r)               (kernel 2 writes all of it)

A pair's vector is computed so that its reverse's is its exact negation (the same operations on negated
operands), so a pair is kept together with its reverse and ``perm_t`` (the transpose's order) is the slot of
each slot's reverse: the transpose has the same rows. More kept pairs than slots (``count > capacity``, an
overflow the caller detects from ``count``) leaves a layout that stays in bounds. As torch operations the cut
and the layout were ~70 kernels a step (their time: docs/measured-constants.md).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from .core.launch import thread_blocks
from .core.registry import SourceKernels

__all__ = ["EDGE_LAYOUT_SOURCE", "PaddedLayout", "padded_layout_cuda"]

EDGE_LAYOUT_SOURCE = r"""
// keep[e] = 1 where pair e is valid and shorter than the cutoff. The vector is (pos[r] - pos[s]) + S @ cell in a
// fixed order, so the reverse pair's is its exact negation and both are kept or neither.
template <typename T>
__device__ __forceinline__ void edge_keep(const T* __restrict__ pos, const T* __restrict__ cell,
                                          const long long* __restrict__ sender,
                                          const long long* __restrict__ receiver, const T* __restrict__ shifts,
                                          const unsigned char* __restrict__ valid, T cutoff, long long pairs,
                                          int* __restrict__ keep) {
    const long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= pairs) return;
    int kept = 0;
    if (valid[e]) {
        const long long s = sender[e], r = receiver[e];
        const T a = shifts[3 * e], b = shifts[3 * e + 1], c = shifts[3 * e + 2];
        T length2 = 0;
        for (int k = 0; k < 3; ++k) {
            const T v = (pos[3 * r + k] - pos[3 * s + k]) + (a * cell[k] + b * cell[3 + k] + c * cell[6 + k]);
            length2 += v * v;
        }
        kept = sqrt(length2) < cutoff;
    }
    keep[e] = kept;
}

// Every slot of the layout, a thread per item: pair i (i < pairs), padding edge i (i < free), row pointer i
// (i <= n). rank: the inclusive prefix sum of keep; slots past the capacity are not written (overflow).
template <typename T>
__device__ __forceinline__ void edge_place(
        const int* __restrict__ keep, const long long* __restrict__ rank, const long long* __restrict__ sender,
        const long long* __restrict__ receiver, const T* __restrict__ shifts,
        const long long* __restrict__ list_rowptr, const long long* __restrict__ reverse,
        const T* __restrict__ pad_vector, long long pairs, long long n, long long capacity, int with_graph,
        long long* __restrict__ out_sender, long long* __restrict__ out_receiver, T* __restrict__ out_shifts,
        T* __restrict__ out_pad, long long* __restrict__ slot_of_pair, int* __restrict__ sender32,
        int* __restrict__ receiver32, long long* __restrict__ rowptr, int* __restrict__ perm_t) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long count = pairs > 0 ? rank[pairs - 1] : 0;
    const long long free = count < capacity ? capacity - count : 0;
    // pairs kept before entry k of the list, and padding edges on atoms before row r
    #define KEPT_BEFORE(k) ((k) > 0 ? rank[(k) - 1] : 0LL)
    #define PADS_BEFORE(r) (((r) * free + n - 1) / n)
    if (i < pairs) {
        long long slot = capacity;
        if (keep[i]) {
            const long long s = rank[i] - 1 + PADS_BEFORE(receiver[i]);
            if (s < capacity) {
                slot = s;
                out_sender[s] = sender[i];
                out_receiver[s] = receiver[i];
                for (int k = 0; k < 3; ++k) {
                    out_shifts[3 * s + k] = shifts[3 * i + k];
                    out_pad[3 * s + k] = 0;
                }
                if (with_graph) {
                    const long long back = reverse[i];
                    const long long b = keep[back] ? rank[back] - 1 + PADS_BEFORE(receiver[back]) : capacity;
                    sender32[s] = (int)sender[i];
                    receiver32[s] = (int)receiver[i];
                    perm_t[s] = (int)(b < capacity ? b : capacity - 1);
                }
            }
        }
        slot_of_pair[i] = slot;
    }
    if (i < free) {
        long long row = i * n / free;
        row = row < n - 1 ? row : n - 1;
        const long long s = i + KEPT_BEFORE(list_rowptr[row + 1]);  // after every kept pair of rows <= row
        out_sender[s] = row;
        out_receiver[s] = row;
        for (int k = 0; k < 3; ++k) {
            out_shifts[3 * s + k] = 0;
            out_pad[3 * s + k] = pad_vector[k];
        }
        if (with_graph) {
            sender32[s] = (int)row;
            receiver32[s] = (int)row;
            perm_t[s] = (int)s;  // a padding self-edge is its own reverse
        }
    }
    if (with_graph && i <= n) {
        const long long p = KEPT_BEFORE(list_rowptr[i]) + PADS_BEFORE(i);
        rowptr[i] = p < capacity ? p : capacity;
    }
    #undef KEPT_BEFORE
    #undef PADS_BEFORE
}

#define EDGE_LAYOUT_KERNELS(T, SUFFIX)                                                                          \
extern "C" __global__ void edge_keep_##SUFFIX(const T* pos, const T* cell, const long long* sender,             \
        const long long* receiver, const T* shifts, const unsigned char* valid, T cutoff, long long pairs,       \
        int* keep) {                                                                                           \
    edge_keep<T>(pos, cell, sender, receiver, shifts, valid, cutoff, pairs, keep);                             \
}                                                                                                              \
extern "C" __global__ void edge_place_##SUFFIX(const int* keep, const long long* rank, const long long* sender, \
        const long long* receiver, const T* shifts, const long long* list_rowptr, const long long* reverse,     \
        const T* pad_vector, long long pairs, long long n, long long capacity, int with_graph,                 \
        long long* out_sender, long long* out_receiver, T* out_shifts, T* out_pad, long long* slot_of_pair,    \
        int* sender32, int* receiver32, long long* rowptr, int* perm_t) {                                      \
    edge_place<T>(keep, rank, sender, receiver, shifts, list_rowptr, reverse, pad_vector, pairs, n, capacity,  \
                  with_graph, out_sender, out_receiver, out_shifts, out_pad, slot_of_pair, sender32, receiver32, \
                  rowptr, perm_t);                                                                             \
}
EDGE_LAYOUT_KERNELS(float, f32)
EDGE_LAYOUT_KERNELS(double, f64)
"""

_KERNELS = SourceKernels(EDGE_LAYOUT_SOURCE, ["edge_keep_f32", "edge_keep_f64", "edge_place_f32", "edge_place_f64"],
                         "edge_layout")
_THREADS = 256
_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}


def _grid(items: int) -> tuple[int]:
    return (thread_blocks(items, _THREADS),)


class PaddedLayout(NamedTuple):
    """``padded_layout_cuda``'s outputs, C slots over V list pairs and N atoms; the last four None without a graph."""

    sender: Tensor  # int64 [C]
    receiver: Tensor  # int64 [C]
    shifts: Tensor  # [C, 3], the positions' dtype
    padding: Tensor  # [C, 3]: the padding slots' offsets (zero elsewhere)
    count: Tensor  # int64 []: slots in use
    slot: Tensor  # int64 [V]: the slot of each kept pair, C where not kept
    sender32: Tensor | None  # int32 [C]
    receiver32: Tensor | None  # int32 [C]
    rowptr: Tensor | None  # int64 [N + 1]: the receivers' rows
    perm_t: Tensor | None  # int32 [C]: the slot of each slot's reverse pair (the transposed order)


def padded_layout_cuda(pos: Tensor, cell: Tensor, sender: Tensor, receiver: Tensor, shifts: Tensor, valid: Tensor,
                       rowptr: Tensor, reverse: Tensor, cutoff: float, capacity: int, pad_vector: Tensor,
                       with_graph: bool) -> PaddedLayout:
    """The layout of the module doc on a CUDA device (``PaddedLayout``; its graph tensors only ``with_graph``).
    pos, cell, shifts, pad_vector: one float dtype; sender, receiver, rowptr, reverse: int64; valid: bool. Reads
    nothing back to the host: capture-safe."""
    dtype, device = pos.dtype, pos.device
    suffix = _SUFFIX.get(dtype)
    if suffix is None or not pos.is_cuda:
        raise ValueError(f"padded_layout_cuda: positions must be float32 or float64 on a CUDA device, got {dtype} "
                         f"on {device}")
    for name, t, want in (("cell", cell, dtype), ("shifts", shifts, dtype), ("pad_vector", pad_vector, dtype),
                          ("sender", sender, torch.int64), ("receiver", receiver, torch.int64),
                          ("rowptr", rowptr, torch.int64), ("reverse", reverse, torch.int64),
                          ("valid", valid, torch.bool)):
        if t.dtype != want or t.device != device or not t.is_contiguous():
            raise ValueError(f"padded_layout_cuda: {name} must be a contiguous {want} tensor on {device}, got "
                             f"{t.dtype} on {t.device}")
    n, pairs, cap = pos.shape[0], sender.shape[0], int(capacity)
    if n < 1 or cap < 1 or rowptr.shape[0] != n + 1:
        raise ValueError(f"padded_layout_cuda: expected at least one atom and one slot and rowptr of N + 1 = {n + 1} "
                         f"entries, got N = {n}, capacity {cap}, rowptr {tuple(rowptr.shape)}")
    keep = torch.empty(pairs, dtype=torch.int32, device=device)
    if pairs:
        _KERNELS.get(f"edge_keep_{suffix}", device).launch(
            _grid(pairs), (_THREADS,), [pos, cell, sender, receiver, shifts, valid, _scalar(cutoff, dtype),
                                        np.int64(pairs), keep])
    rank = torch.cumsum(keep, 0, dtype=torch.int64)
    count = rank[-1] if pairs else torch.zeros((), dtype=torch.int64, device=device)
    ints = {"dtype": torch.int32, "device": device}
    out_sender = torch.empty(cap, dtype=torch.int64, device=device)
    out_receiver = torch.empty(cap, dtype=torch.int64, device=device)
    out_shifts = torch.empty(cap, 3, dtype=dtype, device=device)
    out_pad = torch.empty(cap, 3, dtype=dtype, device=device)
    slot = torch.empty(pairs, dtype=torch.int64, device=device)
    graph = ((torch.empty(cap, **ints), torch.empty(cap, **ints), torch.empty(n + 1, dtype=torch.int64, device=device),
              torch.empty(cap, **ints)) if with_graph else (None, None, None, None))
    _KERNELS.get(f"edge_place_{suffix}", device).launch(
        _grid(max(pairs, cap, n + 1)), (_THREADS,),
        [keep, rank, sender, receiver, shifts, rowptr, reverse, pad_vector, np.int64(pairs), np.int64(n),
         np.int64(cap), np.int32(bool(with_graph)), out_sender, out_receiver, out_shifts, out_pad, slot, *graph])
    return PaddedLayout(out_sender, out_receiver, out_shifts, out_pad, count, slot, *graph)


def _scalar(value: float, dtype: torch.dtype) -> np.floating:
    return np.float32(value) if dtype == torch.float32 else np.float64(value)
