"""Radial tables in patched NequIP models: each interaction block's edge MLP as a table of the edge length.

In nequip 0.19 a block's weights are edge_mlp(factor * bessel(x) * cutoff(x)), x = r / r_max per edge type pair
(``EdgeLengthNormalizer``, ``BesselEdgeLengthEncoding`` with ``PolynomialCutoff``, ``ApplyFactor``), and nothing
else reads the embedding or ``edge_cutoff``: a function of x on [0, 1], edge_mlp(0) beyond (the table's clamp).
With tables on, the encoding is ``NormLengthAsEmbedding`` (x itself), each factor ``FactorInTable`` and each
``edge_mlp`` a ``TabulatedRadial`` fitted from copies of the model's modules, read inside cgforge's kernels
(``set_table_fusion``). The state_dict is unchanged; toggling tables while streaming restarts streaming.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from ..radial_table import DEFAULT_TOL, TabulatedRadial, fp64_copy, fuse_tables, original, tabulate
from ..streaming import Deferred, DeferredRadial
from . import streaming
from .conv import CgforgeTensorProductScatter
from .modules import CUTOFF_MODULES, NODE_MODULES, class_name

_EMBEDDING = "edge_embedding"  # nequip 0.19's AtomicDataDict.EDGE_EMBEDDING_KEY: the key InteractionBlock reads


class NormLengthAsEmbedding(Deferred):
    """Stand-in for ``BesselEdgeLengthEncoding`` while the blocks read tables: the edge embedding is x itself."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__(module)
        self.field, self.out_field = module.norm_length_field, module.edge_invariant_field
        self.out_dtype = module._output_dtype  # the model dtype, which the encoding casts to

    def forward(self, data: dict[str, Tensor]) -> dict[str, Tensor]:
        data[self.out_field] = data[self.field].to(self.out_dtype)
        return data


class FactorInTable(Deferred):
    """Stand-in for an ``ApplyFactor`` on the edge embedding while the blocks read tables (which hold the factor)."""

    def forward(self, data: dict[str, Tensor]) -> dict[str, Tensor]:
        return data


_Block = tuple[str, torch.nn.Module, list[torch.nn.Module]]  # (where, InteractionBlock, embedding modules before it)


def _names_embedding(module: torch.nn.Module) -> bool:
    """Whether a module is configured to read or write the edge embedding (a field name among its attributes)."""
    return any(value == _EMBEDDING for value in vars(module).values() if isinstance(value, str))


def _check_encoding(name: str, module: torch.nn.Module) -> str | None:
    for attr in ("norm_length_field", "edge_invariant_field", "_output_dtype", "cutoff"):
        if not hasattr(module, attr):
            return f"{name} (BesselEdgeLengthEncoding) has no .{attr}: not nequip 0.19's"
    if module.edge_invariant_field != _EMBEDDING:
        return f"{name} writes {module.edge_invariant_field!r}, not the {_EMBEDDING!r} the interaction blocks read"
    if class_name(module.cutoff) != "PolynomialCutoff":  # zero for x >= 1: the table's clamp is then exact
        return f"{name}: its cutoff {class_name(module.cutoff)} is not nequip's PolynomialCutoff"
    return None


def _check_block(name: str, layer: torch.nn.Module) -> str | None:
    conv = getattr(layer, "conv", None)
    if class_name(conv) != "InteractionBlock":
        return f"{name}.conv ({class_name(conv)}) is not nequip's InteractionBlock"
    if not isinstance(conv.tp_scatter, CgforgeTensorProductScatter):
        return f"{name}.conv is not patched by cgforge (patch the model first)"
    if not isinstance(getattr(conv, "edge_mlp", None), torch.nn.Module):
        return f"{name}.conv has no edge_mlp module"
    return None


def _plan(model: torch.nn.Module) -> tuple[torch.nn.Module, list[_Block]] | str:
    """(the SequentialGraphNetwork, its blocks with the embedding modules each reads through), or why not: one
    BesselEdgeLengthEncoding, factors applied to it, ConvNetLayers and modules known not to touch it."""
    found = [m for m in model.modules() if class_name(m) == "SequentialGraphNetwork"]  # inside ForceStressOutput
    if len(found) != 1:
        return (f"expected a nequip model with one SequentialGraphNetwork, found {len(found)} in "
                f"{type(model).__qualname__}")
    seq = found[0]
    chain: list[torch.nn.Module] | None = None  # the modules that made the embedding so far
    blocks: list[_Block] = []
    for name, child in seq.named_children():
        child = original(child)  # the modules a tabulated model's stand-ins hold
        cls = class_name(child)
        if cls == "BesselEdgeLengthEncoding":
            if chain is not None:
                return f"{name}: a second edge embedding (BesselEdgeLengthEncoding)"
            if (reason := _check_encoding(name, child)) is not None:
                return reason
            chain = [child]
        elif cls == "ApplyFactor" and _names_embedding(child):
            if chain is None or not (child.in_field == child.out_field == _EMBEDDING):
                return f"{name} (ApplyFactor) uses the edge embedding other than scaling it in place after it is made"
            chain.append(child)
        elif cls == "ConvNetLayer":
            if (reason := _check_block(name, child)) is not None:
                return reason
            if chain is None:
                return f"{name} reads the edge embedding before a BesselEdgeLengthEncoding makes it"
            blocks.append((f"{name}.conv", child.conv, list(chain)))
        elif cls in NODE_MODULES or cls in CUTOFF_MODULES:
            if _names_embedding(child):
                return f"{name} ({cls}) reads or writes the edge embedding"
        else:
            return f"{name} ({cls}) is not a module cgforge has checked"
    if not blocks:
        return "no interaction blocks (ConvNetLayer) found"
    return seq, blocks


def why_not_tabulated(model: torch.nn.Module) -> str | None:
    """None when ``set_radial_table(model, True)`` can tabulate every block of a patched NequIP model (a
    GraphModel, or the energy model inside it), else the reason."""
    plan = _plan(model)
    return plan if isinstance(plan, str) else None


def _weights_of_x(chain: list[torch.nn.Module], mlp: torch.nn.Module) -> Callable[[Tensor], Tensor]:
    """W(x) of one block in FP64 on the CPU from copies of its modules: the encoding and factors, then its MLP."""
    steps = [fp64_copy(m) for m in chain]
    steps[0]._output_dtype = torch.float64  # the encoding casts to the model dtype; keep the fit in FP64
    field = steps[0].norm_length_field
    mlp = fp64_copy(mlp)

    def fn(x: Tensor) -> Tensor:
        data = {field: x.unsqueeze(1)}
        for step in steps:
            data = step(data)
        return mlp(data[_EMBEDDING])

    return fn


def _tabulated_blocks(model: torch.nn.Module) -> list[tuple[str, TabulatedRadial, torch.nn.Module]]:
    """(where, table, convolution) of every block that reads a table, streaming or not."""
    found = []
    for where, module in model.named_modules():
        mlp = getattr(module, "edge_mlp", None) if class_name(module) == "InteractionBlock" else None
        while isinstance(mlp, Deferred) and not isinstance(mlp, TabulatedRadial):
            mlp = mlp.module  # a streaming block's DeferredRadial holds the table
        if isinstance(mlp, TabulatedRadial):
            found.append((where, mlp, module.tp_scatter))
    return found


def radial_tables(model: torch.nn.Module) -> list[TabulatedRadial]:
    """The tables the blocks of a patched NequIP model read now, streaming or not (empty: none)."""
    return [table for _, table, _ in _tabulated_blocks(model)]


def set_table_fusion(model: torch.nn.Module, on: bool) -> None:
    """``fuse_tables`` for every tabulated block (streaming blocks evaluate their table per chunk either way)."""
    fuse_tables(_tabulated_blocks(model), on)


@contextmanager
def _streaming_paused(model: torch.nn.Module) -> Iterator[None]:
    """Inside: no block streams (their edge_mlp is theirs to swap); after: the streaming blocks stream again."""
    streaming_now = [m for m in streaming.streaming_layers(model) if isinstance(m.edge_mlp, DeferredRadial)]
    # streaming.set_streaming gives every layer the same size
    chunk = max(m.tp_scatter.chunk_edges for m in streaming_now) if streaming_now else None
    if chunk is not None:
        streaming.set_streaming(model, None)
    try:
        yield
    finally:
        if chunk is not None:
            streaming.set_streaming(model, chunk)


def _tables_off(model: torch.nn.Module) -> None:
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, (TabulatedRadial, NormLengthAsEmbedding, FactorInTable)):
                setattr(parent, name, child.module)


def set_radial_table(model: torch.nn.Module, on: bool, tol: float = DEFAULT_TOL) -> int:
    """Tabulate every block's weights as a function of the normalised edge length (``on``), or give the MLPs and the
    embedding back, in place; the number of tabulated blocks. ValueError with the reason (``why_not_tabulated``,
    or a table that misses ``tol``)."""
    if not on:
        with _streaming_paused(model):
            _tables_off(model)
        return 0
    if radial_tables(model):
        return len(radial_tables(model))
    plan = _plan(model)
    if isinstance(plan, str):
        raise ValueError(f"radial tables: {plan}")
    seq, blocks = plan
    like = torch.empty(0, dtype=blocks[0][2][0]._output_dtype, device=next(seq.parameters()).device)
    tables = [tabulate(block.edge_mlp, _weights_of_x(chain, block.edge_mlp), 1.0, tol, like, where)
              for where, block, chain in blocks]
    embedding = {id(m) for _, _, chain in blocks for m in chain}
    with _streaming_paused(model):  # all fitted: swap them in together
        for (_, block, _), table in zip(blocks, tables, strict=True):
            block.edge_mlp = table
        for name, child in list(seq.named_children()):
            if id(child) in embedding:
                stand_in = NormLengthAsEmbedding if class_name(child) == "BesselEdgeLengthEncoding" else FactorInTable
                setattr(seq, name, stand_in(child))
    set_table_fusion(model, all(getattr(conv, "reads_tables", False) for _, _, conv in _tabulated_blocks(model)))
    return len(tables)
