"""Streaming radial convolution: per-edge weights computed chunk by chunk, never stored for all edges.

    out[i] = sum over edges e into i of TP(x[sender e], y_e, radial(r_e) * s_e)

Forward: receiver ranges whose edges fit the chunk, each summed in the whole graph's order. Backward: sender
ranges of the transposed graph, the weights remade and dW sent through ``radial`` at once. The radial callable's
parameters are constants; the backward is not differentiable again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch

from ..core.tuning import RowPolicy
from . import ops
from .graph import ConvGraph
from .module import Convolution
from .table_rows import map_rows, row_map_transpose

# (rows of each edge input for one chunk of edges) -> (y, weights) rows of that chunk
EdgeFunction = Callable[..., tuple[torch.Tensor, torch.Tensor]]


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
    """Host copies of the two CSR row pointers and the chunk ranges of one graph, read once per call (not cached on the
    graph, whose tensors an owner may refill in place)."""

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


def _edge_rows(edge_fn: EdgeFunction, rows: list[torch.Tensor], conv: Convolution, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's (y, w) in the convolution's dtype (a model may run its radial MLP in another), their shapes
    checked before any kernel reads them."""
    y, w = edge_fn(*rows)
    count = rows[0].shape[0] if rows else 0
    for name, t, width in (("y", y, conv.irreps_in2.dim), ("weights", w, conv.weight_numel)):
        if tuple(t.shape) != (count, width):
            raise ValueError(f"edge_fn must return y [C, {conv.irreps_in2.dim}] and weights [C, {conv.weight_numel}] "
                             f"for C edges; its {name} for {count} edges has shape {list(t.shape)}")
    return y.to(dtype).contiguous(), w.to(dtype).contiguous()


class _StreamingConv(torch.autograd.Function):
    """out = out_fn(conv(x, y, w)) with (y, w) = edge_fn(*(t[chunk] for t in edge_inputs)) made per chunk of
    edges (out_fn None: the identity)."""

    @staticmethod
    def forward(ctx, x, conv, edge_fn, out_fn, graph, chunk_edges, min_rows, *edge_inputs):  # noqa: D102
        t = graph.tensors()
        chunks = _Chunks(graph, chunk_edges, min_rows)
        out = x.new_empty(graph.num_nodes, conv.irreps_out.dim) if out_fn is None else None
        empty_ptr, empty_idx = t.rowptr.new_empty(0), t.sender.new_empty(0)
        for r0, r1 in chunks.forward:
            e0, e1 = int(chunks.rowptr[r0]), int(chunks.rowptr[r1])
            ids = _edge_ids(t.perm, e0, e1, x.device)
            y, w = _edge_rows(edge_fn, [e.index_select(0, ids) for e in edge_inputs], conv, x.dtype)
            rowptr = t.rowptr[r0:r1 + 1] - e0
            receiver = t.receiver.index_select(0, ids) - r0  # the reference path's rows; kernels read rowptr
            rows = ops.conv_forward(x, y, w, t.sender.index_select(0, ids), receiver, rowptr, empty_idx,
                                    empty_ptr, empty_idx, conv.key, True)
            if out_fn is None:
                out[r0:r1] = rows
            else:
                out = map_rows(out_fn, rows, out, r0, graph.num_nodes)
        if out is None:  # no rows: out_fn's width from zero rows
            out = out_fn(x.new_zeros(0, conv.irreps_out.dim))
        ctx.save_for_backward(x, *edge_inputs)
        ctx.conv, ctx.edge_fn, ctx.out_fn, ctx.graph, ctx.chunks = conv, edge_fn, out_fn, graph, chunks
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):  # noqa: D102
        x, *edge_inputs = ctx.saved_tensors
        conv, graph, chunks = ctx.conv, ctx.graph, ctx.chunks
        t = graph.tensors()
        if ctx.out_fn is None:
            g = g.contiguous()
        else:
            g = row_map_transpose(ctx.out_fn, g, conv.irreps_out.dim, chunks.forward)
        gx = torch.empty_like(x)
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[7:]) if need]
        grads = [torch.zeros_like(edge_inputs[i]) for i in wanted]
        empty_ptr, empty_idx = t.rowptr.new_empty(0), t.sender.new_empty(0)
        for r0, r1 in chunks.backward:
            e0, e1 = int(chunks.rowptr_t[r0]), int(chunks.rowptr_t[r1])
            ids = _edge_ids(t.perm_t, e0, e1, x.device)
            rows = [e.index_select(0, ids) for e in edge_inputs]
            leaves = [rows[i].detach().requires_grad_() for i in wanted]
            for i, leaf in zip(wanted, leaves, strict=True):
                rows[i] = leaf
            with torch.enable_grad():  # recompute this chunk's (y, w), keeping the graph to the edge inputs
                y, w = _edge_rows(ctx.edge_fn, rows, conv, x.dtype)
            rowptr_t = t.rowptr_t[r0:r1 + 1] - e0
            local = torch.arange(e1 - e0, dtype=torch.int32, device=x.device)
            sender = t.sender.index_select(0, ids) - r0  # rows of the x slice (reference path)
            gxc, gyc, gwc = ops.conv_backward(x[r0:r1], y.detach(), w.detach(), g, sender,
                                              t.receiver.index_select(0, ids), empty_ptr, empty_idx, rowptr_t,
                                              local, conv.key, True)
            gx[r0:r1] = gxc
            if leaves:
                outputs = [(o, go) for o, go in ((y, gyc), (w, gwc)) if o.requires_grad]
                chunk_grads = torch.autograd.grad([o for o, _ in outputs], leaves, [go for _, go in outputs],
                                                  allow_unused=True) if outputs else [None] * len(leaves)
                for full, part in zip(grads, chunk_grads, strict=True):
                    if part is not None:
                        full.index_copy_(0, ids, part.to(full.dtype))
        by_input = dict(zip(wanted, grads, strict=True))
        return (gx, None, None, None, None, None, None, *(by_input.get(i) for i in range(len(edge_inputs))))


def streaming_edge_convolution(conv: Convolution, x: torch.Tensor, edge_inputs: Sequence[torch.Tensor],
                               edge_fn: EdgeFunction, graph: ConvGraph, chunk_edges: int,
                               min_rows: int | None = None, constants: Iterable[torch.nn.Module] = (),
                               out_fn: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """``conv(x, y, w, graph)`` (or ``out_fn(conv(...))``, an affine row map per chunk of rows) where ``(y, w) =
    edge_fn(*edge_inputs)`` is made row by row per chunk of edges and remade in the backward; gradients reach x and
    the edge inputs. ``constants``: modules whose parameters must not require grad. Needs a deterministic graph. A
    chunk: at most ``chunk_edges`` edges or at least ``min_rows`` rows (``RowPolicy.min_chunk_rows`` on CUDA)."""
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
    if x.dim() != 2 or x.shape != (graph.num_nodes, conv.irreps_in1.dim):
        raise ValueError(f"x must have shape [{graph.num_nodes}, {conv.irreps_in1.dim}], got {list(x.shape)}")
    edge_inputs = tuple(edge_inputs)
    for k, e in enumerate(edge_inputs):
        if not isinstance(e, torch.Tensor) or e.dim() < 1 or e.shape[0] != graph.num_edges:
            raise ValueError(f"edge_inputs[{k}] must be a tensor with one row per edge ({graph.num_edges}), got "
                             f"{list(getattr(e, 'shape', [])) or type(e).__name__}")
    if out_fn is not None and not callable(out_fn):
        raise TypeError(f"out_fn must be a callable row map or None, got {type(out_fn).__name__}")
    if isinstance(out_fn, torch.nn.Module):
        constants = (*constants, out_fn)
    if torch.is_grad_enabled():
        trained = [n for m in constants for n, p in m.named_parameters() if p.requires_grad]
        if trained:
            raise RuntimeError(
                f"streaming_convolution treats the radial parameters as constants, but {trained[:3]} require "
                "grad: call requires_grad_(False) on the radial module (inference), or use the stored path "
                "to train")
    if min_rows is None:
        min_rows = RowPolicy.min_chunk_rows if x.device.type == "cuda" else 1
    return _StreamingConv.apply(x, conv, edge_fn, out_fn, graph, chunk_edges, int(min_rows), *edge_inputs)


def streaming_convolution(conv: Convolution, x: torch.Tensor, y: torch.Tensor, radial_in: torch.Tensor,
                          radial: Callable[[torch.Tensor], torch.Tensor], graph: ConvGraph, chunk_edges: int,
                          scale: torch.Tensor | None = None, min_rows: int | None = None) -> torch.Tensor:
    """``conv(x, y, radial(radial_in) * scale, graph)`` with the weights made and used per chunk of edges: radial_in
    [E, F] -> [E, weight_numel] row by row; scale None or [E, 1]. Gradients reach x, y, radial_in and scale."""
    edges = graph.num_edges if isinstance(graph, ConvGraph) else None
    for name, t, width in (("y", y, conv.irreps_in2.dim), ("radial_in", radial_in, None), ("scale", scale, 1)):
        if t is None or edges is None:
            continue
        if t.dim() != 2 or t.shape[0] != edges or (width is not None and t.shape[1] != width):
            want = f"[{edges}, {width if width is not None else 'F'}]"
            raise ValueError(f"{name} must have shape {want} (one row per edge), got {list(t.shape)}")

    def edge_fn(y_rows: torch.Tensor, radial_rows: torch.Tensor, *scale_rows: torch.Tensor):
        w = radial(radial_rows)
        return y_rows, (w * scale_rows[0] if scale_rows else w)

    inputs = (y, radial_in) if scale is None else (y, radial_in, scale)
    constants = (radial,) if isinstance(radial, torch.nn.Module) else ()
    return streaming_edge_convolution(conv, x, inputs, edge_fn, graph, chunk_edges, min_rows, constants)
