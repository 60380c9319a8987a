"""Streaming radial convolution: per-edge weights computed chunk by chunk, never stored for all edges.

    out[i] = sum over edges e into i of TP(x[sender e], y_e, radial(r_e) * s_e)

A message-passing layer usually computes its tensor-product weights for every edge first
(``W = radial(r)``, [E, weight_numel]: 1.8 GB per MACE-MP-medium layer at 436k edges), reads them
back in the convolution and keeps them for the backward. Here the weights of one chunk of edges at a
time are computed, consumed and dropped:

- forward: receiver ranges whose edges fit the chunk; each range's output rows are summed by the
  convolution kernel in the same CSR order as the whole graph would be (bitwise the same sums);
- backward: sender ranges of the transposed graph; the chunk's weights are recomputed, the
  convolution backward gives dx for the range's rows and dy, dW for its edges, and dW goes back
  through ``radial`` at once (dW is never stored for all edges either).

Memory per chunk is ~ chunk_edges x (3 weight_numel + radial hidden) values; what stays per edge is
only what the layer is given (indices, y, the radial input). The radial callable's parameters are
constants here (inference: forces and stress differentiate inputs, not parameters): the streaming path
refuses parameters that require grad while grad is on. The backward is not differentiable again
(no force training through this path).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from . import ops
from .graph import ConvGraph
from .module import Convolution

__all__ = ["MIN_CHUNK_ROWS", "chunk_ranges", "streaming_convolution"]


# The convolution kernels run one warp per row and each warp walks its row's edges in turn, so a launch
# takes about one warp's latency however few rows it has (H100, MACE-MP-medium layer 2: ~1 ms for 430 rows
# or 5184). A chunk of fewer rows than about one wave of resident warps leaves SMs idle: chunks keep at
# least this many rows, whatever their edge budget.
MIN_CHUNK_ROWS = 4096


def chunk_ranges(rowptr: np.ndarray, chunk_edges: int, min_rows: int = 1) -> list[tuple[int, int]]:
    """Consecutive row ranges [r0, r1) covering every row, each holding at most ``chunk_edges`` edges
    unless it has only ``min_rows`` rows (or one row) that alone hold more."""
    if chunk_edges < 1 or min_rows < 1:
        raise ValueError(f"chunk_edges and min_rows must be >= 1, got {chunk_edges} and {min_rows}")
    rows = len(rowptr) - 1
    ranges, r0 = [], 0
    while r0 < rows:
        # the last row r1 with rowptr[r1] - rowptr[r0] <= chunk_edges
        r1 = int(np.searchsorted(rowptr, rowptr[r0] + chunk_edges, side="right")) - 1
        r1 = min(max(r1, r0 + min_rows), rows)
        ranges.append((r0, r1))
        r0 = r1
    return ranges


class _Chunks:
    """Host copies of the two CSR row pointers and the chunk ranges of one graph: read once per call
    (the forward's copy serves the backward; not cached on the graph, whose tensors an owner may refill
    in place between calls)."""

    def __init__(self, graph: ConvGraph, chunk_edges: int, min_rows: int) -> None:
        t = graph.tensors()
        self.rowptr = t.rowptr.cpu().numpy()
        self.rowptr_t = t.rowptr_t.cpu().numpy()
        self.forward = chunk_ranges(self.rowptr, chunk_edges, min_rows)
        self.backward = chunk_ranges(self.rowptr_t, chunk_edges, min_rows)


def _edge_ids(order: torch.Tensor, e0: int, e1: int, device: torch.device) -> torch.Tensor:
    """Edge ids of positions [e0, e1) of a CSR order (``order`` empty: the edges already are in it)."""
    if order.numel():
        return order[e0:e1].long()
    return torch.arange(e0, e1, device=device)


def _weights(radial: Callable[[torch.Tensor], torch.Tensor], radial_in: torch.Tensor,
             scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    w = radial(radial_in)
    w = w if scale is None else w * scale
    return w.to(dtype)  # the convolution's dtype (a model may run its radial MLP in another)


class _StreamingConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, radial_in, scale, conv, radial, graph, chunk_edges, min_rows):  # noqa: D102
        t = graph.tensors()
        chunks = _Chunks(graph, chunk_edges, min_rows)
        out = x.new_empty(graph.num_nodes, conv.irreps_out.dim)
        empty_ptr, empty_idx = t.rowptr.new_empty(0), t.sender.new_empty(0)
        for r0, r1 in chunks.forward:
            e0, e1 = int(chunks.rowptr[r0]), int(chunks.rowptr[r1])
            ids = _edge_ids(t.perm, e0, e1, x.device)
            w = _weights(radial, radial_in.index_select(0, ids),
                         None if scale is None else scale.index_select(0, ids), x.dtype)
            rowptr = t.rowptr[r0:r1 + 1] - e0
            receiver = t.receiver.index_select(0, ids) - r0  # the reference path's rows; kernels read rowptr
            out[r0:r1] = ops.conv_forward(x, y.index_select(0, ids), w.contiguous(), t.sender.index_select(0, ids),
                                          receiver, rowptr, empty_idx, empty_ptr, empty_idx, conv.key, True)
        ctx.save_for_backward(x, y, radial_in, scale)
        ctx.conv, ctx.radial, ctx.graph, ctx.chunks = conv, radial, graph, chunks
        ctx.has_scale = scale is not None
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):  # noqa: D102
        x, y, radial_in, scale = ctx.saved_tensors
        conv, radial, graph = ctx.conv, ctx.radial, ctx.graph
        t = graph.tensors()
        chunks = ctx.chunks
        g = g.contiguous()
        gx = torch.empty_like(x)
        gy = torch.empty_like(y)
        g_radial = torch.empty_like(radial_in)
        g_scale = torch.empty_like(scale) if ctx.has_scale else None
        empty_ptr, empty_idx = t.rowptr.new_empty(0), t.sender.new_empty(0)
        for r0, r1 in chunks.backward:
            e0, e1 = int(chunks.rowptr_t[r0]), int(chunks.rowptr_t[r1])
            ids = _edge_ids(t.perm_t, e0, e1, x.device)
            with torch.enable_grad():  # recompute this chunk's weights, keeping the graph to radial_in
                r_in = radial_in.index_select(0, ids).detach().requires_grad_()
                s_in = scale.index_select(0, ids).detach().requires_grad_() if ctx.has_scale else None
                w = _weights(radial, r_in, s_in, x.dtype)
            rowptr_t = t.rowptr_t[r0:r1 + 1] - e0
            local = torch.arange(e1 - e0, dtype=torch.int32, device=x.device)
            sender = t.sender.index_select(0, ids) - r0  # rows of the x slice (reference path)
            gxc, gyc, gwc = ops.conv_backward(x[r0:r1], y.index_select(0, ids), w.detach().contiguous(), g, sender,
                                              t.receiver.index_select(0, ids), empty_ptr, empty_idx, rowptr_t,
                                              local, conv.key, True)
            gx[r0:r1] = gxc
            gy.index_copy_(0, ids, gyc)
            inputs = (r_in, s_in) if ctx.has_scale else (r_in,)
            grads = torch.autograd.grad(w, inputs, gwc)
            g_radial.index_copy_(0, ids, grads[0])
            if ctx.has_scale:
                g_scale.index_copy_(0, ids, grads[1])
        return gx, gy, g_radial, g_scale, None, None, None, None, None


def streaming_convolution(conv: Convolution, x: torch.Tensor, y: torch.Tensor, radial_in: torch.Tensor,
                          radial: Callable[[torch.Tensor], torch.Tensor], graph: ConvGraph, chunk_edges: int,
                          scale: torch.Tensor | None = None, min_rows: int | None = None) -> torch.Tensor:
    """``conv(x, y, radial(radial_in) * scale, graph)`` with the weights made and used per chunk of edges.

    x [N, irreps_in1]; y [E, irreps_in2]; radial_in [E, F] (e.g. the radial basis); ``radial`` maps
    [C, F] rows to [C, weight_numel] rows independently (e.g. an MLP); scale None or [E, 1]. Needs a
    deterministic graph. Gradients flow to x, y, radial_in and scale. A chunk holds at most
    ``chunk_edges`` edges or at least ``min_rows`` rows (default: ``MIN_CHUNK_ROWS`` on CUDA, 1 on a CPU).
    """
    if not isinstance(conv, Convolution):
        raise TypeError(f"conv must be a cgforge Convolution, got {type(conv).__name__}")
    if not isinstance(graph, ConvGraph):
        raise TypeError(f"graph must be a cgforge ConvGraph, got {type(graph).__name__}")
    if not graph.deterministic:
        raise ValueError("streaming_convolution needs a deterministic ConvGraph (CSR rows for both passes)")
    if isinstance(chunk_edges, bool) or not isinstance(chunk_edges, int) or chunk_edges < 1:
        raise ValueError(f"chunk_edges must be a positive int, got {chunk_edges!r}")
    if conv.weight_numel == 0 or conv.shared_weights:
        raise ValueError("streaming_convolution needs per-edge weights (shared_weights=False, weight_numel > 0)")
    edges = graph.num_edges
    for name, t, width in (("y", y, conv.irreps_in2.dim), ("radial_in", radial_in, None), ("scale", scale, 1)):
        if t is None:
            continue
        if t.dim() != 2 or t.shape[0] != edges or (width is not None and t.shape[1] != width):
            want = f"[{edges}, {width if width is not None else 'F'}]"
            raise ValueError(f"{name} must have shape {want} (one row per edge), got {list(t.shape)}")
    if x.dim() != 2 or x.shape != (graph.num_nodes, conv.irreps_in1.dim):
        raise ValueError(f"x must have shape [{graph.num_nodes}, {conv.irreps_in1.dim}], got {list(x.shape)}")
    if torch.is_grad_enabled() and isinstance(radial, torch.nn.Module):
        trained = [n for n, p in radial.named_parameters() if p.requires_grad]
        if trained:
            raise RuntimeError(
                f"streaming_convolution treats the radial parameters as constants, but {trained[:3]} require "
                "grad: call requires_grad_(False) on the radial module (inference), or use the stored path "
                "to train")
    if min_rows is None:
        min_rows = MIN_CHUNK_ROWS if x.device.type == "cuda" else 1
    return _StreamingConv.apply(x, y, radial_in, scale, conv, radial, graph, chunk_edges, int(min_rows))
