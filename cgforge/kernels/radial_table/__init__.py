"""Radial functions of one variable as tables: W(r) [C columns] by piecewise cubics, fitted and evaluated.

A message-passing layer's tensor-product weights are often a function of the edge length alone (a radial
basis, a cutoff and an MLP): ``W = mlp(basis(r))``. ``fit_radial_table`` samples such a function and its
derivative in FP64 on a uniform grid over [0, r_max] and stores one cubic Hermite polynomial per interval,
doubling the grid until the interpolation error, measured between the knots, is within a stated tolerance.
``radial_table`` evaluates it for every edge (one memory-bound kernel on CUDA, torch on a CPU) with
gradients of any order in r: the MLP's GEMMs and activations leave the step.
"""

from .fit import RadialTable, fit_radial_table
from .ops import radial_table, radial_table_reference

__all__ = ["RadialTable", "fit_radial_table", "radial_table", "radial_table_reference"]
