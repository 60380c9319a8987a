"""Streaming edges, shared by the model families: per-edge values deferred into the convolution.

While streaming, a layer's radial MLP is a ``DeferredRadial`` returning ``DeferredWeights`` (nothing computed),
which the family's convolution hands to ``stream``: the weights are made chunk by chunk. Harmonics and radial
basis may be deferred too (``EdgeRows``), so autograd keeps none of them. The state_dict is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from cgforge import kernels

from .torch_internals import adopt


class EdgeRows:
    """A per-edge value [E, k], not computed: ``fn(*(t[chunk] for t in inputs))`` for any chunk of edges (``fn`` treats
    rows independently). It can only be multiplied by another per-edge value of one column (a cutoff); anything else
    fails loudly rather than computing it for every edge."""

    def __init__(self, fn: Callable[..., Tensor], inputs: tuple[Tensor, ...]) -> None:
        self.fn, self.inputs = fn, tuple(inputs)

    @property
    def num_edges(self) -> int:
        return self.inputs[0].shape[0]

    def __mul__(self, other: Any) -> EdgeRows:
        if isinstance(other, EdgeRows):
            n = len(self.inputs)
            return EdgeRows(lambda *rows: self.fn(*rows[:n]) * other.fn(*rows[n:]), self.inputs + other.inputs)
        if isinstance(other, Tensor) and other.shape == (self.num_edges, 1):
            return EdgeRows(lambda *rows: self.fn(*rows[:-1]) * rows[-1], self.inputs + (other,))
        raise TypeError(f"a deferred per-edge value can be multiplied by one value per edge ([E, 1]), got "
                        f"{type(other).__name__} {list(getattr(other, 'shape', []))}")

    __rmul__ = __mul__

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"{name!r}: a deferred per-edge value (streaming edges) is computed only inside the "
                             "streaming convolution; this model reads it elsewhere, so it cannot stream its edge "
                             "geometry (turn streaming off)")


def _rows(value: Tensor | EdgeRows) -> EdgeRows:
    return value if isinstance(value, EdgeRows) else EdgeRows(lambda rows: rows, (value,))


class DeferredWeights:
    """``radial(radial_in) * scale`` for every edge, not computed (the streaming convolution makes it per chunk);
    ``radial_in`` and ``scale``: tensors or ``EdgeRows``. Only ``* cutoff`` is supported; anything else fails loudly."""

    def __init__(self, radial: torch.nn.Module, radial_in: Tensor | EdgeRows,
                 scale: Tensor | EdgeRows | None = None) -> None:
        self.radial, self.radial_in, self.scale = radial, radial_in, scale

    def __mul__(self, other: Any) -> DeferredWeights:
        if not (isinstance(other, EdgeRows) or isinstance(other, Tensor) and other.shape == (self.num_edges, 1)):
            raise TypeError(f"deferred tp_weights can be scaled by one value per edge ([E, 1]), got "
                            f"{type(other).__name__} {list(getattr(other, 'shape', []))}")
        return DeferredWeights(self.radial, self.radial_in, other if self.scale is None else _rows(self.scale) * other)

    __rmul__ = __mul__

    @property
    def num_edges(self) -> int:
        return self.radial_in.num_edges if isinstance(self.radial_in, EdgeRows) else self.radial_in.shape[0]


def stream(conv: kernels.Convolution, x: Tensor, y: Tensor | EdgeRows, weights: DeferredWeights,
           graph: kernels.ConvGraph, chunk_edges: int, out_fn: torch.nn.Module | None = None) -> Tensor:
    """``conv(x, y, weights)`` by ``kernels.streaming_edge_convolution``, (y, weights) made per chunk from the edge
    inputs behind them; ``out_fn``: the linear layer that follows, per chunk of output rows."""
    parts = [_rows(y), _rows(weights.radial_in)] + ([] if weights.scale is None else [_rows(weights.scale)])
    inputs: list[Tensor] = []
    where: list[list[int]] = []  # per part: the positions of its inputs in `inputs`
    for part in parts:
        slots = []
        for t in part.inputs:
            found = next((k for k, seen in enumerate(inputs) if seen is t), None)
            if found is None:
                found = len(inputs)
                inputs.append(t)
            slots.append(found)
        where.append(slots)
    radial = weights.radial
    weights_of = radial.chunk_weights() if isinstance(radial, Deferred) else radial

    def edge_fn(*rows: Tensor) -> tuple[Tensor, Tensor]:
        values = [part.fn(*(rows[k] for k in slots)) for part, slots in zip(parts, where, strict=True)]
        w = weights_of(values[1])
        return values[0], (w * values[2] if len(values) > 2 else w)

    constants = (radial,) if isinstance(radial, torch.nn.Module) else ()
    return kernels.streaming_edge_convolution(conv, x, inputs, edge_fn, graph, chunk_edges, constants=constants,
                                              out_fn=out_fn)


class Deferred(torch.nn.Module):
    """Base of the stand-ins that return deferred values while streaming: holds ``module`` (the original), adopts
    its submodules and tensors (same state_dict), and reads other attributes from it."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        adopt(self, module, children=True)
        self.original = (module,)  # a tuple: not a submodule again; shares the adopted children

    @property
    def module(self) -> torch.nn.Module:
        return self.original[0]

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "original":
                raise
            return getattr(self.original[0], name)

    def chunk_weights(self) -> Callable[[Tensor], Tensor] | torch.nn.Module:
        """What the streaming convolution calls on a chunk's radial inputs to get its weights: the module itself."""
        return self


class DeferredRadial(Deferred):
    """Stand-in for a layer's radial MLP while it streams: returns ``DeferredWeights``."""

    @property
    def mlp(self) -> torch.nn.Module:
        return self.module

    def forward(self, edge_feats: Tensor | EdgeRows) -> DeferredWeights:
        return DeferredWeights(self.mlp, edge_feats)


def chunk_edges_for(layers: list[tuple[torch.nn.Module, int]], budget_bytes: int, dtype: torch.dtype) -> int:
    """Edges per chunk so that one chunk's weights, their gradient and the radial MLP's activations fit
    ``budget_bytes``; ``layers`` holds (radial MLP, weight_numel) per streaming layer, the largest decides."""
    per_edge = 0
    for mlp, weight_numel in layers:
        mlp = mlp.mlp if isinstance(mlp, DeferredRadial) else mlp
        widths = [p.shape[-1] for p in mlp.parameters() if p.dim() == 2]
        # weights, dW and the recomputed weights in the backward, every hidden activation twice, and the
        # recomputed edge geometry (spherical harmonics, radial basis and their intermediates: ~64 values)
        per_edge = max(per_edge, 3 * weight_numel + 2 * sum(widths) + 64)
    itemsize = torch.finfo(dtype).bits // 8
    return max(1024, int(budget_bytes // max(per_edge * itemsize, 1)))


def defer_radial(layers: list[torch.nn.Module], mlp_attr: str, conv_attr: str, chunk_edges: int | None) -> int:
    """Swap each layer's radial MLP (``layer.<mlp_attr>``) for a ``DeferredRadial`` and tell its convolution the chunk
    size (None: swap back); the number of streaming layers. The MLPs' parameters stop requiring grad (inference)."""
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
