"""torch.library custom ops for the tensor product (the launches: ``launch``, shared with the convolution).

Each op: CUDA (generated kernels), CPU (the torch reference), fake and autograd. The backward ops are trilinear
too, so their derivatives are forward and backward calls: any derivative order works.
"""

from __future__ import annotations

import torch

from ..core.custom_op import custom_op
from ..core.launch import trilinear_double_backward
from . import plan as plans
from .launch import backward_buffers, finish_gw, has_unweighted_paths, launch, needs_zero_fill
from .layout import TP_LAYOUT
from .reference import reference_tp, reference_tp_backward


def _tp_fake(x, y, w, key):
    return x.new_empty(x.shape[0], plans.get(key).problem.irreps_out.dim)


def _tp_grad(ctx, g):
    x, y, w = ctx.saved_tensors
    gx, gy, gw = tp_backward(x, y, w, g.contiguous(), *ctx.args)
    return gx, gy, gw, None


@custom_op("tp_forward", _tp_fake, _tp_grad)
def tp_forward(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, key: str) -> torch.Tensor:
    p = plans.get(key).problem
    if x.device.type != "cuda":
        return reference_tp(p, x, y, w)
    x, y, w = x.contiguous(), y.contiguous(), w.contiguous()
    rows = x.shape[0]
    shape = (rows, p.irreps_out.dim)
    out = (x.new_zeros(shape) if needs_zero_fill(p, out_side=True) else x.new_empty(shape))
    launch(key, False, TP_LAYOUT, rows, [x, y, w, out, None, None, None, None], x.dtype, x.device)
    return out


def _tp_bwd_fake(x, y, w, g, key):
    return torch.empty_like(x), torch.empty_like(y), torch.empty_like(w)


def _tp_bwd_grad(ctx, ggx, ggy, ggw):
    x, y, w, g = ctx.saved_tensors
    (key,) = ctx.args
    dx, dy, dw, dg = trilinear_double_backward(lambda a, b, c: tp_forward(a, b, c, key),
                                               lambda a, b, c, d: tp_backward(a, b, c, d, key),
                                               x, y, w, g, ggx, ggy, ggw, has_unweighted_paths(key))
    return dx, dy, dw, dg, None


@custom_op("tp_backward", _tp_bwd_fake, _tp_bwd_grad)
def tp_backward(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, g: torch.Tensor, key: str
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    p = plans.get(key).problem
    if x.device.type != "cuda":
        return reference_tp_backward(p, x, y, w, g)
    x, y, w, g = x.contiguous(), y.contiguous(), w.contiguous(), g.contiguous()
    rows = x.shape[0]
    gx, gy, gw = backward_buffers(key, x, y, w, rows)
    launch(key, True, TP_LAYOUT, rows, [x, y, w, g, gx, gy, gw, None, None, None, None], x.dtype, x.device,
           gw_partial=p.shared_weights)
    return gx, gy, finish_gw(key, gw, w)
