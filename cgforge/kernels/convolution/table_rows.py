"""The table convolution and the row map after it, made chunk by chunk of receiver rows:

    out = out_fn(conv(x, y, W(r)))      out_fn: an affine map of each row (e.g. the layer's next linear)

A message-passing block's convolution output is often its widest per-node tensor (MACE-MP-medium's second
layer: [N, 5120], 21 GB at a million atoms) and the linear right after it narrows it ([N, 2048]). Here the
kernels write one range of receiver rows at a time, ``out_fn`` maps that range and the wide rows are dropped: in
the forward they exist one chunk at a time. The kernels need no copy of the graph for a range: they take the
CSR row pointer sliced to it and read absolute edge positions (and edge ids through ``perm``). Nothing is read
on the host, so the step stays capturable in a CUDA graph, and every row is summed in the whole graph's order.

The backward forms the convolution's gradient once, out_fn's transpose applied chunk by chunk (the
vector-Jacobian product of an affine map is its linear part's transpose at any point: taken at zero rows), and
runs the table backward over the whole graph. Both are differentiable ops, so second derivatives work.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .table_ops import conv_table_backward, conv_table_forward

__all__ = ["conv_table_rows", "row_map_transpose", "row_ranges"]

RowMap = Callable[[torch.Tensor], torch.Tensor]


def row_ranges(rows: int, chunk_rows: int) -> list[tuple[int, int]]:
    """[r0, r1) ranges of ``chunk_rows`` rows covering ``rows`` (one empty range when there are none)."""
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    return [(r0, min(r0 + chunk_rows, rows)) for r0 in range(0, max(rows, 1), chunk_rows)]


def row_map_transpose(out_fn: RowMap, g: torch.Tensor, width: int, ranges: list[tuple[int, int]]) -> torch.Tensor:
    """The gradient of an affine row map's ``width``-wide input rows from ``g``, that of its output rows, range by
    range: its vector-Jacobian product, the same at every point, so taken at zero rows (differentiable in g when
    grad mode is on: a double backward). Shared with the streaming convolution."""
    keep_graph = torch.is_grad_enabled()  # a double backward: gc stays a function of g
    gc = g.new_empty(g.shape[0], width)
    for r0, r1 in ranges:
        with torch.enable_grad():
            z = g.new_zeros(r1 - r0, width, requires_grad=True)
            gc[r0:r1] = torch.autograd.grad(out_fn(z), z, g[r0:r1], create_graph=keep_graph)[0]
    return gc


class _TableConvRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, r, coeffs, out_fn, chunk_rows, width, r_max, key, *graph):  # noqa: D102
        sender, receiver, rowptr, perm, rowptr_t, perm_t = graph
        ranges = row_ranges(rowptr.shape[0] - 1, chunk_rows)
        out = None
        for r0, r1 in ranges:
            rows = conv_table_forward(x, y, r, coeffs, sender, receiver, rowptr[r0:r1 + 1], perm, rowptr_t, perm_t,
                                      r_max, key, True)
            part = out_fn(rows)
            del rows  # the wide rows go before the next range's are made
            if out is None:
                out = part.new_empty(rowptr.shape[0] - 1, part.shape[1])
            out[r0:r1] = part
        ctx.save_for_backward(x, y, r, coeffs, *graph)
        ctx.out_fn, ctx.ranges, ctx.width, ctx.r_max, ctx.key = out_fn, ranges, width, r_max, key
        return out

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        x, y, r, coeffs, *graph = ctx.saved_tensors
        gc = row_map_transpose(ctx.out_fn, g, ctx.width, ctx.ranges)
        gx, gy, gr = conv_table_backward(x, y, r, coeffs, gc, *graph, ctx.r_max, ctx.key, True)
        return (gx, gy, gr) + (None,) * 12


def conv_table_rows(x: torch.Tensor, y: torch.Tensor, r: torch.Tensor, coeffs: torch.Tensor, graph: tuple,
                    r_max: float, key: str, width: int, out_fn: RowMap, chunk_rows: int) -> torch.Tensor:
    """``out_fn(conv_table_forward(x, y, r, coeffs, *graph, r_max, key, True))`` with the convolution's rows
    (``width`` wide) made and mapped ``chunk_rows`` at a time. ``graph``: the six ``GraphTensors`` of a
    deterministic graph. ``out_fn``'s parameters are constants (no gradient reaches them)."""
    return _TableConvRows.apply(x, y, r, coeffs, out_fn, int(chunk_rows), int(width), float(r_max), key, *graph)
