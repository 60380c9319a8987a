"""The table convolution and the row map after it, made chunk by chunk of receiver rows:

    out = out_fn(conv(x, y, W(r)))      out_fn: an affine map of each row (e.g. the layer's next linear)

The kernels write one range of receiver rows at a time (the CSR row pointer sliced, no host read), each summed in
the whole graph's order, and ``out_fn`` maps it. The backward forms the convolution's gradient once (out_fn's
transpose per chunk), or with ``TPTuning.backward_range_bytes`` per range of receivers too (``transposed_range``;
grad x then summed in range order), and runs the table backward; both are differentiable ops.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..radial_table.ops import radial_table_reference
from ..tensor_product import plan as plans
from ..tensor_product.launch import launch, needs_zero_fill
from ..tensor_product.layout import CONV_BACKWARD
from .ops import _reference_conv_backward
from .table_ops import _csr_edges, _table_args, conv_table_backward, conv_table_forward, needs_grad_x

RowMap = Callable[[torch.Tensor], torch.Tensor]


def row_ranges(rows: int, chunk_rows: int) -> list[tuple[int, int]]:
    """[r0, r1) ranges of ``chunk_rows`` rows covering ``rows`` (one empty range when there are none)."""
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    return [(r0, min(r0 + chunk_rows, rows)) for r0 in range(0, max(rows, 1), chunk_rows)]


def _backward_ranges(rows: int, width: int, itemsize: int, range_bytes: int | None) -> list[tuple[int, int]]:
    """Receiver-row ranges of a first-order backward: ``range_bytes`` of gradient each (None: one range)."""
    if range_bytes is None:
        return [(0, rows)]
    return row_ranges(rows, max(range_bytes // max(width * itemsize, 1), 1))


def map_rows(out_fn: RowMap, rows: torch.Tensor, out: torch.Tensor | None, r0: int, total: int) -> torch.Tensor:
    """``out[r0:r0 + len(rows)] = out_fn(rows)``, ``out`` ([total, out width]) made on the first call; returns it. A
    frozen linear map with ``map_into`` writes into ``out`` in place. Under no grad only."""
    into = getattr(out_fn, "map_into", None)
    if into is not None and not torch.is_grad_enabled():
        if out is None:
            out = rows.new_empty(total, out_fn.out_width)
        into(rows, out[r0:r0 + rows.shape[0]])
        return out
    part = out_fn(rows)
    if out is None:
        out = part.new_empty(total, part.shape[1])
    out[r0:r0 + rows.shape[0]] = part
    return out


def row_map_transpose(out_fn: RowMap, g: torch.Tensor, width: int, ranges: list[tuple[int, int]]) -> torch.Tensor:
    """The gradient of an affine row map's ``width``-wide input rows from ``g``, its output rows', range by range: the
    vector-Jacobian product at zero rows, or ``map_into``'s transpose in a first-order backward."""
    keep_graph = torch.is_grad_enabled()  # a double backward: gc stays a function of g
    gc = g.new_empty(g.shape[0], width)
    into = None if keep_graph else getattr(out_fn, "map_into", None)
    for r0, r1 in ranges:
        if into is not None:
            into(g[r0:r1], gc[r0:r1], True)
            continue
        with torch.enable_grad():
            z = g.new_zeros(r1 - r0, width, requires_grad=True)
            gc[r0:r1] = torch.autograd.grad(out_fn(z), z, g[r0:r1], create_graph=keep_graph)[0]
    return gc


def transposed_range(rowptr_t: torch.Tensor, perm_t: torch.Tensor, receiver: torch.Tensor, r0: int, r1: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The sender-major CSR (row pointer int64 [N + 1], edge ids int32 [E + 1], the last a dump) of the edges whose
    receiver is in [r0, r1), in the transposed CSR's order; no host reads."""
    edges = receiver.shape[0]
    ids = perm_t if perm_t.numel() else torch.arange(edges, dtype=torch.int32, device=receiver.device)
    rec = receiver.index_select(0, ids)
    inside = (rec >= r0) & (rec < r1)
    del rec
    count = torch.cumsum(inside, 0)  # in-range edges up to and including each transposed position
    rowptr = torch.cat([count.new_zeros(1), count]).index_select(0, rowptr_t)
    slot = torch.where(inside, count - 1, edges)
    del count, inside
    perm = torch.empty(edges + 1, dtype=torch.int32, device=receiver.device)
    perm.scatter_(0, slot, ids)
    return rowptr, perm


def conv_table_backward_by_ranges(x: torch.Tensor, y: torch.Tensor, r: torch.Tensor, coeffs: torch.Tensor,
                                  grad_rows: Callable[[int, int], torch.Tensor], graph: tuple,
                                  ranges: list[tuple[int, int]], r_max: float, key: str
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad x, grad y, grad r) of the deterministic table convolution, its output gradient made one range of
    receiver rows at a time by ``grad_rows(r0, r1)``. First order only."""
    sender, receiver, _, _, rowptr_t, perm_t = graph
    p = plans.get(key).problem
    x, y, r, coeffs = x.contiguous(), y.contiguous(), r.contiguous(), coeffs.contiguous()
    gx = torch.zeros_like(x)
    gy, gr = torch.zeros_like(y), torch.zeros_like(r)  # each edge's parts land once, from its receiver's range
    cuda = x.device.type == "cuda"
    w = None if cuda else radial_table_reference(r, coeffs, r_max)
    for r0, r1 in ranges:
        g = grad_rows(r0, r1).contiguous()
        rowptr_range, perm_range = transposed_range(rowptr_t, perm_t, receiver, r0, r1)
        shifted = (receiver - r0).to(torch.int32)  # the range's gradient rows, read at receiver - r0
        if cuda:
            part = torch.zeros_like(x) if needs_zero_fill(p, out_side=False) else torch.empty_like(x)
            args = [x, y, None, g, part, gy, None, rowptr_range, perm_range, None, shifted,
                    *_table_args(coeffs, r, r_max, gr)]
            launch(key, True, CONV_BACKWARD.with_table(), x.shape[0], args, x.dtype, x.device)
        else:  # the same CSR walked in torch: the edges the kernel would visit, and their gradients
            ids, senders = _csr_edges(rowptr_range, perm_range)
            part, gy_ids, gw_ids = _reference_conv_backward(p, x, y.index_select(0, ids), w.index_select(0, ids), g,
                                                            senders, shifted.index_select(0, ids))
            gy.index_add_(0, ids, gy_ids)
            gr.index_add_(0, ids, (gw_ids * radial_table_reference(r.index_select(0, ids), coeffs, r_max, 1)).sum(1))
        gx += part
    return gx, gy, gr


class _TableConvRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, r, coeffs, out_fn, chunk_rows, width, r_max, key, *graph):  # noqa: D102
        sender, receiver, rowptr, perm, rowptr_t, perm_t = graph
        ranges = row_ranges(rowptr.shape[0] - 1, chunk_rows)
        out = None
        for r0, r1 in ranges:
            rows = conv_table_forward(x, y, r, coeffs, sender, receiver, rowptr[r0:r1 + 1], perm, rowptr_t, perm_t,
                                      r_max, key, True)
            out = map_rows(out_fn, rows, out, r0, rowptr.shape[0] - 1)
            del rows  # the wide rows go before the next range's are made
        ctx.save_for_backward(x, y, r, coeffs, *graph)
        ctx.out_fn, ctx.ranges, ctx.width, ctx.r_max, ctx.key = out_fn, ranges, width, r_max, key
        return out

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        x, y, r, coeffs, *graph = ctx.saved_tensors
        ranges = _backward_ranges(g.shape[0], ctx.width, g.element_size(),
                                  plans.get(ctx.key).tuning.backward_range_bytes)
        if torch.is_grad_enabled() or len(ranges) < 2:  # a graph kept (double backward), or one range anyway
            gc = row_map_transpose(ctx.out_fn, g, ctx.width, ctx.ranges)
            grad_x = needs_grad_x(ctx, ctx.key, x.dtype)  # none: the kernel walks the receivers, forms no grad x
            gx, gy, gr = conv_table_backward(x, y, r, coeffs, gc, *graph, ctx.r_max, ctx.key, True, grad_x)
            gx = gx if grad_x else None
        else:
            def grad_rows(r0: int, r1: int) -> torch.Tensor:
                return row_map_transpose(ctx.out_fn, g[r0:r1], ctx.width, [(0, r1 - r0)])

            gx, gy, gr = conv_table_backward_by_ranges(x, y, r, coeffs, grad_rows, tuple(graph), ranges, ctx.r_max,
                                                       ctx.key)
        return (gx, gy, gr) + (None,) * 12


def conv_table_rows(x: torch.Tensor, y: torch.Tensor, r: torch.Tensor, coeffs: torch.Tensor, graph: tuple,
                    r_max: float, key: str, width: int, out_fn: RowMap, chunk_rows: int) -> torch.Tensor:
    """``out_fn(conv_table_forward(x, y, r, coeffs, *graph, r_max, key, True))`` with the ``width``-wide rows made
    and mapped ``chunk_rows`` at a time (a deterministic graph; ``out_fn``'s parameters are constants)."""
    return _TableConvRows.apply(x, y, r, coeffs, out_fn, int(chunk_rows), int(width), float(r_max), key, *graph)
