"""Clebsch-Gordan coefficients in e3nn's real basis (`o3.wigner_3j`): sparse lists and dense tables, the one source
of every op's coefficients.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import torch
from e3nn import o3

# Entries smaller than this (relative to the largest) are round-off zeros of wigner_3j.
ZERO_TOL = 1e-12

Entry = tuple[int, int, int, float]  # (m1, m2, m3, value)


@cache
def wigner_3j(l1: int, l2: int, l3: int) -> np.ndarray:
    """e3nn's wigner_3j(l1, l2, l3) as a float64 NumPy array (cached: do not modify)."""
    return o3.wigner_3j(l1, l2, l3, dtype=torch.float64).numpy()


@cache
def sparse_cg(l1: int, l2: int, l3: int) -> tuple[Entry, ...]:
    """The nonzero (m1, m2, m3, value) entries of e3nn's wigner_3j(l1, l2, l3), in FP64, m1-major."""
    dense = wigner_3j(l1, l2, l3)
    scale = np.abs(dense).max()
    return tuple((int(i), int(j), int(k), float(dense[i, j, k]))
                 for i, j, k in zip(*np.nonzero(np.abs(dense) > ZERO_TOL * scale)))


@cache
def dense_numpy(entries: tuple[Entry, ...], shape: tuple[int, int, int]) -> np.ndarray:
    """A sparse list (any, e.g. with a path weight folded in) made dense: float64 [d1, d2, d3]."""
    out = np.zeros(shape)
    for i, j, k, v in entries:
        out[i, j, k] = v
    return out


def dense_cg(l1: int, l2: int, l3: int, scale: float = 1.0, dtype: torch.dtype = torch.float64,
             device: torch.device | str = "cpu") -> torch.Tensor:
    """The sparse list made dense again: [2l1+1, 2l2+1, 2l3+1] times `scale`."""
    table = dense_numpy(sparse_cg(l1, l2, l3), (2 * l1 + 1, 2 * l2 + 1, 2 * l3 + 1)) * scale
    return torch.as_tensor(table, dtype=dtype, device=device)
