"""Radial functions of one variable as tables: W(r) [C columns] by piecewise cubics, fitted and evaluated.

``fit_radial_table`` samples a function of the edge length (e.g. ``mlp(basis(r))``) in FP64 and stores one cubic
Hermite polynomial per interval, with a measured error; ``radial_table`` evaluates it for every edge (CUDA kernel
or torch) with gradients of any order in r.
"""

from .fit import RadialTable, fit_radial_table
from .ops import radial_table, radial_table_reference

__all__ = ["RadialTable", "fit_radial_table", "radial_table", "radial_table_reference"]
