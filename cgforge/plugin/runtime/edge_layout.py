"""Model edges in a fixed-capacity, receiver-sorted layout, built on the device without a host sync.

The potential's Verlet list holds the pairs within ``cutoff + skin``. The model gets the pairs selected by
a mask (within the cutoff now, or all of them), laid out in ``capacity`` slots:

- the selected edges keep their (receiver, sender) order;
- the ``capacity - count`` free slots hold *padding edges*: self-edges (k, k) whose vector is
  ``pad_offset`` (longer than the cutoff), spread evenly over the atoms and placed at the end of their
  atom's row, so the whole array stays sorted by receiver and no row grows long. For a model whose edges
  beyond the cutoff contribute exactly zero (``ModelAdapter.zero_beyond_cutoff``), padding changes nothing.

Every index is computed with device arithmetic (cumsum, index_copy, and without a topology index_add and
a stable sort for the transpose), no ``nonzero`` and no ``.item()``: the layout can run inside a captured
CUDA graph, where the number of selected edges is known only on the device. ``count`` comes back as a
device scalar; a count above the capacity (overflow) leaves a garbage layout that stays in bounds, and the
caller recomputes with more room.

``conv_graph`` wraps the layout's graph tensors in a ``ConvGraph`` without the constructor's checks (which
read device values): the layout is valid by construction, and a test checks it field by field against
``ConvGraph``'s own constructor.

With an ``EdgeTopology`` of the list (built once per neighbour-list rebuild: its row pointers and the reverse
of every edge) a step needs no sort and no atomics: kept edges per row come from the row pointers, and since
the kept set is symmetric (an edge is kept with its reverse) every node sends as many edges as it receives,
so the transpose's row pointers are the layout's own and its permutation is "the slot of my reverse edge".

``layout_within`` cuts a step's edges from the list and lays them out: on CUDA with a topology in three kernels
(``cgforge.kernels.edge_layout``: the mask, a prefix sum, every slot), where ``edges_within`` and ``layout_edges``
are ~70 torch kernels; elsewhere those two (the reference).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from cgforge.kernels import ConvGraph
from cgforge.kernels.convolution import GraphTensors
from cgforge.kernels.edge_layout import padded_layout_cuda
from cgforge.kernels.pair_reverse import pair_reverse_cuda

from .neighbours import edges_within

__all__ = ["EdgeLayout", "EdgeTopology", "conv_graph", "edge_topology", "layout_edges", "layout_within",
           "pad_offset_vector"]


@dataclass
class EdgeLayout:
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
    to ``capacity`` entries; None when an edge has no reverse in the list. On CUDA one kernel and a host read
    (``pair_reverse_cuda``), elsewhere a sort and host reads: for a neighbour-list rebuild, not for a step."""
    n, count = int(num_nodes), int(sender.shape[0])
    capacity = count if capacity is None else int(capacity)
    device = sender.device
    reverse = torch.arange(capacity, device=device)
    rowptr = torch.searchsorted(receiver, torch.arange(n + 1, device=device))
    if count and _on_reverse_kernel(sender):
        found, missing = pair_reverse_cuda(sender.contiguous(), receiver.contiguous(),
                                           shifts.to(torch.int64).contiguous(), rowptr)
        if bool(missing[0]):
            return None
        reverse[:count] = found
    elif count:
        reach = int(shifts.abs().max())
        side = 2 * reach + 1
        if n * n * side**3 >= 2**62:  # the keys below would overflow
            return None

        def key(s: Tensor, r: Tensor, image: Tensor) -> Tensor:
            code = ((image[:, 0] + reach) * side + image[:, 1] + reach) * side + image[:, 2] + reach
            return (r * n + s) * side**3 + code

        shifts = shifts.to(torch.int64)
        keys = key(sender, receiver, shifts)
        order = torch.argsort(keys)
        sorted_keys = keys.index_select(0, order)
        wanted = key(receiver, sender, -shifts)
        where = torch.searchsorted(sorted_keys, wanted).clamp(max=count - 1)
        if not bool((sorted_keys.index_select(0, where) == wanted).all()):
            return None
        reverse[:count] = order.index_select(0, where)
    return EdgeTopology(rowptr, reverse)


def pad_offset_vector(cutoff: float, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The vector of a padding edge: well beyond the cutoff, never zero (spherical harmonics normalise it).

    Made once, outside any capture (a tensor from host values is a host-to-device copy)."""
    return torch.tensor([2.0 * float(cutoff) + 1.0, 0.0, 0.0], dtype=dtype, device=device)


def layout_edges(keep: Tensor, sender: Tensor, receiver: Tensor, unit_shifts: Tensor, num_nodes: int,
                 capacity: int, pad_vector: Tensor, with_graph: bool,
                 topology: EdgeTopology | None = None) -> EdgeLayout:
    """The edges where ``keep`` is set, receiver-sorted, padded to ``capacity`` slots (see the module doc).

    keep: bool [V]; sender, receiver: int64 [V] with receiver ascending; unit_shifts: float [V, 3];
    pad_vector: float [3] on the same device. Edges not kept may be anything (in range). With ``topology``
    an edge is kept only together with its reverse. ``slot`` of the result maps each input edge to its slot
    (gradients per slot gather back to the input edges through it). Allocates its outputs; reads nothing back
    to the host and copies nothing from it.
    """
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
    # the padding vector where a slot pads, else zero: a mask, not two scatters of [C, 3] rows (~30 us each on an
    # H100 at 5184 atoms)
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


def _on_reverse_kernel(sender: Tensor) -> bool:
    """Whether ``edge_topology`` finds the reverse pairs with ``pair_reverse_cuda`` (on CUDA; elsewhere a sort of
    int64 keys)."""
    return sender.is_cuda


def _on_layout_kernels(positions: Tensor, topology: EdgeTopology | None) -> bool:
    """Whether ``layout_within`` takes the kernels: a topology, FP32/FP64 positions on CUDA."""
    return topology is not None and positions.is_cuda and positions.dtype in (torch.float32, torch.float64)


def layout_within(positions: Tensor, cell: Tensor, sender: Tensor, receiver: Tensor, unit_shifts: Tensor,
                  valid: Tensor, cutoff: float, num_nodes: int, capacity: int, pad_vector: Tensor, with_graph: bool,
                  topology: EdgeTopology | None) -> EdgeLayout:
    """The valid list entries within ``cutoff`` at these positions, laid out as ``layout_edges`` does (``keep``
    = ``edges_within``'s mask and ``valid``): one layout of ``capacity`` slots, nothing read back to the host. On
    CUDA with a ``topology`` the kernels of ``cgforge.kernels.edge_layout`` (an edge at the cutoff to rounding
    may fall the other way than in the torch expression; its contribution is zero there)."""
    if _on_layout_kernels(positions, topology):
        dtype = positions.dtype
        out = padded_layout_cuda(positions.contiguous(), cell.to(dtype).contiguous(), sender, receiver,
                                 unit_shifts.to(dtype), valid, topology.rowptr, topology.reverse, cutoff,
                                 capacity, pad_vector.to(dtype), with_graph)
        graph = (GraphTensors(out.sender32, out.receiver32, out.rowptr,
                              torch.zeros(0, dtype=torch.int32, device=out.rowptr.device), out.rowptr, out.perm_t)
                 if with_graph else None)
        return EdgeLayout(out.sender, out.receiver, out.shifts, out.padding, out.count, graph, out.slot)
    _, _, inside = edges_within(positions, cell, sender, receiver, unit_shifts, cutoff)
    return layout_edges(inside & valid, sender, receiver, unit_shifts, num_nodes, capacity, pad_vector, with_graph,
                        topology)


def conv_graph(layout: EdgeLayout, num_nodes: int) -> ConvGraph:
    """A deterministic ``ConvGraph`` over the layout's graph tensors, without the constructor's device reads."""
    if layout.graph is None:
        raise ValueError("conv_graph: the layout was built with with_graph=False")
    return ConvGraph.trusted(layout.graph, num_nodes, deterministic=True)
