"""`ConvGraph`: the edge bookkeeping of a fused convolution, computed once per neighbour list.

Deterministic mode sorts edges by receiver (CSR rows) for the forward and by sender for the
backward (the transpose), so each output row is summed by one warp in a fixed order: no atomics,
bitwise-reproducible. Atomic mode keeps the edge order and adds with atomics.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

_INDEX_DTYPES = (torch.int32, torch.int64)


class GraphTensors(NamedTuple):
    """The graph tensors the convolution ops take, in their argument order: sender/receiver int32 [E]; rowptr int64
    [N+1] over edges sorted by receiver, perm int32 (edge ids in that order; empty when the edges are); rowptr_t /
    perm_t the same sorted by sender (the deterministic backward). Atomic mode: the four CSR tensors are empty."""

    sender: torch.Tensor
    receiver: torch.Tensor
    rowptr: torch.Tensor
    perm: torch.Tensor
    rowptr_t: torch.Tensor
    perm_t: torch.Tensor

    def check(self) -> None:
        """The kernels read these as int32 / int64 arrays: another width would be read as garbage, silently.
        Cheap (no data is touched): guards direct calls of the ops and trusted graphs."""
        for name, t in zip(self._fields, self):
            dtype = torch.int64 if name.startswith("rowptr") else torch.int32
            if t.dtype != dtype or t.dim() != 1 or (t.numel() and not t.is_contiguous()):
                raise TypeError(f"conv op: {name} must be a contiguous 1-D {dtype} tensor (build it with "
                                f"cgforge.kernels.ConvGraph), got {t.dtype} with shape {list(t.shape)}")


def _csr(keys: torch.Tensor, num_nodes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rowptr int64 [N+1], order int32 [E] or empty when `keys` is already sorted)."""
    rowptr = torch.zeros(num_nodes + 1, dtype=torch.int64, device=keys.device)
    if keys.numel():
        rowptr[1:] = torch.cumsum(torch.bincount(keys, minlength=num_nodes), 0)
        if not bool((keys[1:] >= keys[:-1]).all()):
            return rowptr, torch.argsort(keys, stable=True).to(torch.int32)
    return rowptr, keys.new_empty(0, dtype=torch.int32)


class ConvGraph:
    """sender[e] -> receiver[e] edges over `num_nodes` nodes, prepared for the convolution kernels: ``ConvGraph(sender,
    receiver, num_nodes)`` checks its arguments (a device read); ``ConvGraph.trusted(tensors, num_nodes)`` wraps
    tensors a caller built (dtypes and shapes checked)."""

    def __init__(self, sender: torch.Tensor, receiver: torch.Tensor, num_nodes: int, deterministic: bool = True):
        for name, t in (("sender", sender), ("receiver", receiver)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype not in _INDEX_DTYPES or t.dim() != 1:
                raise TypeError(f"{name} must be a 1-D int32 or int64 tensor, got {t.dtype} with shape "
                                f"{list(t.shape)}")
        if sender.shape != receiver.shape:
            raise ValueError(f"sender and receiver must have the same length, got {sender.shape[0]} "
                             f"and {receiver.shape[0]}")
        if sender.device != receiver.device:
            raise ValueError(f"sender is on {sender.device} but receiver on {receiver.device}")
        num_nodes = int(num_nodes)
        if num_nodes < 0 or num_nodes >= 2**31 or sender.shape[0] >= 2**31:
            raise ValueError(f"num_nodes ({num_nodes}) and the edge count ({sender.shape[0]}) must be in [0, 2^31)")
        if sender.numel():
            lo = torch.minimum(sender.min(), receiver.min()).item()
            hi = torch.maximum(sender.max(), receiver.max()).item()
            if lo < 0 or hi >= num_nodes:
                raise ValueError(f"edge indices must be in [0, num_nodes={num_nodes}), found values in "
                                 f"[{lo}, {hi}]")
        sender, receiver = sender.to(torch.int32).contiguous(), receiver.to(torch.int32).contiguous()
        empty_ptr = sender.new_empty(0, dtype=torch.int64)
        empty_idx = sender.new_empty(0, dtype=torch.int32)
        if deterministic:
            rowptr, perm = _csr(receiver.long(), num_nodes)
            rowptr_t, perm_t = _csr(sender.long(), num_nodes)
            # the backward kernel always reads perm_t; an already sorted sender needs the identity
            if not perm_t.numel() and sender.numel():
                perm_t = torch.arange(sender.shape[0], dtype=torch.int32, device=sender.device)
            tensors = GraphTensors(sender, receiver, rowptr, perm, rowptr_t, perm_t)
        else:
            tensors = GraphTensors(sender, receiver, empty_ptr, empty_idx, empty_ptr, empty_idx)
        self._set(tensors, num_nodes, deterministic)

    @classmethod
    def trusted(cls, tensors: GraphTensors | tuple, num_nodes: int, deterministic: bool = True) -> ConvGraph:
        """A graph over tensors built elsewhere (no device reads): dtypes and shapes checked only."""
        tensors = GraphTensors(*tensors)
        tensors.check()
        if deterministic and (tensors.rowptr.shape[0] != num_nodes + 1 or tensors.rowptr_t.shape[0] != num_nodes + 1
                              or tensors.perm_t.shape[0] != tensors.sender.shape[0]):
            raise ValueError(f"trusted ConvGraph: rowptr and rowptr_t need {num_nodes + 1} entries and perm_t one "
                             f"per edge, got {tensors.rowptr.shape[0]}, {tensors.rowptr_t.shape[0]} and "
                             f"{tensors.perm_t.shape[0]}")
        graph = cls.__new__(cls)
        graph._set(tensors, int(num_nodes), deterministic)
        return graph

    def _set(self, tensors: GraphTensors, num_nodes: int, deterministic: bool) -> None:
        self.graph_tensors = tensors
        self.num_nodes = num_nodes
        self.deterministic = bool(deterministic)

    sender = property(lambda self: self.graph_tensors.sender)
    receiver = property(lambda self: self.graph_tensors.receiver)
    rowptr = property(lambda self: self.graph_tensors.rowptr)
    perm = property(lambda self: self.graph_tensors.perm)
    rowptr_t = property(lambda self: self.graph_tensors.rowptr_t)
    perm_t = property(lambda self: self.graph_tensors.perm_t)

    @property
    def num_edges(self) -> int:
        return self.sender.shape[0]

    @property
    def device(self) -> torch.device:
        return self.sender.device

    def tensors(self) -> GraphTensors:
        return self.graph_tensors

    def __repr__(self) -> str:
        mode = "deterministic" if self.deterministic else "atomic"
        return f"ConvGraph(num_nodes={self.num_nodes}, num_edges={self.num_edges}, {mode}, device={self.device})"
