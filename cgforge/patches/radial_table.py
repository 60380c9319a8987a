"""Radial tables, shared by the model families: a layer's radial MLP replaced by a table of one variable.

A layer's weights ``mlp(embedding(r))`` are a smooth function of the edge length: with tables on, the MLP is a
``TabulatedRadial`` (a cubic table fitted in FP64 from the layer's own modules, ``kernels.radial_table``) and the
family's embedding hands the variable itself on (MACE: r; NequIP: r over the cutoff). The stand-ins are
``streaming.Deferred`` ones; the tables are non-persistent buffers, so the state_dict is unchanged.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import Tensor

from ..kernels.radial_table import RadialTable, fit_radial_table, radial_table
from .streaming import Deferred

# The largest relative error of a table (values, and derivative in r, between the knots): below FP32's
# resolution, so an FP32 model's energies and forces move by less than its own rounding moves them.
DEFAULT_TOL = 1e-7

# Peak bytes per edge of a stored-path force call when every layer reads its table inside the convolution, in
# items of the model's dtype: no [E, weight_numel] tensor (measured: docs/measured-constants.md).
FUSED_EDGE_ITEMS = 280


class TableWeights:
    """A layer's tp_weights as its table at the edge lengths, not evaluated: the family's patched convolution
    reads the table inside its kernels (``kernels.Convolution.forward_table``), so no [E, weight_numel] tensor
    is made. Anything else done with it fails loudly rather than computing the weights of every edge."""

    def __init__(self, lengths: Tensor, coeffs: Tensor, r_max: float) -> None:
        self.lengths, self.coeffs, self.r_max = lengths, coeffs, r_max

    def __getattr__(self, name: str) -> object:
        raise AttributeError(f"{name!r}: these tp_weights are a radial table read inside cgforge's convolution; "
                             "this model uses them elsewhere (turn the table fusion off: "
                             "cgforge.patches.mace.radial_table.set_table_fusion(model, False))")


class TabulatedRadial(Deferred):
    """Stand-in for a layer's radial MLP: W(r) from a table (the original MLP rides along, adopted).

    ``fused``: return ``TableWeights`` (for a convolution that reads the table itself) rather than W(r)."""

    def __init__(self, mlp: torch.nn.Module, table: RadialTable, like: Tensor) -> None:
        super().__init__(mlp)
        self.register_buffer("table_coeffs", table.coeffs.to(like.device, like.dtype), persistent=False)
        self.r_max = table.r_max
        self.value_error, self.slope_error = table.value_error, table.slope_error
        self.fused = False

    def forward(self, lengths: Tensor) -> Tensor | TableWeights:
        if self.fused:
            return TableWeights(lengths, self.table_coeffs, self.r_max)
        return self.evaluate(lengths)

    def evaluate(self, lengths: Tensor) -> Tensor:
        """W(r) [E, weight_numel] (what the convolution reads inside its kernels when ``fused``)."""
        return radial_table(lengths, self.table_coeffs, self.r_max)

    def chunk_weights(self) -> Callable[[Tensor], Tensor]:
        """A table streams as values per chunk (the convolution that reads it whole is the unchunked one)."""
        return self.evaluate

    def extra_repr(self) -> str:
        return (f"intervals={self.table_coeffs.shape[0]}, columns={self.table_coeffs.shape[1]}, r_max={self.r_max}, "
                f"error={max(self.value_error, self.slope_error):.1e}, fused={self.fused}")


def original(module: torch.nn.Module) -> torch.nn.Module:
    """The module behind any stack of stand-ins (a streaming ``DeferredRadial`` over a ``TabulatedRadial``...)."""
    while isinstance(module, Deferred):
        module = module.module
    return module


def fp64_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A CPU FP64 copy of the module behind the stand-ins, for a fit (the model is left alone)."""
    return copy.deepcopy(original(module)).to("cpu", torch.float64)


def tabulate(mlp: torch.nn.Module, fn: Callable[[Tensor], Tensor], r_max: float, tol: float, like: Tensor,
             where: str) -> TabulatedRadial:
    """The stand-in for ``mlp`` reading a table of ``fn`` over [0, r_max] (``like``'s dtype and device); a
    ValueError naming ``where`` when the table cannot reach ``tol``."""
    try:
        table = fit_radial_table(fn, r_max, tol=tol)
    except ValueError as err:
        raise ValueError(f"radial tables: {where}: {err}") from err
    return TabulatedRadial(original(mlp), table, like)


def fuse_tables(layers: list[tuple[str, TabulatedRadial, torch.nn.Module]], on: bool) -> None:
    """Have each (where, table, convolution) of ``layers`` read its table inside the kernels (``on``: ``TableWeights``;
    every convolution must be cgforge's, checked first), or evaluate it into [E, weight_numel] weights first."""
    if on:
        for where, _, conv in layers:
            if not getattr(conv, "reads_tables", False):
                raise ValueError(f"{where}: its convolution ({type(conv).__qualname__}) cannot read a radial table "
                                 "(patch the model with cgforge first)")
    for _, table, _ in layers:
        table.fused = bool(on)


def fused_edge_bytes(tables: list[TabulatedRadial], layers: int, itemsize: int) -> int | None:
    """``FUSED_EDGE_ITEMS`` in bytes when all ``layers`` read their tables inside the convolution, else None."""
    if layers and len(tables) == layers and all(t.fused for t in tables):
        return FUSED_EDGE_ITEMS * itemsize
    return None
