"""pos[receiver] - pos[sender] for laid-out edges, with a backward that needs no atomics.

The forces are that backward: per atom, the sum over edges received minus the sum over edges sent, each a
segment sum over the layout's CSR rows (receiver rows and the transpose) in a fixed order
(``cgforge.kernels.segment_sum``): deterministic, where autograd's ``index_select`` backward adds with atomics,
and free of host syncs (CUDA-graph capture).
"""

from __future__ import annotations

import torch
from torch import Tensor

from cgforge.kernels.segment_sum import segment_sum


class _EdgeDifferences(torch.autograd.Function):
    @staticmethod
    def forward(ctx, positions: Tensor, sender: Tensor, receiver: Tensor, rowptr: Tensor, perm_t: Tensor,
                rowptr_t: Tensor) -> Tensor:
        ctx.save_for_backward(rowptr, perm_t, rowptr_t)
        ctx.num_nodes = positions.shape[0]
        return positions.index_select(0, receiver) - positions.index_select(0, sender)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        rowptr, perm_t, rowptr_t = ctx.saved_tensors
        received = segment_sum(grad, rowptr)
        sent = segment_sum(grad.index_select(0, perm_t.long()), rowptr_t)
        return received - sent, None, None, None, None, None


def edge_differences(positions: Tensor, sender: Tensor, receiver: Tensor,
                     graph: tuple[Tensor, ...] | None = None) -> Tensor:
    """positions[receiver] - positions[sender]; with ``graph`` (an ``EdgeLayout.graph``: receiver-sorted rows
    ``rowptr``, transpose ``rowptr_t`` / ``perm_t``) the backward is the deterministic one of the module doc."""
    if graph is None:
        return positions.index_select(0, receiver) - positions.index_select(0, sender)
    _, _, rowptr, _, rowptr_t, perm_t = graph
    return _EdgeDifferences.apply(positions, sender, receiver, rowptr, perm_t, rowptr_t)


class _RowsTimes(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: Tensor, matrix: Tensor) -> Tensor:
        ctx.save_for_backward(rows, matrix)
        return rows @ matrix

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        rows, matrix = ctx.saved_tensors
        grad_rows = grad @ matrix.T if ctx.needs_input_grad[0] else None
        grad_matrix = None
        if ctx.needs_input_grad[1]:
            # sum over rows of rows (x) grad as a column reduction; the GEMM rows.T @ grad ([3, E] x [E, 3]) ran on
            # one thread block (cuBLAS/CUTLASS tile per output, K = E)
            grad_matrix = (rows.unsqueeze(2) * grad.unsqueeze(1)).sum(0)
        return grad_rows, grad_matrix


def rows_times(rows: Tensor, matrix: Tensor) -> Tensor:
    """``rows @ matrix`` ([M, 3] x [3, 3]) whose gradient in ``matrix`` is a column sum of outer products rather
    than a GEMM with K = M (the strain's gradient, the virial, over every edge). Differentiable twice."""
    return _RowsTimes.apply(rows, matrix)
