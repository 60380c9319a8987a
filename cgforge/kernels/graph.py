"""`ConvGraph`: the edge bookkeeping of a fused convolution, computed once per neighbour list.

Deterministic mode sorts edges by receiver (CSR rows) for the forward and by sender for the
backward (the transpose), so each output row is summed by one warp in a fixed order: no atomics,
bitwise-reproducible. Atomic mode keeps the edge order and adds with atomics.
"""

from __future__ import annotations

import torch

_INDEX_DTYPES = (torch.int32, torch.int64)


def _csr(keys: torch.Tensor, num_nodes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rowptr int64 [N+1], order int32 [E] or empty when `keys` is already sorted)."""
    rowptr = torch.zeros(num_nodes + 1, dtype=torch.int64, device=keys.device)
    if keys.numel():
        rowptr[1:] = torch.cumsum(torch.bincount(keys, minlength=num_nodes), 0)
        if bool((keys[1:] >= keys[:-1]).all()):
            return rowptr, keys.new_empty(0, dtype=torch.int32)
        order = torch.argsort(keys, stable=True).to(torch.int32)
        return rowptr, order
    return rowptr, keys.new_empty(0, dtype=torch.int32)


class ConvGraph:
    """sender[e] -> receiver[e] edges over `num_nodes` nodes, prepared for the convolution kernels."""

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
            raise ValueError(f"num_nodes ({num_nodes}) and the edge count ({sender.shape[0]}) must be in "
                             "[0, 2^31)")
        if sender.numel():
            lo = torch.minimum(sender.min(), receiver.min()).item()
            hi = torch.maximum(sender.max(), receiver.max()).item()
            if lo < 0 or hi >= num_nodes:
                raise ValueError(f"edge indices must be in [0, num_nodes={num_nodes}), found values in "
                                 f"[{lo}, {hi}]")
        self.num_nodes = num_nodes
        self.deterministic = bool(deterministic)
        self.sender = sender.to(torch.int32).contiguous()
        self.receiver = receiver.to(torch.int32).contiguous()
        empty_ptr = sender.new_empty(0, dtype=torch.int64)
        empty_idx = sender.new_empty(0, dtype=torch.int32)
        if self.deterministic:
            self.rowptr, self.perm = _csr(receiver.long(), num_nodes)
            self.rowptr_t, perm_t = _csr(sender.long(), num_nodes)
            # the backward kernel always reads perm_t; an already sorted sender needs the identity
            self.perm_t = perm_t if perm_t.numel() or not sender.numel() else torch.arange(
                sender.shape[0], dtype=torch.int32, device=sender.device)
        else:
            self.rowptr, self.perm, self.rowptr_t, self.perm_t = empty_ptr, empty_idx, empty_ptr, empty_idx

    @property
    def num_edges(self) -> int:
        return self.sender.shape[0]

    @property
    def device(self) -> torch.device:
        return self.sender.device

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.sender, self.receiver, self.rowptr, self.perm, self.rowptr_t, self.perm_t

    def __repr__(self) -> str:
        mode = "deterministic" if self.deterministic else "atomic"
        return f"ConvGraph(num_nodes={self.num_nodes}, num_edges={self.num_edges}, {mode}, device={self.device})"
