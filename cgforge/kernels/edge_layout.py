"""Model edges in a fixed-capacity, receiver-sorted layout, built on the device without a host sync: the torch
expressions (``edges_within``, ``layout_edges``: the reference and the CPU path) and CUDA kernels that make the same
layout: ``padded_layout_cuda`` for the MD engine's lists (with a topology) and ``layout_listed`` for lists that arrive
receiver-sorted, cut to a device count and without reverses (LAMMPS's pairs), whose transpose is a sort of senders.

The edges selected by a mask keep their (receiver, sender) order in ``capacity`` slots; the free slots hold padding
self-edges (k, k) of vector ``pad_offset`` (beyond the cutoff), spread evenly over the atoms at the end of their
rows, so the array stays receiver-sorted. No ``nonzero``, no ``.item()``: capture-safe. ``count`` is a device
scalar; an overflow (``count > capacity``) leaves an in-bounds layout the caller redoes with more room. With an
``EdgeTopology`` (row pointers and each edge's reverse, made per neighbour-list rebuild) an edge is kept with its
reverse (its vector is the exact negation), so the transpose has the layout's rows and its permutation is the slot
of each slot's reverse. Over a pair list of V entries sorted by receiver:

    keep[e]    = valid[e] and |pos[r] - pos[s] + S @ cell| < cutoff
    rank       = the inclusive prefix sum of keep
    slot[e]    = rank[e] - 1 + pads_before(receiver[e]),  pads_before(r) = ceil(r * free / N)
    padding j < free sits on atom floor(j * N / free), in slot j + (pairs kept in rows up to that atom)
    rowptr'[r] = (pairs kept before row r) + pads_before(r)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .convolution import ConvGraph, GraphTensors
from .core.launch import thread_blocks
from .core.registry import DTYPE_SUFFIX, SourceKernels
from .pair_reverse import pair_reverse

__all__ = ["EDGE_LAYOUT_SOURCE", "EdgeLayout", "EdgeTopology", "conv_graph", "edge_topology", "edges_within",
           "layout_edges", "layout_listed", "layout_within", "pad_offset_vector", "padded_layout_cuda"]

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
// (i <= n). rank: the inclusive prefix sum of keep; slots past the capacity are not written (overflow). With
// reverse == nullptr (a list without reverses) perm_t is not written: the caller sorts sender32 for the transpose.
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
    const bool symmetric = reverse != nullptr;
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
                    sender32[s] = (int)sender[i];
                    receiver32[s] = (int)receiver[i];
                    if (symmetric) {
                        const long long back = reverse[i];
                        const long long b = keep[back] ? rank[back] - 1 + PADS_BEFORE(receiver[back]) : capacity;
                        perm_t[s] = (int)(b < capacity ? b : capacity - 1);
                    }
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
            if (symmetric) perm_t[s] = (int)s;  // a padding self-edge is its own reverse
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


def _grid(items: int) -> tuple[int]:
    return (thread_blocks(items, _THREADS),)


@dataclass
class EdgeLayout:
    """C slots of edges laid out from V list edges (``layout_edges``, ``padded_layout_cuda``)."""

    sender: Tensor  # int64 [C]
    receiver: Tensor  # int64 [C], ascending
    unit_shifts: Tensor  # float [C, 3] (zero for padding)
    pad_offset: Tensor  # float [C, 3] (zero for real edges, the padding vector for padding edges)
    count: Tensor  # int64 0-d: edges selected (> C means overflow: the layout is not valid)
    graph: GraphTensors | None  # the ConvGraph's tensors
    slot: Tensor | None = None  # int64 [V]: the slot of each input edge (C for one not kept, or past C)

    @property
    def capacity(self) -> int:
        return self.sender.shape[0]

    def tensors(self) -> list[Tensor]:
        fixed = [self.sender, self.receiver, self.unit_shifts, self.pad_offset, self.count]
        return fixed + list(self.graph or ()) + ([] if self.slot is None else [self.slot])

    def copy_(self, other: EdgeLayout) -> None:
        """Refill this layout's tensors in place (same capacity): captured graphs keep reading them."""
        mine, theirs = self.tensors(), other.tensors()
        if len(mine) != len(theirs) or any(a.shape != b.shape for a, b in zip(mine, theirs)):
            raise ValueError("EdgeLayout.copy_: layouts of different capacity or kind")
        for a, b in zip(mine, theirs):
            a.copy_(b)


@dataclass
class EdgeTopology:
    """Of a receiver-sorted edge list whose every edge (s -> r, S) has its reverse (r -> s, -S) in the list."""

    rowptr: Tensor  # int64 [N + 1]: the edges of receiver r are rowptr[r] .. rowptr[r + 1] - 1
    reverse: Tensor  # int64 [V]: reverse[v] is the index of the reverse of edge v (entries past the list: v)

    def copy_(self, other: EdgeTopology) -> None:
        """Refill in place (same sizes): captured graphs keep reading these tensors."""
        if self.rowptr.shape != other.rowptr.shape or self.reverse.shape != other.reverse.shape:
            raise ValueError("EdgeTopology.copy_: topologies of different sizes")
        self.rowptr.copy_(other.rowptr)
        self.reverse.copy_(other.reverse)


def edge_topology(sender: Tensor, receiver: Tensor, shifts: Tensor, num_nodes: int,
                  capacity: int | None = None) -> EdgeTopology | None:
    """The topology of a (receiver, sender)-sorted list of ``V`` edges with integer image shifts [V, 3], padded
    to ``capacity`` entries (``pair_reverse``: host reads); None when an edge has no reverse in the list."""
    n, count = int(num_nodes), int(sender.shape[0])
    capacity = count if capacity is None else int(capacity)
    device = sender.device
    reverse = torch.arange(capacity, device=device)
    rowptr = torch.searchsorted(receiver, torch.arange(n + 1, device=device))
    if count:
        found = pair_reverse(sender, receiver, shifts, rowptr)
        if found is None:
            return None
        reverse[:count] = found
    return EdgeTopology(rowptr, reverse)


def pad_offset_vector(cutoff: float, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The vector of a padding edge: well beyond the cutoff, never zero (harmonics normalise it); made outside any
    capture (a host-to-device copy)."""
    return torch.tensor([2.0 * float(cutoff) + 1.0, 0.0, 0.0], dtype=dtype, device=device)


def edges_within(
    positions: Tensor, cell: Tensor, sender: Tensor, receiver: Tensor, shifts: Tensor, cutoff: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Edge vectors, lengths and the mask ``lengths < cutoff`` for a (possibly skin-padded) edge list, no device
    sync; differentiable in positions and cell (through ``shifts @ cell``, a matmul, never a gather)."""
    vectors = (positions.index_select(0, receiver) - positions.index_select(0, sender)
               + shifts.to(positions.dtype) @ cell)
    lengths = torch.linalg.vector_norm(vectors, dim=-1)
    return vectors, lengths, lengths < cutoff


def layout_edges(keep: Tensor, sender: Tensor, receiver: Tensor, unit_shifts: Tensor, num_nodes: int, capacity: int,
                 pad_vector: Tensor, with_graph: bool, topology: EdgeTopology | None = None) -> EdgeLayout:
    """The edges where ``keep`` (bool [V]) is set, receiver-sorted, padded to ``capacity`` slots (module doc), no
    host transfer. sender, receiver: int64 [V], receiver ascending; unit_shifts float [V, 3]; pad_vector float [3].
    With ``topology`` an edge is kept only with its reverse. The result's ``slot``: each input edge's slot."""
    n, cap, device = int(num_nodes), int(capacity), sender.device
    if n < 1 or cap < 0:
        raise ValueError(f"layout_edges: expected num_nodes >= 1 and capacity >= 0, got {num_nodes}, {capacity}")
    if topology is not None:
        keep = keep & keep.index_select(0, topology.reverse)  # symmetric whatever the rounding of the lengths
    keep_int = keep.to(torch.int64)
    rank = torch.cumsum(keep_int, 0) - 1  # slot among the kept edges
    count = keep_int.sum()
    free = (cap - count).clamp(min=0)
    if topology is not None:  # kept edges before each row start, from the inclusive prefix sum: no atomics
        kept_before = torch.cat([keep_int.new_zeros(1), rank + 1]).index_select(0, topology.rowptr)
        kept_per_row = kept_before[1:] - kept_before[:-1]
    else:
        kept_per_row = torch.zeros(n, dtype=torch.int64, device=device).index_add_(0, receiver, keep_int)
    kept_end = torch.cumsum(kept_per_row, 0)  # kept edges in rows <= r
    # Padding edge j sits on atom floor(j * n / free): ceil(r * free / n) of them come before row r.
    rows = torch.arange(n + 1, device=device)
    pads_before = torch.div(rows * free + (n - 1), n, rounding_mode="floor")
    dump = torch.full((), cap, dtype=torch.int64, device=device)  # writes that must not land go to slot `cap`

    real_slot = rank + pads_before.index_select(0, receiver)
    real_slot = torch.where(keep & (real_slot < cap), real_slot, dump)
    j = torch.arange(cap, device=device)
    pad_row = torch.div(j * n, free.clamp(min=1), rounding_mode="floor").clamp(max=n - 1)
    pad_slot = torch.where(j < free, j + kept_end.index_select(0, pad_row), dump)

    def place(real: Tensor, pad: Tensor | None) -> Tensor:
        """Kept edges' rows in their slots, padding rows in theirs (None: zeros, which the slots hold already)."""
        out = real.new_zeros((cap + 1, *real.shape[1:]))
        out.index_copy_(0, real_slot, real)
        if pad is not None:
            out.index_copy_(0, pad_slot, pad)
        return out[:cap]

    out_sender = place(sender, pad_row)
    out_receiver = place(receiver, pad_row)
    out_shifts = place(unit_shifts, None)
    # the padding vector where a slot pads, else zero: a mask, not two scatters of [C, 3] rows (slow ones)
    is_pad = torch.zeros(cap + 1, dtype=torch.bool, device=device).index_fill_(0, pad_slot, True)[:cap]
    out_pad = torch.where(is_pad.unsqueeze(1), pad_vector.to(unit_shifts.dtype), unit_shifts.new_zeros(()))
    graph = None
    if with_graph:
        pads_per_row = pads_before[1:] - pads_before[:-1]
        rowptr = torch.zeros(n + 1, dtype=torch.int64, device=device)
        rowptr[1:] = torch.cumsum(kept_per_row + pads_per_row, 0).clamp(max=cap)
        if topology is not None:
            # Symmetric: node s sends the reverses of the edges it receives, so the transpose has the same rows
            # and lists, in row s, the slots of the reverses of row s's edges (a padding self-edge: itself).
            rowptr_t = rowptr
            reverse_slot = place(real_slot.index_select(0, topology.reverse), pad_slot)
            perm_t = reverse_slot.clamp(max=max(cap - 1, 0)).to(torch.int32)  # overflow: garbage, in bounds
        else:
            ones = torch.ones(cap, dtype=torch.int64, device=device)
            rowptr_t = torch.zeros(n + 1, dtype=torch.int64, device=device)
            rowptr_t[1:] = torch.cumsum(torch.zeros(n, dtype=torch.int64, device=device).index_add_(
                0, out_sender, ones), 0)
            perm_t = torch.argsort(out_sender, stable=True).to(torch.int32)
        perm = torch.zeros(0, dtype=torch.int32, device=device)  # the layout is receiver-sorted
        graph = GraphTensors(out_sender.to(torch.int32), out_receiver.to(torch.int32), rowptr, perm, rowptr_t, perm_t)
    return EdgeLayout(out_sender, out_receiver, out_shifts, out_pad, count, graph, real_slot)


def padded_layout_cuda(pos: Tensor, cell: Tensor, sender: Tensor, receiver: Tensor, shifts: Tensor, valid: Tensor,
                       rowptr: Tensor, reverse: Tensor, cutoff: float, capacity: int, pad_vector: Tensor,
                       with_graph: bool) -> EdgeLayout:
    """``layout_edges``'s layout of the module doc on a CUDA device (its graph tensors only ``with_graph``).
    pos, cell, shifts, pad_vector: one float dtype; sender, receiver, rowptr, reverse: int64; valid: bool. Reads
    nothing back to the host: capture-safe."""
    dtype, device = pos.dtype, pos.device
    suffix = DTYPE_SUFFIX.get(dtype)
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
        scalar = np.float32 if dtype == torch.float32 else np.float64
        _KERNELS.get(f"edge_keep_{suffix}", device).launch(
            _grid(pairs), (_THREADS,), [pos, cell, sender, receiver, shifts, valid, scalar(cutoff), np.int64(pairs),
                                        keep])
    rank = torch.cumsum(keep, 0, dtype=torch.int64)
    count = rank[-1] if pairs else torch.zeros((), dtype=torch.int64, device=device)
    out_sender, out_receiver, out_shifts, out_pad, slot, sender32, receiver32, out_rowptr, perm_t = _place(
        keep, rank, sender, receiver, shifts, rowptr, reverse, pad_vector, n, cap, with_graph)
    graph = (GraphTensors(sender32, receiver32, out_rowptr, torch.zeros(0, dtype=torch.int32, device=device),
                          out_rowptr, perm_t) if with_graph else None)  # receiver-sorted: no perm; symmetric: rows
    return EdgeLayout(out_sender, out_receiver, out_shifts, out_pad, count, graph, slot)


def _place(keep: Tensor, rank: Tensor, sender: Tensor, receiver: Tensor, shifts: Tensor, list_rowptr: Tensor,
           reverse: Tensor | None, pad_vector: Tensor, n: int, cap: int, with_graph: bool) -> tuple:
    """``edge_place``'s outputs, allocated and written: out sender, receiver, shifts, pad, slot of each pair, and
    with the graph sender32, receiver32, rowptr and (with ``reverse``) perm_t; the ones not made are None."""
    device, dtype, pairs = sender.device, shifts.dtype, sender.shape[0]
    ints = {"dtype": torch.int32, "device": device}
    out_sender = torch.empty(cap, dtype=torch.int64, device=device)
    out_receiver = torch.empty(cap, dtype=torch.int64, device=device)
    out_shifts = torch.empty(cap, 3, dtype=dtype, device=device)
    out_pad = torch.empty(cap, 3, dtype=dtype, device=device)
    slot = torch.empty(pairs, dtype=torch.int64, device=device)
    sender32, receiver32, rowptr = ((torch.empty(cap, **ints), torch.empty(cap, **ints),
                                     torch.empty(n + 1, dtype=torch.int64, device=device))
                                    if with_graph else (None, None, None))
    perm_t = torch.empty(cap, **ints) if with_graph and reverse is not None else None
    _KERNELS.get(f"edge_place_{DTYPE_SUFFIX[dtype]}", device).launch(
        _grid(max(pairs, cap, n + 1)), (_THREADS,),
        [keep, rank, sender, receiver, shifts, list_rowptr, reverse, pad_vector, np.int64(pairs), np.int64(n),
         np.int64(cap), np.int32(bool(with_graph)), out_sender, out_receiver, out_shifts, out_pad, slot, sender32,
         receiver32, rowptr, perm_t])
    return out_sender, out_receiver, out_shifts, out_pad, slot, sender32, receiver32, rowptr, perm_t


def _listed_rank(receiver: Tensor, count: Tensor, n: int, keep: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``edge_place``'s keep (int32), rank and list row pointers of a list whose first ``count`` entries are kept
    (those of them ``keep`` selects, when given)."""
    steps = torch.arange(receiver.shape[0], device=receiver.device)
    valid = steps < count
    if keep is None:
        kept, rank = valid, torch.minimum(steps + 1, count)  # the inclusive prefix sum of keep, without a scan
    else:
        kept = valid & keep
        rank = torch.cumsum(kept, 0)
    # entries of receiver < r (the stale tail sorts last, as row n)
    list_rowptr = torch.searchsorted(torch.where(valid, receiver, n), torch.arange(n + 1, device=receiver.device))
    return kept.to(torch.int32), rank, list_rowptr


def _sender_transpose(sender32: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """rowptr_t (int64 [n + 1]) and perm_t (int32): the slots by sender, in a stable sort (int32 keys: half the
    radix passes of the int64 argsort of ``layout_edges``)."""
    senders, order = torch.sort(sender32, stable=True)
    rowptr_t = torch.searchsorted(senders, torch.arange(n + 1, dtype=torch.int32, device=sender32.device))
    return rowptr_t, order.to(torch.int32)


def layout_listed(sender: Tensor, receiver: Tensor, vectors: Tensor, count: Tensor, num_nodes: int, capacity: int,
                  pad_vector: Tensor, with_graph: bool, keep: Tensor | None = None) -> EdgeLayout:
    """``layout_edges((arange(V) < count) & keep, sender, receiver, vectors, num_nodes, capacity, pad_vector,
    with_graph)``, identical, for a list whose first ``count`` (int64 0-d, on the list's device) of V entries are
    receiver-ascending and are the edges (those ``keep``, bool [V], selects; None: all), and whose later entries are
    anything in range (LAMMPS's pairs: no reverses). sender, receiver: int64 [V]; vectors: float [V, 3]. On CUDA
    (float32/64) the ``edge_place`` kernel without reverses and a stable sort of the int32 senders for the transpose;
    no host read: capture-safe. Elsewhere the torch one."""
    n, cap, pairs, dtype, device = int(num_nodes), int(capacity), sender.shape[0], vectors.dtype, sender.device
    suffix = DTYPE_SUFFIX.get(dtype)
    if not sender.is_cuda or suffix is None:
        selected = torch.arange(pairs, device=device) < count
        return layout_edges(selected if keep is None else selected & keep, sender, receiver, vectors, n, cap,
                            pad_vector, with_graph)
    if n < 1 or cap < 0:
        raise ValueError(f"layout_listed: expected num_nodes >= 1 and capacity >= 0, got {num_nodes}, {capacity}")
    pad_vector = pad_vector.to(dtype).contiguous()
    for name, t, want in (("sender", sender, torch.int64), ("receiver", receiver, torch.int64),
                          ("vectors", vectors, dtype), ("count", count, torch.int64),
                          ("pad_vector", pad_vector, dtype)):
        if t.dtype != want or t.device != device:
            raise ValueError(f"layout_listed: {name} must be a {want} tensor on {device}, got {t.dtype} on "
                             f"{t.device}")
    sender, receiver, vectors = sender.contiguous(), receiver.contiguous(), vectors.contiguous()
    keep, rank, list_rowptr = _listed_rank(receiver, count, n, keep)
    out_sender, out_receiver, out_shifts, out_pad, slot, sender32, receiver32, rowptr, _ = _place(
        keep, rank, sender, receiver, vectors, list_rowptr, None, pad_vector, n, cap, with_graph)
    graph = None
    if with_graph:
        rowptr_t, perm_t = _sender_transpose(sender32, n)
        graph = GraphTensors(sender32, receiver32, rowptr, torch.zeros(0, dtype=torch.int32, device=device), rowptr_t,
                             perm_t)
    count = rank[-1] if pairs else torch.zeros((), dtype=torch.int64, device=device)
    return EdgeLayout(out_sender, out_receiver, out_shifts, out_pad, count, graph, slot)


def layout_within(positions: Tensor, cell: Tensor, sender: Tensor, receiver: Tensor, unit_shifts: Tensor,
                  valid: Tensor, cutoff: float, num_nodes: int, capacity: int, pad_vector: Tensor, with_graph: bool,
                  topology: EdgeTopology | None) -> EdgeLayout:
    """``layout_edges`` of the ``valid`` entries within ``cutoff`` (``edges_within``); on CUDA with a ``topology``
    the kernels (``padded_layout_cuda``: an edge at the cutoff to rounding may fall the other way; it adds zero)."""
    if topology is not None and positions.is_cuda and positions.dtype in (torch.float32, torch.float64):
        dtype = positions.dtype
        return padded_layout_cuda(positions.contiguous(), cell.to(dtype).contiguous(), sender, receiver,
                                  unit_shifts.to(dtype), valid, topology.rowptr, topology.reverse, cutoff, capacity,
                                  pad_vector.to(dtype), with_graph)
    _, _, inside = edges_within(positions, cell, sender, receiver, unit_shifts, cutoff)
    return layout_edges(inside & valid, sender, receiver, unit_shifts, num_nodes, capacity, pad_vector, with_graph,
                        topology)


def conv_graph(layout: EdgeLayout, num_nodes: int) -> ConvGraph:
    """A deterministic ``ConvGraph`` over the layout's graph tensors, without the constructor's device reads."""
    if layout.graph is None:
        raise ValueError("conv_graph: the layout was built with with_graph=False")
    return ConvGraph.trusted(layout.graph, num_nodes, deterministic=True)
