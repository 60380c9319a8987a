"""Fit a table of cubic Hermite polynomials to a smooth function of one variable, with a measured error.

    W_j(r) = c[i, j, 0] + c[i, j, 1] t + c[i, j, 2] t^2 + c[i, j, 3] t^3,    i = floor(r / h), t = r / h - i

on N intervals of width h = r_max / N, with the function's own values and derivatives at the knots (FP64): C1,
error ~ h^4. N doubles until the largest relative difference at a quarter, half and three quarters of every
interval is within ``tol``. The second derivative jumps at the knots by O(h^2) (~1e-5 relative at tol 1e-7).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

_CHECK_POINTS = (0.25, 0.5, 0.75)  # where between the knots the error is measured
_ROWS_PER_CALL = 1 << 15  # rows of one call of the function (bounds the fit's memory)


@dataclass(frozen=True)
class RadialTable:
    """Cubic coefficients [N, C, 4] (FP64) over [0, r_max], and the measured relative errors of the values and
    the derivative between the knots."""

    coeffs: Tensor
    r_max: float
    value_error: float
    slope_error: float

    @property
    def intervals(self) -> int:
        return self.coeffs.shape[0]

    @property
    def columns(self) -> int:
        return self.coeffs.shape[1]

    def evaluate(self, r: Tensor, order: int = 0) -> Tensor:
        """The table (order 0) or its derivative in r (FP64, torch): [n, C]."""
        from .ops import radial_table_reference

        return radial_table_reference(r.to(torch.float64), self.coeffs, self.r_max, order)


def _values_and_slopes(fn: Callable[[Tensor], Tensor], r: Tensor) -> tuple[Tensor, Tensor]:
    """fn(r) [n, C] and d fn / dr [n, C] (rows independent, so one forward-mode pass gives every column)."""
    values, slopes = [], []
    for part in r.split(_ROWS_PER_CALL):
        v, s = torch.func.jvp(fn, (part,), (torch.ones_like(part),))
        values.append(v.detach())
        slopes.append(s.detach())
    return torch.cat(values), torch.cat(slopes)


def _first_interval(fn: Callable[[Tensor], Tensor], h: float, f1: Tensor, m1: Tensor) -> Tensor:
    """[C, 4]: the cubic on [0, h] through fn at h/3 and 2h/3 with fn's value and slope at h, for a function that
    cannot be evaluated at 0 itself (a basis like sin(a r) / r is 0 / 0 there but smooth)."""
    inner, _ = _values_and_slopes(fn, torch.tensor([h / 3, 2 * h / 3], dtype=torch.float64))
    t = torch.tensor([1 / 3, 2 / 3, 1.0], dtype=torch.float64)
    a = torch.cat([torch.stack([t ** 0, t, t ** 2, t ** 3], 1),
                   torch.tensor([[0.0, 1.0, 2.0, 3.0]], dtype=torch.float64)])  # the last row: d/dt at t = 1
    return torch.linalg.solve(a, torch.stack([inner[0], inner[1], f1, m1 * h])).t()


def _table(fn: Callable[[Tensor], Tensor], r_max: float, n: int) -> Tensor:
    """The [N, C, 4] coefficients of fn's cubic Hermite table on n intervals."""
    h = r_max / n
    f, m = _values_and_slopes(fn, torch.linspace(0.0, r_max, n + 1, dtype=torch.float64))
    if f.dim() != 2 or f.shape[0] != n + 1:
        raise ValueError(f"fn must map r [n] to [n, C]; for n = {n + 1} it gave shape {list(f.shape)}")
    if not (f[1:].isfinite().all() and m[1:].isfinite().all()):
        raise ValueError("fn is not finite on (0, r_max]: it cannot be tabulated")
    f0, f1, m0, m1 = f[:-1], f[1:], m[:-1] * h, m[1:] * h  # the cubic in t through (f_i, f_i+1), slopes (m_i, m_i+1)
    coeffs = torch.stack([f0, m0, 3 * (f1 - f0) - 2 * m0 - m1, 2 * (f0 - f1) + m0 + m1], dim=2)
    if not (f[0].isfinite().all() and m[0].isfinite().all()):
        coeffs[0] = _first_interval(fn, h, f[1], m[1])
    return coeffs


def _errors(fn: Callable[[Tensor], Tensor], coeffs: Tensor, r_max: float) -> tuple[float, float]:
    from .ops import radial_table_reference

    n = coeffs.shape[0]
    h = r_max / n
    start = torch.arange(n, dtype=torch.float64) * h
    r = torch.cat([start + s * h for s in _CHECK_POINTS])
    exact, slope = _values_and_slopes(fn, r)
    table = radial_table_reference(r, coeffs, r_max, 0)
    table_slope = radial_table_reference(r, coeffs, r_max, 1)
    scale = exact.abs().max().clamp_min(torch.finfo(torch.float64).tiny)
    slope_scale = slope.abs().max().clamp_min(torch.finfo(torch.float64).tiny)
    return (float((table - exact).abs().max() / scale), float((table_slope - slope).abs().max() / slope_scale))


def fit_radial_table(fn: Callable[[Tensor], Tensor], r_max: float, *, tol: float = 1e-7,
                     min_intervals: int = 256, max_intervals: int = 16384) -> RadialTable:
    """The table of ``fn`` over [0, r_max] with the fewest intervals (``min_intervals`` doubled) whose measured relative
    error of values and derivative is within ``tol``. ``fn`` maps r [n] (FP64) to [n, C] row by row, smooth on
    (0, r_max] (it runs under ``torch.func.jvp``); ValueError when ``max_intervals`` are not enough."""
    if not (isinstance(r_max, (int, float)) and r_max > 0):
        raise ValueError(f"r_max must be a positive number, got {r_max!r}")
    if not tol > 0:
        raise ValueError(f"tol must be positive, got {tol!r}")
    if min_intervals < 1 or max_intervals < min_intervals:
        raise ValueError(f"need 1 <= min_intervals <= max_intervals, got {min_intervals} and {max_intervals}")
    r_max = float(r_max)
    n = min_intervals
    while True:
        coeffs = _table(fn, r_max, n)
        value_error, slope_error = _errors(fn, coeffs, r_max)
        if max(value_error, slope_error) <= tol:
            return RadialTable(coeffs, r_max, value_error, slope_error)
        if not (value_error == value_error and slope_error == slope_error):  # NaN: more knots will not help
            raise ValueError("fn is not finite on (0, r_max]: it cannot be tabulated")
        if 2 * n > max_intervals:
            raise ValueError(f"a table of {n} intervals over [0, {r_max}] differs from fn by {value_error:.1e} "
                             f"(values) and {slope_error:.1e} (derivative), relative, more than tol {tol:.0e}; "
                             f"{max_intervals} intervals at most")
        n *= 2
