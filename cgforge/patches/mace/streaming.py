"""Streaming edges in patched MACE models: the edge geometry and the radial MLP run inside the convolution.

``conv_tp_weights`` becomes a ``DeferredRadial`` whose ``DeferredWeights`` ``FusedConvTP`` streams, the block's
``linear`` runs per chunk of output rows (``AppliedLinear``), and where every block streams the harmonics and
radial embedding are deferred too (``EdgeRows``, remade per chunk). Only ``STREAMING_INTERACTIONS`` stream.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..recognise import is_mace_model
from ..streaming import Deferred, EdgeRows, defer_radial
from ..streaming import chunk_edges_for as _chunk_edges_for

# Blocks of mace-torch 0.3.16 whose forward is: tp_weights = conv_tp_weights(edge_feats) [* cutoff],
# message = conv_tp(node_feats, edge_attrs, tp_weights, edge_index) and nothing else reads tp_weights,
# edge_attrs, edge_feats or cutoff.
STREAMING_INTERACTIONS = ("RealAgnosticInteractionBlock", "RealAgnosticResidualInteractionBlock")
# Models whose forward hands edge_attrs, edge_feats and cutoff to the interaction blocks only.
_GEOMETRY_MODELS = ("MACE", "ScaleShiftMACE")


class DeferredSphericalHarmonics(Deferred):
    """Stand-in for ``model.spherical_harmonics`` while the geometry streams: returns ``EdgeRows`` of the
    vectors (the original module applied to each chunk's rows)."""

    def forward(self, vectors: Tensor) -> EdgeRows:
        return EdgeRows(self.module, (vectors,))


class DeferredRadialEmbedding(Deferred):
    """Stand-in for ``model.radial_embedding`` while the geometry streams: (edge_feats, cutoff) as
    ``EdgeRows`` of the lengths (the original block's forward applied to each chunk's rows; cutoff None
    when the block applies it to the features itself, as it returns)."""

    def forward(self, lengths: Tensor, node_attrs: Tensor, edge_index: Tensor,
                atomic_numbers: Tensor) -> tuple[EdgeRows, EdgeRows | None]:
        block = self.module

        def feats(rows: Tensor) -> Tensor:
            return block(rows, node_attrs, edge_index, atomic_numbers)[0]

        def cutoff(rows: Tensor) -> Tensor:
            return block(rows, node_attrs, edge_index, atomic_numbers)[1]

        applies_cutoff = getattr(block, "apply_cutoff", True)
        return EdgeRows(feats, (lengths,)), None if applies_cutoff else EdgeRows(cutoff, (lengths,))


_APPLIED = "_cgforge_applied_linear"  # attribute of a message whose linear the convolution applied already


def mark_linear_applied(message: Tensor, linear: torch.nn.Module) -> Tensor:
    """Tag a convolution's output as already passed through ``linear`` (read by ``AppliedLinear``)."""
    setattr(message, _APPLIED, linear)
    return message


class AppliedLinear(Deferred):
    """Stand-in for a streaming block's ``linear``, which its convolution applies per chunk of rows: passes a message
    the convolution tagged through and refuses any other (applying the linear twice would be silently wrong)."""

    def forward(self, message: Tensor) -> Tensor:
        if getattr(message, _APPLIED, None) is not self.module:
            raise RuntimeError("streaming edges: this block's convolution applies its linear layer itself, but the "
                               "message reached the linear by another path (e.g. LAMMPS ghost truncation); turn "
                               "streaming off for this use")
        return message


def streaming_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The interaction blocks of a patched MACE model that can stream."""
    # FusedConvTP says it streams (a class attribute): this module cannot import patch.py, which builds on it
    return [b for b in model.interactions if type(b).__name__ in STREAMING_INTERACTIONS
            and getattr(getattr(b, "conv_tp", None), "streams_edges", False)]


def geometry_can_stream(model: torch.nn.Module) -> bool:
    """True when the spherical harmonics and radial embedding can be deferred into the convolutions: every
    interaction block streams, the model's forward is one we read, no distance transform."""
    embedding = model.radial_embedding
    embedding = embedding.module if isinstance(embedding, Deferred) else embedding
    return (type(model).__name__ in _GEOMETRY_MODELS and len(streaming_blocks(model)) == len(model.interactions)
            and type(embedding).__name__ == "RadialEmbeddingBlock" and not hasattr(embedding, "distance_transform"))


def _fuse_linear(blocks: list[torch.nn.Module], on: bool) -> None:
    for block in blocks:
        linear = block.linear
        if on and not isinstance(linear, AppliedLinear):
            block.conv_tp.fused_linear = (linear,)
            block.linear = AppliedLinear(linear)
        elif not on and isinstance(linear, AppliedLinear):
            block.conv_tp.fused_linear = ()
            block.linear = linear.module


def _defer_geometry(model: torch.nn.Module, on: bool) -> None:
    for attr, kind in (("spherical_harmonics", DeferredSphericalHarmonics),
                       ("radial_embedding", DeferredRadialEmbedding)):
        module = getattr(model, attr)  # other stand-ins (a radial table's lengths) stay: they stream as they are
        if on and not isinstance(module, Deferred):
            setattr(model, attr, kind(module))
        elif not on and isinstance(module, kind):
            setattr(model, attr, module.module)


def set_streaming(model: torch.nn.Module, chunk_edges: int | None) -> int:
    """Stream the edges of every block that can (``chunk_edges`` per chunk), or stop (None); in place. Returns the
    number of streaming blocks. The radial MLPs' parameters stop requiring grad (inference only)."""
    if not is_mace_model(model):
        raise TypeError(f"model: expected a patched MACE model, got {type(model).__qualname__}")
    blocks = streaming_blocks(model)
    count = defer_radial(blocks, "conv_tp_weights", "conv_tp", chunk_edges)
    _fuse_linear(blocks, chunk_edges is not None)
    _defer_geometry(model, chunk_edges is not None and geometry_can_stream(model))
    return count


def chunk_edges_for(model: torch.nn.Module, budget_bytes: int, dtype: torch.dtype) -> int:
    """Edges per chunk of the model's streaming blocks for a working set of ``budget_bytes``."""
    layers = [(b.conv_tp_weights, b.conv_tp.weight_numel) for b in streaming_blocks(model)]
    return _chunk_edges_for(layers, budget_bytes, dtype)
