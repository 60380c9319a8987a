"""The torch reference of the tensor product, built from the sparse CG lists: any device, every derivative order;
the CPU path of the ops and the oracle of the tests.
"""

from __future__ import annotations

import torch

from ..core.cg import dense_cg
from .problem import TPProblem


def reference_tp(problem: TPProblem, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """out[b] = TP(x[b], y[b], w[b]) (w broadcast when shared) in e3nn's layout."""
    batch = x.shape[0]
    w_rows = weight.reshape(1, -1) if problem.shared_weights else weight
    outs = [x.new_zeros(batch, mul, ir.dim) for mul, ir in problem.irreps_out]
    s1, s2 = problem.irreps_in1.slices(), problem.irreps_in2.slices()
    for ins, woff in zip(problem.instructions, problem.weight_offsets):
        (m1, ir1), (m2, ir2), (_, iro) = (problem.irreps_in1[ins.i_in1], problem.irreps_in2[ins.i_in2],
                                          problem.irreps_out[ins.i_out])
        xs = x[:, s1[ins.i_in1]].reshape(batch, m1, ir1.dim)
        ys = y[:, s2[ins.i_in2]].reshape(batch, m2, ir2.dim)
        cg = dense_cg(ir1.l, ir2.l, iro.l, ins.path_weight, x.dtype, x.device)
        xy = torch.einsum("bui,bvj,ijk->buvk", xs, ys, cg)
        if ins.has_weight:
            w = w_rows[:, woff:woff + ins.weight_numel].reshape(-1, *ins.path_shape)
            if ins.mode == "uvu":
                contrib = torch.einsum("buv,buvk->buk", w.expand(batch, *ins.path_shape), xy)
            else:
                contrib = torch.einsum("buvw,buvk->bwk", w.expand(batch, *ins.path_shape), xy)
        else:  # uvu without weight: sum over v
            contrib = xy.sum(2)
        outs[ins.i_out] = outs[ins.i_out] + contrib
    if not outs:
        return x.new_zeros(batch, 0)
    return torch.cat([o.flatten(1) for o in outs], dim=1)


_EINSUM = {  # operands: weight, x, y, cg, grad-out  (b: row)
    ("uvu", "out"): "buv,bui,bvj,ijk->buk",
    ("uvu", "x"): "buv,bvj,ijk,buk->bui",
    ("uvu", "y"): "buv,bui,ijk,buk->bvj",
    ("uvu", "w"): "bui,bvj,ijk,buk->buv",
    ("uvw", "x"): "buvw,bvj,ijk,bwk->bui",
    ("uvw", "y"): "buvw,bui,ijk,bwk->bvj",
    ("uvw", "w"): "bui,bvj,ijk,bwk->buvw",
}


def reference_tp_backward(problem: TPProblem, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
                          grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad x, grad y, grad weight) of `reference_tp` written out, without autograd."""
    batch = x.shape[0]
    w_rows = weight.reshape(1, -1).expand(batch, -1) if problem.shared_weights else weight
    gx, gy = torch.zeros_like(x), torch.zeros_like(y)
    gw = x.new_zeros(batch, problem.weight_numel)
    s1, s2, so = problem.irreps_in1.slices(), problem.irreps_in2.slices(), problem.irreps_out.slices()
    for ins, woff in zip(problem.instructions, problem.weight_offsets):
        (m1, ir1), (m2, ir2), (mo, iro) = (problem.irreps_in1[ins.i_in1], problem.irreps_in2[ins.i_in2],
                                           problem.irreps_out[ins.i_out])
        xs = x[:, s1[ins.i_in1]].reshape(batch, m1, ir1.dim)
        ys = y[:, s2[ins.i_in2]].reshape(batch, m2, ir2.dim)
        gs = grad[:, so[ins.i_out]].reshape(batch, mo, iro.dim)
        cg = dense_cg(ir1.l, ir2.l, iro.l, ins.path_weight, x.dtype, x.device)
        if ins.has_weight:
            w = w_rows[:, woff:woff + ins.weight_numel].reshape(batch, *ins.path_shape)
        else:
            w = x.new_ones(batch, m1, m2)
        gx[:, s1[ins.i_in1]] += torch.einsum(_EINSUM[ins.mode, "x"], w, ys, cg, gs).flatten(1)
        gy[:, s2[ins.i_in2]] += torch.einsum(_EINSUM[ins.mode, "y"], w, xs, cg, gs).flatten(1)
        if ins.has_weight:
            gw[:, woff:woff + ins.weight_numel] = torch.einsum(_EINSUM[ins.mode, "w"], xs, ys, cg, gs).flatten(1)
    if problem.shared_weights:
        gw = gw.sum(0)
    return gx, gy, gw
