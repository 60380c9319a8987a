"""Streaming edges, shared by the model families: the radial MLP deferred into the convolution.

A message-passing layer computes its tensor-product weights for every edge (``radial(edge_features)``,
[E, weight_numel]) and hands them to the convolution. While streaming, the layer's radial MLP is a
``DeferredRadial`` stand-in that returns ``DeferredWeights`` (the MLP, its input and an optional per-edge
scale, nothing computed); the family's patched convolution recognises it and calls
``kernels.streaming_convolution``, which makes and consumes the weights chunk by chunk. The stand-in
adopts the MLP's submodules under their own names, so the state_dict is unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["DeferredRadial", "DeferredWeights", "chunk_edges_for", "defer_radial"]


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


def chunk_edges_for(layers: list[tuple[torch.nn.Module, int]], budget_bytes: int, dtype: torch.dtype) -> int:
    """Edges per chunk so that one chunk's weights, their gradient and the radial MLP's activations fit
    ``budget_bytes``; ``layers`` holds (radial MLP, weight_numel) per streaming layer, the largest decides."""
    per_edge = 0
    for mlp, weight_numel in layers:
        mlp = mlp.mlp if isinstance(mlp, DeferredRadial) else mlp
        widths = [p.shape[-1] for p in mlp.parameters() if p.dim() == 2]
        # weights, dW and the recomputed weights in the backward, plus every hidden activation twice
        per_edge = max(per_edge, 3 * weight_numel + 2 * sum(widths))
    itemsize = torch.finfo(dtype).bits // 8
    return max(1024, int(budget_bytes // max(per_edge * itemsize, 1)))


def defer_radial(layers: list[torch.nn.Module], mlp_attr: str, conv_attr: str, chunk_edges: int | None) -> int:
    """Swap each layer's radial MLP (``layer.<mlp_attr>``) for a ``DeferredRadial`` and tell its convolution
    (``layer.<conv_attr>``) the chunk size; None swaps the MLPs back. Returns the number of streaming layers.
    The MLPs' parameters stop requiring grad: the streaming path is for inference."""
    if chunk_edges is not None and (isinstance(chunk_edges, bool) or not isinstance(chunk_edges, int)
                                    or chunk_edges < 1):
        raise ValueError(f"chunk_edges must be a positive int or None, got {chunk_edges!r}")
    for layer in layers:
        mlp = getattr(layer, mlp_attr)
        if chunk_edges is None:
            if isinstance(mlp, DeferredRadial):
                setattr(layer, mlp_attr, mlp.mlp)
        else:
            if not isinstance(mlp, DeferredRadial):
                mlp = DeferredRadial(mlp)
                setattr(layer, mlp_attr, mlp)
            mlp.requires_grad_(False)
        getattr(layer, conv_attr).chunk_edges = chunk_edges
    return len(layers) if chunk_edges is not None else 0
