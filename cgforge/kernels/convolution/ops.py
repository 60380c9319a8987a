"""torch.library custom ops of the fused convolution: out[i] = sum over edges e into i of TP(x[sender e], y_e, W_e).

The graph tensors go flat, in ``GraphTensors`` order. CUDA tensors run the generated kernels (CSR rows, or
atomics in edge order), others the torch reference; the backward op is differentiable too.
"""

from __future__ import annotations

import torch

from ..core.custom_op import custom_op
from ..core.launch import trilinear_double_backward
from ..tensor_product import plan as plans
from ..tensor_product.launch import backward_buffers, finish_gw, has_unweighted_paths, launch, needs_zero_fill
from ..tensor_product.layout import ATOMIC_BACKWARD, ATOMIC_FORWARD, CONV_BACKWARD, CONV_FORWARD, CONV_FORWARD_SORTED
from ..tensor_product.reference import reference_tp, reference_tp_backward
from .graph import GraphTensors


def _output_rows(x: torch.Tensor, rowptr: torch.Tensor) -> int:
    """Rows of the output: one per CSR row (a receiver range when the graph is a chunk of a larger one,
    senders still indexing all of x), else one per node of x."""
    return rowptr.shape[0] - 1 if rowptr.numel() else x.shape[0]


def _reference_conv(p, x, y, w, sender, receiver, rows):
    messages = reference_tp(p, x.index_select(0, sender.long()), y, w)
    return x.new_zeros(rows, p.irreps_out.dim).index_add(0, receiver.long(), messages)


def _reference_conv_backward(p, x, y, w, g, sender, receiver):
    gxe, gy, gw = reference_tp_backward(p, x.index_select(0, sender.long()), y, w, g.index_select(0, receiver.long()))
    return torch.zeros_like(x).index_add(0, sender.long(), gxe), gy, gw


def _conv_fake(x, y, w, sender, receiver, rowptr, perm, rowptr_t, perm_t, key, deterministic):
    return x.new_empty(_output_rows(x, rowptr), plans.get(key).problem.irreps_out.dim)


def _conv_grad(ctx, g):
    x, y, w, *graph = ctx.saved_tensors
    gx, gy, gw = conv_backward(x, y, w, g.contiguous(), *graph, *ctx.args)
    return (gx, gy, gw) + (None,) * 8


@custom_op("conv_forward", _conv_fake, _conv_grad)
def conv_forward(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, sender: torch.Tensor,
                 receiver: torch.Tensor, rowptr: torch.Tensor, perm: torch.Tensor, rowptr_t: torch.Tensor,
                 perm_t: torch.Tensor, key: str, deterministic: bool) -> torch.Tensor:
    p = plans.get(key).problem
    num_nodes = _output_rows(x, rowptr)
    if x.device.type != "cuda":
        return _reference_conv(p, x, y, w, sender, receiver, num_nodes)
    graph = GraphTensors(sender, receiver, rowptr, perm, rowptr_t, perm_t)
    graph.check()
    x, y, w = x.contiguous(), y.contiguous(), w.contiguous()
    shape = (num_nodes, p.irreps_out.dim)
    if deterministic:
        out = x.new_zeros(shape) if needs_zero_fill(p, out_side=True) else x.new_empty(shape)
        layout = CONV_FORWARD if perm.numel() else CONV_FORWARD_SORTED
        args = [x, y, w, out, rowptr, perm if perm.numel() else None, sender, None]
        launch(key, False, layout, num_nodes, args, x.dtype, x.device)
    else:
        out = x.new_zeros(shape)
        args = [x, y, w, out, None, None, sender, receiver]
        launch(key, False, ATOMIC_FORWARD, sender.shape[0], args, x.dtype, x.device)
    return out


def _conv_bwd_fake(x, y, w, g, sender, receiver, rowptr, perm, rowptr_t, perm_t, key, deterministic):
    return torch.empty_like(x), torch.empty_like(y), torch.empty_like(w)


def _conv_bwd_grad(ctx, ggx, ggy, ggw):
    x, y, w, g, *graph = ctx.saved_tensors
    key, det = ctx.args
    dx, dy, dw, dg = trilinear_double_backward(lambda a, b, c: conv_forward(a, b, c, *graph, key, det),
                                               lambda a, b, c, d: conv_backward(a, b, c, d, *graph, key, det),
                                               x, y, w, g, ggx, ggy, ggw, has_unweighted_paths(key))
    return (dx, dy, dw, dg) + (None,) * 8


@custom_op("conv_backward", _conv_bwd_fake, _conv_bwd_grad)
def conv_backward(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, g: torch.Tensor, sender: torch.Tensor,
                  receiver: torch.Tensor, rowptr: torch.Tensor, perm: torch.Tensor, rowptr_t: torch.Tensor,
                  perm_t: torch.Tensor, key: str, deterministic: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    p = plans.get(key).problem
    if x.device.type != "cuda":
        return _reference_conv_backward(p, x, y, w, g, sender, receiver)
    GraphTensors(sender, receiver, rowptr, perm, rowptr_t, perm_t).check()
    x, y, w, g = x.contiguous(), y.contiguous(), w.contiguous(), g.contiguous()
    edges = sender.shape[0]
    if deterministic:
        rows = x.shape[0]
        gx, gy, gw = backward_buffers(key, x, y, w, rows)
        args = [x, y, w, g, gx, gy, gw, rowptr_t, perm_t, None, receiver]
        launch(key, True, CONV_BACKWARD, rows, args, x.dtype, x.device, gw_partial=p.shared_weights)
    else:
        gx, gy, gw = backward_buffers(key, x, y, w, edges)
        gx.zero_()
        args = [x, y, w, g, gx, gy, gw, None, None, sender, receiver]
        launch(key, True, ATOMIC_BACKWARD, edges, args, x.dtype, x.device, gw_partial=p.shared_weights)
    return gx, gy, finish_gw(key, gw, w)

