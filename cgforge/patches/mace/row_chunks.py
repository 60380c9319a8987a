"""The stored path's widest per-atom rows in chunks: each block's convolution and its next linear, by row ranges.

Without them the force call's peak is in the forward, at a block's linear, where its convolution output, the
linear's output and ``/ avg_num_neighbors`` of it are all alive. With row chunks on, a block's ``conv_tp`` makes
its rows ``chunk_rows`` at a time through the block's ``linear`` (``kernels.Convolution.forward_table_rows``),
which becomes ``AppliedLinear``; the harmonics keep only their input for the backward (``RecomputedHarmonics``).
Only blocks that read their radial table inside the kernels chunk, per system size by the blocks' ``RowPolicy``,
never while streaming or under torch.compile.
"""

from __future__ import annotations

import torch

from ..radial_table import TabulatedRadial
from ..streaming import Deferred
from .streaming import _fuse_linear, streaming_blocks

__all__ = ["ROW_CHUNKED_EDGE_ITEMS", "RecomputedHarmonics", "chunk_rows_for", "row_chunk_blocks", "set_row_chunks"]

# Peak bytes per edge of a stored-path force call with row chunks on (``radial_table.FUSED_EDGE_ITEMS`` without),
# in items of the model's dtype (measured: docs/measured-constants.md).
ROW_CHUNKED_EDGE_ITEMS = 215

class _Recomputed(torch.autograd.Function):
    """``module(vectors)`` keeping only ``vectors`` for the backward, which evaluates the module again (any
    order: under create_graph the recomputation is a function of the saved input)."""

    @staticmethod
    def forward(ctx, vectors: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
        ctx.module = module
        ctx.save_for_backward(vectors)
        return module(vectors)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN205
        (vectors,) = ctx.saved_tensors
        keep_graph = torch.is_grad_enabled()
        with torch.enable_grad():
            x = vectors if keep_graph else vectors.detach().requires_grad_()
            (gx,) = torch.autograd.grad(ctx.module(x), x, grad, create_graph=keep_graph)
        return gx, None


class RecomputedHarmonics(Deferred):
    """Stand-in for ``model.spherical_harmonics`` while rows are chunked: the same values, evaluated again in the
    backward rather than kept (the original module rides along, adopted)."""

    def forward(self, vectors: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled() or not vectors.requires_grad:
            return self.module(vectors)
        return _Recomputed.apply(vectors, self.module)


def _recompute_harmonics(model: torch.nn.Module, on: bool) -> None:
    harmonics = model.spherical_harmonics
    if on and not isinstance(harmonics, Deferred):  # streaming's deferred harmonics keep nothing already
        model.spherical_harmonics = RecomputedHarmonics(harmonics)
    elif not on and isinstance(harmonics, RecomputedHarmonics):
        model.spherical_harmonics = harmonics.module


def row_chunk_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks that can make their rows in chunks: streaming-capable blocks whose table is read in the kernels."""
    return [b for b in streaming_blocks(model)
            if isinstance(b.conv_tp_weights, TabulatedRadial) and b.conv_tp_weights.fused]


def chunk_rows_for(model: torch.nn.Module, n_atoms: int, dtype: torch.dtype) -> int | None:
    """Rows per chunk for ``n_atoms`` atoms by the blocks' ``RowPolicy`` (None: not worth chunking, or no block can)."""
    blocks = row_chunk_blocks(model)
    if not blocks:
        return None
    rows = blocks[0].conv_tp.rows  # one policy per patch call
    row_bytes = max(b.conv_tp.irreps_out.dim for b in blocks) * (torch.finfo(dtype).bits // 8)
    if n_atoms * row_bytes <= rows.chunked_above_bytes:
        return None
    return max(rows.chunk_bytes // row_bytes, rows.min_chunk_rows)


def set_row_chunks(model: torch.nn.Module, chunk_rows: int | None) -> bool:
    """Make each able block's convolution rows and its linear ``chunk_rows`` rows at a time (None: stop). Returns
    True when that changed anything. Refused while the model streams (its convolutions apply the linear already)."""
    if chunk_rows is not None and (isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1):
        raise ValueError(f"chunk_rows must be a positive int or None, got {chunk_rows!r}")
    blocks = row_chunk_blocks(model) if chunk_rows is not None else streaming_blocks(model)
    if chunk_rows is not None and any(b.conv_tp.chunk_edges is not None for b in blocks):
        raise ValueError("row chunks: this model streams its edges (which maps its rows in chunks already)")
    changed = False
    for block in blocks:
        if block.conv_tp.chunk_edges is not None:  # streaming: not ours to change
            continue
        changed |= block.conv_tp.row_chunk != chunk_rows
        block.conv_tp.row_chunk = chunk_rows
        _fuse_linear([block], chunk_rows is not None)
    if chunk_rows is None or blocks:
        before = model.spherical_harmonics
        _recompute_harmonics(model, chunk_rows is not None)
        changed |= model.spherical_harmonics is not before
    return changed
