"""One ``ConvGraph`` per model call, shared by every convolution layer of one model.

The first layer builds the graph (MACE passes one ``edge_index`` to every block, NequIP views of one tensor) and
the others reuse it. A caller that owns the edge tensors (cgforge's calculator) can *pin* a graph it built: the
layers use it across calls with nothing built or checked per call (capturable in a CUDA graph), and the caller
keeps graph and edges consistent. It can also say, per call, which nodes share attributes (``species``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from cgforge import kernels
from cgforge.kernels import ConvGraph

from .torch_internals import base_tensor, forward_pre_hooks, remove_forward_pre_hooks, tensor_version


class CallGraphCache:
    """A hit needs the same base tensors (held here, so their ids cannot be recycled), view layout, in-place versions
    and node count. Registered as the model's forward pre-hook, emptied at the start of every call. Not thread-safe.
    A pinned graph (``pin``) is matched without the version check and survives the reset until ``unpin``."""

    def __init__(self) -> None:
        self._pinned: tuple[tuple, tuple, kernels.ConvGraph] | None = None
        self.species = None  # SpeciesGroups of the call in progress, while a caller vouches for them
        self.compiling_caller = False  # a caller's compiled call is in progress (``serve_pinned``)
        self.clear()

    @contextmanager
    def use_species(self, groups: object) -> Iterator[None]:
        """Within the block, nodes of one species (``species_linear.SpeciesGroups``) have identical node
        attributes in every call of the model: the caller built the inputs and guarantees it."""
        previous, self.species = self.species, groups
        try:
            yield
        finally:
            self.species = previous

    @contextmanager
    def serve_pinned(self) -> Iterator[None]:
        """Within the block, a call traced by torch.compile gets the pinned graph, unchecked: the caller pinned
        the graph of exactly the edges it passes (``get`` under compilation)."""
        previous, self.compiling_caller = self.compiling_caller, True
        try:
            yield
        finally:
            self.compiling_caller = previous

    def clear(self) -> None:
        """Forget the per-call graph (a pinned graph stays)."""
        self._bases: tuple[torch.Tensor, torch.Tensor] | None = None
        self._key: tuple | None = None
        self._graph: kernels.ConvGraph | None = None

    def pin(self, edge_src: torch.Tensor, edge_dst: torch.Tensor, graph: kernels.ConvGraph) -> None:
        """Serve ``graph`` whenever a layer asks for exactly these edge tensors (same views of the same bases); the
        caller guarantees it describes them, also after every in-place refill (nothing is checked here)."""
        if not isinstance(graph, ConvGraph):
            raise TypeError(f"graph must be a cgforge ConvGraph, got {type(graph).__name__}")
        bases = (base_tensor(edge_src), base_tensor(edge_dst))
        key = (_layout(edge_src), _layout(edge_dst), int(graph.num_nodes))
        self._pinned = (bases, key, graph)

    def unpin(self) -> None:
        self._pinned = None

    @property
    def pinned(self) -> kernels.ConvGraph | None:
        return None if self._pinned is None else self._pinned[2]

    def get(self, edge_src: torch.Tensor, edge_dst: torch.Tensor, num_nodes: int) -> kernels.ConvGraph:
        pinned = self._pinned
        if torch.compiler.is_compiling():
            return self._compiled_get()
        bases = (base_tensor(edge_src), base_tensor(edge_dst))
        if pinned is not None:
            (src, dst), key, graph = pinned
            if src is bases[0] and dst is bases[1] and key == (_layout(edge_src), _layout(edge_dst), int(num_nodes)):
                return graph
        key = (_layout(edge_src), _layout(edge_dst), tensor_version(bases[0]), tensor_version(bases[1]), int(num_nodes))
        cached = self._bases
        if cached is not None and cached[0] is bases[0] and cached[1] is bases[1] and self._key == key:
            return self._graph
        graph = kernels.ConvGraph(edge_src, edge_dst, int(num_nodes))
        self._bases, self._key, self._graph = bases, key, graph
        return graph

    def _compiled_get(self) -> kernels.ConvGraph:
        # dynamo cannot trace the identity, layout and version checks, nor a graph built here (a host read): only
        # the pinned graph is served, inside its owner's ``serve_pinned``, so no other compiled model gets it.
        pinned = self._pinned
        if pinned is None or not self.compiling_caller:
            raise RuntimeError("cgforge: a patched model compiled with torch.compile needs the convolution graph "
                               "pinned by its caller (cgforge's Calculator(compile=True) does); compile the "
                               "Calculator's step rather than the model itself")
        return pinned[2]

    def __call__(self, module: torch.nn.Module, args: object) -> None:  # forward pre-hook
        self.clear()

    def install(self, model: torch.nn.Module) -> None:
        """Be ``model``'s forward pre-hook, in place of any other cache of this class."""
        if not any(hook is self for hook in forward_pre_hooks(model)):
            remove_forward_pre_hooks(model, type(self))
            model.register_forward_pre_hook(self)

    # Pickled (with the model) and deep-copied empty: a graph belongs to one call on one device.
    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()


def graph_caches(model: torch.nn.Module) -> list[CallGraphCache]:
    """The distinct graph caches of a patched model (its layers' ``graphs`` and its forward pre-hooks)."""
    found: dict[int, CallGraphCache] = {}
    for module in model.modules():
        cache = getattr(module, "graphs", None)
        if isinstance(cache, CallGraphCache):
            found.setdefault(id(cache), cache)
        for hook in forward_pre_hooks(module):
            if isinstance(hook, CallGraphCache):
                found.setdefault(id(hook), hook)
    return list(found.values())


def _layout(t: torch.Tensor) -> tuple:
    return t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device
