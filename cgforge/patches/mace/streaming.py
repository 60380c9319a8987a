"""Streaming edges in patched MACE models: the radial MLP runs inside the convolution, chunk by chunk.

A MACE interaction block computes ``tp_weights = conv_tp_weights(edge_feats)`` ([E, weight_numel],
1.8 GB per MACE-MP-medium layer at 436k edges), optionally ``tp_weights * cutoff``, and hands it to
``conv_tp``. With streaming on, ``conv_tp_weights`` is a ``DeferredRadial`` stand-in that returns a
``DeferredWeights`` value (the MLP, its input and the per-edge scale, nothing computed), and the
patched ``conv_tp`` (``FusedConvTP``) recognises it and calls ``kernels.streaming_convolution``, which
makes and consumes the weights per chunk of edges, forward and backward.

Only the blocks whose forward uses ``tp_weights`` solely as ``conv_tp``'s weights (optionally times the
cutoff) stream (``STREAMING_INTERACTIONS``); the others keep the stored path. The state_dict is
unchanged: the stand-in adopts the MLP's submodules under their own names.
"""

from __future__ import annotations

import torch

from ..families import is_mace_model
from ..streaming import DeferredRadial, DeferredWeights, defer_radial
from ..streaming import chunk_edges_for as _chunk_edges_for

__all__ = ["STREAMING_INTERACTIONS", "DeferredRadial", "DeferredWeights", "chunk_edges_for", "set_streaming",
           "streaming_blocks"]

# Blocks of mace-torch 0.3.16 whose forward is: tp_weights = conv_tp_weights(edge_feats) [* cutoff],
# message = conv_tp(node_feats, edge_attrs, tp_weights, edge_index) and nothing else reads tp_weights.
STREAMING_INTERACTIONS = ("RealAgnosticInteractionBlock", "RealAgnosticResidualInteractionBlock")


def streaming_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The interaction blocks of a patched MACE model that can stream."""
    from .patch import FusedConvTP

    return [b for b in model.interactions if type(b).__name__ in STREAMING_INTERACTIONS
            and isinstance(getattr(b, "conv_tp", None), FusedConvTP)]


def set_streaming(model: torch.nn.Module, chunk_edges: int | None) -> int:
    """Stream the edges of every block that can (``chunk_edges`` per chunk), or stop (None).

    Returns the number of streaming blocks. The radial MLPs' parameters are set to not require grad
    (the streaming path is for inference). In place; ``unpatch`` also turns streaming off.
    """
    if not is_mace_model(model):
        raise TypeError(f"model: expected a patched MACE model, got {type(model).__qualname__}")
    return defer_radial(streaming_blocks(model), "conv_tp_weights", "conv_tp", chunk_edges)


def chunk_edges_for(model: torch.nn.Module, budget_bytes: int, dtype: torch.dtype) -> int:
    """Edges per chunk of the model's streaming blocks for a working set of ``budget_bytes``."""
    layers = [(b.conv_tp_weights, b.conv_tp.weight_numel) for b in streaming_blocks(model)]
    return _chunk_edges_for(layers, budget_bytes, dtype)
