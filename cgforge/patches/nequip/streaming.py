"""Streaming edges in patched NequIP models: each interaction block's ``edge_mlp`` runs inside the convolution.

Nothing but ``tp_scatter`` reads ``edge_mlp``'s weights: with streaming on, ``edge_mlp`` is a ``DeferredRadial``
and ``CgforgeTensorProductScatter`` streams the deferred weights (``patches/streaming.py``).
"""

from __future__ import annotations

import torch

from ..streaming import chunk_edges_for as _chunk_edges_for
from ..streaming import defer_radial
from .conv import CgforgeTensorProductScatter


def streaming_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules holding an ``edge_mlp`` whose weights go only to a cgforge ``tp_scatter``."""
    return [m for m in model.modules() if isinstance(getattr(m, "tp_scatter", None), CgforgeTensorProductScatter)
            and isinstance(getattr(m, "edge_mlp", None), torch.nn.Module)]


def set_streaming(model: torch.nn.Module, chunk_edges: int | None) -> int:
    """Stream the edges of every layer that can (``chunk_edges`` per chunk), or stop (None); the number of
    streaming layers. The radial MLPs' parameters stop requiring grad (inference)."""
    return defer_radial(streaming_layers(model), "edge_mlp", "tp_scatter", chunk_edges)


def chunk_edges_for(model: torch.nn.Module, budget_bytes: int, dtype: torch.dtype) -> int:
    layers = [(m.edge_mlp, m.tp_scatter.conv.weight_numel) for m in streaming_layers(model)]
    return _chunk_edges_for(layers, budget_bytes, dtype)
