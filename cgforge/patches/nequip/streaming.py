"""Streaming edges in patched NequIP models: each interaction block's ``edge_mlp`` runs inside the convolution.

nequip's interaction block calls ``tp_scatter(x, edge_attr, edge_weight=edge_mlp(edge_embedding), ...)``
and nothing else reads the weights. With streaming on, ``edge_mlp`` is a ``DeferredRadial`` stand-in and
cgforge's ``CgforgeTensorProductScatter`` hands the deferred weights to ``kernels.streaming_convolution``
(``patches/streaming.py``).
"""

from __future__ import annotations

import torch

from ..streaming import DeferredRadial
from ..streaming import chunk_edges_for as _chunk_edges_for
from .conv import CgforgeTensorProductScatter

__all__ = ["chunk_edges_for", "set_streaming", "streaming_layers"]


def streaming_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules holding an ``edge_mlp`` whose weights go only to a cgforge ``tp_scatter``."""
    return [m for m in model.modules() if isinstance(getattr(m, "tp_scatter", None), CgforgeTensorProductScatter)
            and isinstance(getattr(m, "edge_mlp", None), torch.nn.Module)]


def set_streaming(model: torch.nn.Module, chunk_edges: int | None) -> int:
    """Stream the edges of every layer that can (``chunk_edges`` per chunk), or stop (None); the number of
    streaming layers. The radial MLPs' parameters stop requiring grad (inference)."""
    if chunk_edges is not None and (isinstance(chunk_edges, bool) or not isinstance(chunk_edges, int)
                                    or chunk_edges < 1):
        raise ValueError(f"chunk_edges must be a positive int or None, got {chunk_edges!r}")
    layers = streaming_layers(model)
    for layer in layers:
        if chunk_edges is None:
            if isinstance(layer.edge_mlp, DeferredRadial):
                layer.edge_mlp = layer.edge_mlp.mlp
            layer.tp_scatter.chunk_edges = None
        else:
            if not isinstance(layer.edge_mlp, DeferredRadial):
                layer.edge_mlp = DeferredRadial(layer.edge_mlp)
            layer.edge_mlp.requires_grad_(False)
            layer.tp_scatter.chunk_edges = chunk_edges
    return len(layers) if chunk_edges is not None else 0


def chunk_edges_for(model: torch.nn.Module, budget_bytes: int, dtype: torch.dtype) -> int:
    layers = [(m.edge_mlp, m.tp_scatter.conv.weight_numel) for m in streaming_layers(model)]
    return _chunk_edges_for(layers, budget_bytes, dtype)
