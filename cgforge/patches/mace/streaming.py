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

from typing import Any

import torch

from ..families import is_mace_model

__all__ = ["STREAMING_INTERACTIONS", "DeferredRadial", "DeferredWeights", "chunk_edges_for", "set_streaming",
           "streaming_blocks"]

# Blocks of mace-torch 0.3.16 whose forward is: tp_weights = conv_tp_weights(edge_feats) [* cutoff],
# message = conv_tp(node_feats, edge_attrs, tp_weights, edge_index) and nothing else reads tp_weights.
STREAMING_INTERACTIONS = ("RealAgnosticInteractionBlock", "RealAgnosticResidualInteractionBlock")


class DeferredWeights:
    """``radial(radial_in) * scale`` for every edge, not computed: the streaming convolution computes it
    per chunk. Supports only what MACE does with tp_weights before the convolution (``* cutoff``);
    anything else fails loudly rather than computing the weights of every edge."""

    def __init__(self, radial: torch.nn.Module, radial_in: torch.Tensor, scale: torch.Tensor | None = None) -> None:
        self.radial, self.radial_in, self.scale = radial, radial_in, scale

    def __mul__(self, other: Any) -> DeferredWeights:
        if not isinstance(other, torch.Tensor) or other.shape != (self.radial_in.shape[0], 1):
            raise TypeError(f"deferred tp_weights can be scaled by one value per edge ([E, 1]), got "
                            f"{type(other).__name__} {list(getattr(other, 'shape', []))}")
        return DeferredWeights(self.radial, self.radial_in, other if self.scale is None else self.scale * other)

    __rmul__ = __mul__

    @property
    def num_edges(self) -> int:
        return self.radial_in.shape[0]


class DeferredRadial(torch.nn.Module):
    """Stand-in for a block's ``conv_tp_weights`` while it streams: returns ``DeferredWeights``."""

    def __init__(self, mlp: torch.nn.Module) -> None:
        super().__init__()
        for name, child in mlp.named_children():  # same state_dict keys as the MLP it defers
            self.add_module(name, child)
        for name, param in mlp.named_parameters(recurse=False):
            self.register_parameter(name, param)
        for name, buf in mlp.named_buffers(recurse=False):
            self.register_buffer(name, buf)
        self.original = (mlp,)  # a tuple: not a submodule again; shares the adopted children

    @property
    def mlp(self) -> torch.nn.Module:
        return self.original[0]

    def forward(self, edge_feats: torch.Tensor) -> DeferredWeights:
        return DeferredWeights(self.mlp, edge_feats)


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
    if chunk_edges is not None and (isinstance(chunk_edges, bool) or not isinstance(chunk_edges, int)
                                    or chunk_edges < 1):
        raise ValueError(f"chunk_edges must be a positive int or None, got {chunk_edges!r}")
    blocks = streaming_blocks(model)
    for block in blocks:
        if chunk_edges is None:
            if isinstance(block.conv_tp_weights, DeferredRadial):
                block.conv_tp_weights = block.conv_tp_weights.mlp
            block.conv_tp.chunk_edges = None
        else:
            if not isinstance(block.conv_tp_weights, DeferredRadial):
                block.conv_tp_weights = DeferredRadial(block.conv_tp_weights)
            block.conv_tp_weights.requires_grad_(False)
            block.conv_tp.chunk_edges = chunk_edges
    return len(blocks) if chunk_edges is not None else 0


def chunk_edges_for(model: torch.nn.Module, budget_bytes: int, dtype: torch.dtype) -> int:
    """Edges per chunk so that one chunk's weights, their gradient and the MLP's activations fit
    ``budget_bytes`` (the largest layer decides)."""
    per_edge = 0
    for block in streaming_blocks(model):
        mlp = block.conv_tp_weights
        mlp = mlp.mlp if isinstance(mlp, DeferredRadial) else mlp
        widths = [p.shape[-1] for p in mlp.parameters() if p.dim() == 2]
        # weights, dW and the recomputed weights in the backward, plus every hidden activation twice
        per_edge = max(per_edge, 3 * block.conv_tp.weight_numel + 2 * sum(widths))
    itemsize = torch.finfo(dtype).bits // 8
    return max(1024, int(budget_bytes // max(per_edge * itemsize, 1)))
