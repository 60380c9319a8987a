"""One ``ConvGraph`` per model call, shared by every convolution layer of one model.

MACE hands the same ``edge_index`` to every interaction block; NequIP hands each layer fresh views
``edge_index[0]`` / ``edge_index[1]`` of one tensor. Either way the first layer builds the graph
(receiver sort, CSR, transpose permutation) and the others reuse it.
"""

from __future__ import annotations

import torch

from cgforge import kernels


class CallGraphCache:
    """A hit needs the same base tensors (held here, so their ids cannot be recycled), the same view
    layout, unchanged in-place version counters and the same node count. The cache is also registered
    as a forward pre-hook of the model and emptied at the start of every call, so a graph never
    outlives a call (inference tensors have no version counter). Not thread-safe.
    """

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self._bases: tuple[torch.Tensor, torch.Tensor] | None = None
        self._key: tuple | None = None
        self._graph: kernels.ConvGraph | None = None

    def get(self, edge_src: torch.Tensor, edge_dst: torch.Tensor, num_nodes: int) -> kernels.ConvGraph:
        bases = (_base(edge_src), _base(edge_dst))
        key = (_layout(edge_src), _layout(edge_dst), _version(bases[0]), _version(bases[1]), int(num_nodes))
        cached = self._bases
        if cached is not None and cached[0] is bases[0] and cached[1] is bases[1] and self._key == key:
            return self._graph
        graph = kernels.ConvGraph(edge_src, edge_dst, int(num_nodes))
        self._bases, self._key, self._graph = bases, key, graph
        return graph

    def __call__(self, module: torch.nn.Module, args: object) -> None:  # forward pre-hook
        self.clear()

    # Pickled (with the model) and deep-copied empty: a graph belongs to one call on one device.
    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.clear()


def _base(t: torch.Tensor) -> torch.Tensor:
    return t._base if t._base is not None else t


def _layout(t: torch.Tensor) -> tuple:
    return t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter; the per-call reset covers them
        return -1
