"""The fused convolution with its weights read from a radial table: out[i] = sum over edges e into i of
TP(x[sender e], y_e, W(r_e)), W a cubic table of the edge length (``kernels.radial_table``).

The convolution's own kernels (``Layout.table``) evaluate each weight's cubic where the plain ones read W[e], and
the backward accumulates dL/dr_e where they write grad W: no [E, weight_numel] tensor either way. The backward's
derivatives are written with the plain ops, differentiable to any order; off CUDA the ops are torch.
"""

from __future__ import annotations

import torch

from ..core.custom_op import custom_op
from ..core.launch import l2_bytes, trilinear_double_backward
from ..core.registry import itemsize
from ..radial_table.ops import radial_table_dot, radial_table_eval, radial_table_reference
from ..tensor_product import plan as plans
from ..tensor_product.launch import has_unweighted_paths, launch, needs_zero_fill
from ..tensor_product.layout import (
    ATOMIC_BACKWARD,
    ATOMIC_FORWARD,
    CONV_BACKWARD,
    CONV_BACKWARD_NO_GX,
    CONV_BACKWARD_NO_GX_SORTED,
    CONV_BACKWARD_RECEIVERS,
    CONV_BACKWARD_RECEIVERS_FIXED,
    CONV_BACKWARD_RECEIVERS_FIXED_SORTED,
    CONV_BACKWARD_RECEIVERS_SORTED,
    CONV_FORWARD,
    CONV_FORWARD_SORTED,
)
from . import fixed_point
from .graph import GraphTensors
from .ops import _output_rows, _reference_conv, _reference_conv_backward, conv_backward, conv_forward


def _table_args(coeffs: torch.Tensor, r: torch.Tensor, r_max: float, grad_r: torch.Tensor | None) -> list:
    from ..core.runtime import F32, F64, I32

    real = F32 if r.dtype == torch.float32 else F64
    if coeffs.data_ptr() % 16:  # each weight's four coefficients are read as one 16-byte vector
        coeffs = coeffs.clone()
    n = coeffs.shape[0]
    return [coeffs, r, *([] if grad_r is None else [grad_r]), I32(n), real(n / r_max), real(r_max)]


def _csr_edges(rowptr: torch.Tensor, perm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(edge ids, output row of each) of the CSR rows ``rowptr`` (absolute edge positions: a slice of a larger
    graph's row pointer is a range of its rows), as the deterministic kernels walk them. Host reads: CPU only."""
    positions = torch.arange(int(rowptr[0]), int(rowptr[-1]), device=rowptr.device)
    ids = perm.long().index_select(0, positions) if perm.numel() else positions
    return ids, torch.searchsorted(rowptr, positions, right=True) - 1


def needs_grad_x(ctx, key: str, dtype: torch.dtype) -> bool:
    """Whether a backward forms grad x: where x needs one (MD's first layer, x the species embedding, needs none),
    or where the plan's tuning keeps the sender-order backward for grad-out rows this narrow
    (``TPTuning.receiver_backward_min_row_bytes``)."""
    plan = plans.get(key)
    least = plan.tuning.receiver_backward_min_row_bytes
    row_bytes = plan.problem.irreps_out.dim * itemsize(dtype)
    return bool(ctx.needs_input_grad[0]) or least is None or row_bytes < least


def _fwd_fake(x, y, r, coeffs, sender, receiver, rowptr, perm, rowptr_t, perm_t, r_max, key, deterministic):
    return x.new_empty(_output_rows(x, rowptr), plans.get(key).problem.irreps_out.dim)


def _fwd_grad(ctx, g):
    x, y, r, coeffs, *graph = ctx.saved_tensors
    grad_x = needs_grad_x(ctx, ctx.args[1], x.dtype)
    gx, gy, gr = conv_table_backward(x, y, r, coeffs, g.contiguous(), *graph, *ctx.args, grad_x)
    return (gx if grad_x else None, gy, gr) + (None,) * 10


@custom_op("conv_table_forward", _fwd_fake, _fwd_grad)
def conv_table_forward(x: torch.Tensor, y: torch.Tensor, r: torch.Tensor, coeffs: torch.Tensor, sender: torch.Tensor,
                       receiver: torch.Tensor, rowptr: torch.Tensor, perm: torch.Tensor, rowptr_t: torch.Tensor,
                       perm_t: torch.Tensor, r_max: float, key: str, deterministic: bool) -> torch.Tensor:
    p = plans.get(key).problem
    rows = _output_rows(x, rowptr)
    if x.device.type != "cuda":
        if rowptr.numel():  # the CSR rows, as the kernels read them: also a range of a larger graph's rows
            ids, rows_of = _csr_edges(rowptr, perm)
            w = radial_table_reference(r.index_select(0, ids), coeffs, r_max)
            return _reference_conv(p, x, y.index_select(0, ids), w, sender.index_select(0, ids), rows_of, rows)
        return _reference_conv(p, x, y, radial_table_reference(r, coeffs, r_max), sender, receiver, rows)
    GraphTensors(sender, receiver, rowptr, perm, rowptr_t, perm_t).check()
    x, y, r, coeffs = x.contiguous(), y.contiguous(), r.contiguous(), coeffs.contiguous()
    table = _table_args(coeffs, r, r_max, None)
    shape = (rows, p.irreps_out.dim)
    if deterministic:
        out = x.new_zeros(shape) if needs_zero_fill(p, out_side=True) else x.new_empty(shape)
        layout = CONV_FORWARD if perm.numel() else CONV_FORWARD_SORTED
        args = [x, y, None, out, rowptr, perm if perm.numel() else None, sender, None, *table]
        launch(key, False, layout.with_table(), rows, args, x.dtype, x.device)
    else:
        out = x.new_zeros(shape)
        args = [x, y, None, out, None, None, sender, receiver, *table]
        launch(key, False, ATOMIC_FORWARD.with_table(), sender.shape[0], args, x.dtype, x.device)
    return out


def _bwd_fake(x, y, r, coeffs, g, sender, receiver, rowptr, perm, rowptr_t, perm_t, r_max, key, deterministic,
              grad_x=True):
    return torch.empty_like(x) if grad_x else x.new_empty(0), torch.empty_like(y), torch.empty_like(r)


def _bwd_grad(ctx, ggx, ggy, ggr):
    """The derivatives of <ggx, gx> + <ggy, gy> + <ggr, gr>, written with ops that are each differentiable: with
    W = W(r), (gx, gy, gW) = conv_backward(x, y, W, g) and gr = sum_j gW_j W_j'(r). A cotangent ggr on gr is one
    of ggr W'(r) on gW, and reaches r directly through W''; the trilinear rule gives the rest, and what reaches W
    goes on to r through W'."""
    x, y, r, coeffs, g, *graph = ctx.saved_tensors
    r_max, key, det, grad_x = ctx.args
    ggx = ggx if grad_x else None  # no grad x was formed: nothing flows back through it
    w = radial_table_eval(r, coeffs, r_max, 0)
    ggw = None if ggr is None else ggr.unsqueeze(1) * radial_table_eval(r, coeffs, r_max, 1)
    dx, dy, dw, dg = trilinear_double_backward(lambda a, b, c: conv_forward(a, b, c, *graph, key, det),
                                               lambda a, b, c, d: conv_backward(a, b, c, d, *graph, key, det),
                                               x, y, w, g, ggx, ggy, ggw, has_unweighted_paths(key))
    dr = None if dw is None else radial_table_dot(r, coeffs, dw, r_max, 1)
    if ggr is not None:
        gw = conv_backward(x, y, w, g, *graph, key, det)[2]
        direct = ggr * radial_table_dot(r, coeffs, gw, r_max, 2)
        dr = direct if dr is None else dr + direct
    return (dx, dy, dr, None, dg) + (None,) * 10


def fixed_point_grad_x(key: str, x: torch.Tensor, g: torch.Tensor) -> bool:
    """Whether the backward adds grad x in fixed point over the receivers (``TPTuning.receiver_backward_fixed_point``:
    FP32 only; ``auto``: where the grad-out rows ``g`` exceed the device's L2, so that the sender-order backward
    would gather them from beyond it once per edge, and the int64 sums of ``x``'s shape take at most
    ``TPTuning.fixed_point_max_bytes``)."""
    tuning = plans.get(key).tuning
    setting = tuning.receiver_backward_fixed_point
    if x.dtype != torch.float32 or setting is False:
        return False
    if setting is True:
        return True
    return g.numel() * g.element_size() > l2_bytes(g.device) and x.numel() * 8 <= tuning.fixed_point_max_bytes


def _receiver_backward(x, y, r, coeffs, g, sender, rowptr, perm, rowptr_t, r_max: float, key: str, grad_x: bool
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward over the forward's rows (receivers), each grad-out block staged once; grad x not formed, or added
    by atomics in fixed point (``fixed_point``) or floating point (``TPTuning.receiver_backward_atomic``)."""
    fixed = grad_x and fixed_point_grad_x(key, x, g)
    gy, gr = torch.zeros_like(y), torch.zeros_like(r)
    sorted_edges = not perm.numel()
    extra = []
    if fixed:
        gx = torch.zeros(x.shape, dtype=torch.int64, device=x.device)
        bound = fixed_point.grad_x_bound(key, coeffs, y, g, r, rowptr_t, has_unweighted_paths(key))
        scale = fixed_point.scale_for(bound, x.dtype)
        extra = [scale]
        layout = CONV_BACKWARD_RECEIVERS_FIXED_SORTED if sorted_edges else CONV_BACKWARD_RECEIVERS_FIXED
    elif grad_x:
        gx = torch.zeros_like(x)
        layout = CONV_BACKWARD_RECEIVERS_SORTED if sorted_edges else CONV_BACKWARD_RECEIVERS
    else:
        gx = None
        layout = CONV_BACKWARD_NO_GX_SORTED if sorted_edges else CONV_BACKWARD_NO_GX
    args = [x, y, None, g, gx, gy, None, rowptr, None if sorted_edges else perm, sender, None,
            *_table_args(coeffs, r, r_max, gr), *extra]
    launch(key, True, layout.with_table(), rowptr.shape[0] - 1, args, x.dtype, x.device)
    if fixed:
        gx = fixed_point.from_fixed(gx, scale, bound, x.dtype)
    return gx if grad_x else x.new_empty(0), gy, gr


@custom_op("conv_table_backward", _bwd_fake, _bwd_grad)
def conv_table_backward(x: torch.Tensor, y: torch.Tensor, r: torch.Tensor, coeffs: torch.Tensor, g: torch.Tensor,
                        sender: torch.Tensor, receiver: torch.Tensor, rowptr: torch.Tensor, perm: torch.Tensor,
                        rowptr_t: torch.Tensor, perm_t: torch.Tensor, r_max: float, key: str, deterministic: bool,
                        grad_x: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad x, grad y, grad r) of ``conv_table_forward`` for the output gradient ``g``; ``grad_x`` False: grad x is
    empty and a deterministic graph's kernel walks the forward's rows (``_receiver_backward``)."""
    p = plans.get(key).problem
    if x.device.type != "cuda":
        w = radial_table_reference(r, coeffs, r_max)
        gx, gy, gw = _reference_conv_backward(p, x, y, w, g, sender, receiver)
        return gx if grad_x else x.new_empty(0), gy, (gw * radial_table_reference(r, coeffs, r_max, 1)).sum(1)
    GraphTensors(sender, receiver, rowptr, perm, rowptr_t, perm_t).check()
    x, y, r, coeffs, g = x.contiguous(), y.contiguous(), r.contiguous(), coeffs.contiguous(), g.contiguous()
    tuning = plans.get(key).tuning
    if deterministic and (not grad_x or tuning.receiver_backward_atomic or fixed_point_grad_x(key, x, g)):
        return _receiver_backward(x, y, r, coeffs, g, sender, rowptr, perm, rowptr_t, r_max, key, grad_x)
    gx = torch.zeros_like(x) if not deterministic or needs_zero_fill(p, out_side=False) else torch.empty_like(x)
    gy, gr = torch.zeros_like(y), torch.zeros_like(r)  # segments add their parts
    table = _table_args(coeffs, r, r_max, gr)
    if deterministic:
        args = [x, y, None, g, gx, gy, None, rowptr_t, perm_t, None, receiver, *table]
        launch(key, True, CONV_BACKWARD.with_table(), x.shape[0], args, x.dtype, x.device)
    else:
        args = [x, y, None, g, gx, gy, None, None, None, sender, receiver, *table]
        launch(key, True, ATOMIC_BACKWARD.with_table(), sender.shape[0], args, x.dtype, x.device)
    return gx if grad_x else x.new_empty(0), gy, gr

