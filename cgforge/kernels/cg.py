"""Sparse Clebsch-Gordan coefficients in e3nn's real basis (`o3.wigner_3j`)."""

from __future__ import annotations

from functools import cache

import torch
from e3nn import o3

# Entries smaller than this (relative to the largest) are round-off zeros of wigner_3j.
_ZERO_TOL = 1e-12


@cache
def sparse_cg(l1: int, l2: int, l3: int) -> tuple[tuple[int, int, int, float], ...]:
    """The nonzero (m1, m2, m3, value) entries of e3nn's wigner_3j(l1, l2, l3), in FP64."""
    dense = o3.wigner_3j(l1, l2, l3, dtype=torch.float64)
    scale = dense.abs().max().item()
    idx = (dense.abs() > _ZERO_TOL * scale).nonzero().tolist()
    return tuple((i, j, k, dense[i, j, k].item()) for i, j, k in idx)


def dense_cg(l1: int, l2: int, l3: int, scale: float = 1.0, dtype: torch.dtype = torch.float64,
             device: torch.device | str = "cpu") -> torch.Tensor:
    """The sparse list made dense again: [2l1+1, 2l2+1, 2l3+1] times `scale`."""
    out = torch.zeros(2 * l1 + 1, 2 * l2 + 1, 2 * l3 + 1, dtype=torch.float64)
    for i, j, k, v in sparse_cg(l1, l2, l3):
        out[i, j, k] = v * scale
    return out.to(dtype=dtype, device=device)
