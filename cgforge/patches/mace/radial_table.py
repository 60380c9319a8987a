"""Radial tables in patched MACE models: each block's tensor-product weights as a table of the edge length.

With tables on, a block's ``conv_tp_weights`` is a ``TabulatedRadial`` (fitted from its MLP and the model's
embedding) and ``radial_embedding`` hands the lengths on (``LengthsAsEdgeFeatures``); in a patched model the
tables are read inside the convolution (``TableWeights``, ``set_table_fusion``). Conditions as for streaming
(``streaming.geometry_can_stream``); the state_dict is unchanged.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..radial_table import DEFAULT_TOL, TabulatedRadial, fp64_copy, fuse_tables, original, tabulate
from ..recognise import is_mace_model
from ..streaming import Deferred, DeferredRadial
from . import streaming


class LengthsAsEdgeFeatures(Deferred):
    """Stand-in for ``model.radial_embedding`` while the blocks read tables: (lengths [E, 1], None)."""

    def forward(self, lengths: Tensor, node_attrs: Tensor, edge_index: Tensor,
                atomic_numbers: Tensor) -> tuple[Tensor, None]:
        return lengths, None


def _radial_function(embedding: torch.nn.Module, mlp: torch.nn.Module):
    """W(r) of one block in FP64 on the CPU (copies; the model is left alone): mlp(embedding(r)) [* cutoff]."""
    embedding = fp64_copy(embedding)
    mlp = fp64_copy(getattr(original(mlp), "original", (mlp,))[0])  # e3nn's net, not cgforge's stand-in of it

    def fn(r: Tensor) -> Tensor:
        feats, cutoff = embedding(r.unsqueeze(1), None, None, None)
        w = mlp(feats)
        return w if cutoff is None else w * cutoff

    return fn


def radial_tables(model: torch.nn.Module) -> list[TabulatedRadial]:
    """The tables a patched MACE model's blocks read now (empty: none)."""
    return [b.conv_tp_weights for b in model.interactions if isinstance(b.conv_tp_weights, TabulatedRadial)]


def why_not_tabulated(model: torch.nn.Module) -> str | None:
    """None when ``set_radial_table(model, True)`` can tabulate every block, else the reason."""
    if not is_mace_model(model):
        return f"not a MACE model ({type(model).__qualname__})"
    if any(isinstance(b.conv_tp_weights, DeferredRadial) for b in model.interactions):
        return ("the model streams its edges: turn streaming off first (tables set first stream too; "
                "Calculator does it in that order)")
    if not streaming.geometry_can_stream(model):
        return ("its blocks or radial embedding are not ones whose weights cgforge reads as a function of r alone "
                f"({', '.join(streaming.STREAMING_INTERACTIONS)} with a plain RadialEmbeddingBlock, in a patched "
                "MACE or ScaleShiftMACE)")
    return None


def set_radial_table(model: torch.nn.Module, on: bool, tol: float = DEFAULT_TOL) -> int:
    """Tabulate every block's weights as a function of r (``on``), or give the MLPs back, in place; the number of
    tabulated blocks. ValueError with the reason (``why_not_tabulated``, or a table that misses ``tol``)."""
    if not on:
        for block in model.interactions:
            if isinstance(block.conv_tp_weights, TabulatedRadial):
                block.conv_tp_weights = block.conv_tp_weights.module
        if isinstance(model.radial_embedding, LengthsAsEdgeFeatures):
            model.radial_embedding = model.radial_embedding.module
        return 0
    if radial_tables(model):
        return len(radial_tables(model))
    reason = why_not_tabulated(model)
    if reason is not None:
        raise ValueError(f"radial tables: {reason}")
    embedding = original(model.radial_embedding)
    like = next(p for p in model.parameters() if p.is_floating_point())
    tables = [tabulate(block.conv_tp_weights, _radial_function(embedding, block.conv_tp_weights), float(model.r_max),
                       tol, like, f"interactions.{i}") for i, block in enumerate(model.interactions)]
    for block, table in zip(model.interactions, tables, strict=True):  # all fitted: swap them in together
        block.conv_tp_weights = table
    model.radial_embedding = LengthsAsEdgeFeatures(embedding)
    set_table_fusion(model, all(getattr(b.conv_tp, "reads_tables", False) for b in model.interactions))
    return len(tables)


def set_table_fusion(model: torch.nn.Module, on: bool) -> None:
    """``fuse_tables`` for every tabulated block (on by default where every block's convolution is cgforge's)."""
    layers = [(f"interactions.{i}", block.conv_tp_weights, block.conv_tp) for i, block in enumerate(model.interactions)]
    fuse_tables([layer for layer in layers if isinstance(layer[1], TabulatedRadial)], on)
