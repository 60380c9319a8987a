"""Grad x of the receiver-order table convolution backward in 64-bit fixed point: atomics with deterministic sums.

Each edge's part of grad x is added as round(v s), s a power of two: integer atomics are exact and associative,
so every sum has the same bits in any order. s = 2^(62 - e) where B < 2^e bounds every partial sum,

    B = K * max|W| * max|y| * max|g| * (the most edges one sender has),

K (``path_bound``) bounding one edge's grad x element per unit of the operands. All but K is computed on the
device per call (capturable); a non-finite operand makes grad x NaN.
"""

from __future__ import annotations

import math
from collections import defaultdict
from functools import cache

import torch
from torch import Tensor

from ..core.cg import sparse_cg
from ..tensor_product import plan as plans

_TOP_BIT = 62  # |sum| * scale < 2^62: int64's range with room to spare


@cache
def path_bound(key: str) -> float:
    """K: the largest |grad x| element one edge can give per unit of max|W|, max|y| and max|g| (module doc)."""
    p = plans.get(key).problem
    per_irrep: dict[int, float] = defaultdict(float)
    for ins in p.instructions:
        l1, l2, l3 = (p.irreps_in1[ins.i_in1].ir.l, p.irreps_in2[ins.i_in2].ir.l, p.irreps_out[ins.i_out].ir.l)
        row_sums: dict[int, float] = defaultdict(float)
        for m1, _, _, value in sparse_cg(l1, l2, l3):
            row_sums[m1] += abs(value)
        fan_in = p.irreps_in2[ins.i_in2].mul * (p.irreps_out[ins.i_out].mul if ins.mode == "uvw" else 1)
        per_irrep[ins.i_in1] += abs(ins.path_weight) * fan_in * max(row_sums.values(), default=0.0)
    return max(per_irrep.values(), default=0.0)


def grad_x_bound(key: str, coeffs: Tensor, y: Tensor, g: Tensor, r: Tensor, rowptr_t: Tensor,
                 unweighted_paths: bool) -> Tensor:
    """B (a 0-d FP64 tensor on the operands' device): a bound on |every partial sum| of grad x; NaN where an operand
    is not finite. ``rowptr_t``: the senders' CSR row pointers (the most edges one sender has). One read of the
    table, y and g each, no temporaries: max|W| <= 4 max|coefficient| (|t| <= 1; 1 at least where a path has no
    weight), two bits looser than the largest sum of a column's four."""
    inf = float("inf")

    def largest(t: Tensor) -> Tensor:
        return (torch.linalg.vector_norm(t.detach(), inf) if t.numel() else t.new_zeros(())).to(torch.float64)

    w_max = 4 * largest(coeffs)
    if unweighted_paths:
        w_max = w_max.clamp(min=1.0)
    degree = (rowptr_t[1:] - rowptr_t[:-1]).amax() if rowptr_t.numel() > 1 else rowptr_t.new_zeros(())
    bound = torch.stack([w_max, largest(y), largest(g), degree.to(torch.float64)]).prod() * path_bound(key)
    # a NaN length gives NaN weights in the kernel, whatever the table's values
    return torch.where(torch.isnan(r).any(), torch.full_like(bound, float("nan")), bound)


def scale_for(bound: Tensor, dtype: torch.dtype) -> Tensor:
    """s = 2^(62 - e), bound < 2^e (``frexp``), in ``dtype`` (the kernel's); 1 for a bound that is not finite (the
    sums are then discarded: ``from_fixed``). Kept within the dtype's range for tiny bounds."""
    _, exponent = torch.frexp(torch.where(torch.isfinite(bound), bound, torch.zeros_like(bound)))
    top = math.frexp(torch.finfo(dtype).max)[1] - 2  # the largest power of two the dtype holds, and one less
    power = (_TOP_BIT - exponent).clamp(max=top).to(torch.float64)
    return torch.where(torch.isfinite(bound), torch.exp2(power), torch.ones_like(bound)).to(dtype)


def from_fixed(sums: Tensor, scale: Tensor, bound: Tensor, dtype: torch.dtype) -> Tensor:
    """The int64 sums back in ``dtype``: each rounded once to ``dtype`` and multiplied by 1 / scale (a power of two:
    exact), one pass; all NaN where the bound is not finite."""
    inverse = torch.where(torch.isfinite(bound), 1.0 / scale.to(torch.float64), torch.full_like(bound, float("nan")))
    return torch.mul(sums, inverse.to(dtype))  # int64 x a 0-d dtype tensor: dtype, each sum rounded once
