"""Node features sent between message-passing layers: LAMMPS's ``forward_exchange`` / ``reverse_exchange``.

In exchange mode, before every layer but the first, the ghosts' node features are replaced by their owners'
(forward pre-hooks on ``adapter.message_layers()[1:]``, active only inside ``ExchangeHooks.active``; never pickled):

    data.forward_exchange(feats, out, width)            # out[ghost] = its owner's row; only local rows are read
    backward: data.reverse_exchange(grad, gout, width)  # gout[local] = grad[local] + grads of its ghost copies

Host exchanges go in column blocks of ``HOST_FORWARD_WIDTH`` / ``HOST_REVERSE_WIDTH`` (LAMMPS's buffers are not
grown inside an exchange), device ones whole; float32 features go forward two to a float64 word. ``ghost_map``
finds each ghost's owner on one rank; ``GhostMap.every_ghost`` keeps every ghost a node (docs/lammps.md).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .timers import OFF

__all__ = ["HOST_FORWARD_WIDTH", "HOST_REVERSE_WIDTH", "ExchangeHooks", "GhostMap", "ghost_map"]

_NEQUIP_FEATURES = "node_features"  # nequip's AtomicDataDict.NODE_FEATURES_KEY
HOST_FORWARD_WIDTH = 6  # LAMMPS's size_border, the least its host forward buffers hold per atom
HOST_REVERSE_WIDTH = 3  # size_reverse (forces), the least its host reverse buffers hold per atom


def _send(call: Any, flat: Tensor, host_width: int) -> Tensor:
    """``call(src, dst, width)`` (LAMMPS's forward or reverse exchange) over ``flat`` [ntotal, width]: whole on
    a device, in column blocks of at most ``host_width`` on the host (see the module doc)."""
    out = torch.empty_like(flat)
    block = flat.shape[1] if flat.is_cuda else host_width
    if flat.shape[1] <= block:
        call(flat, out, flat.shape[1])
        return out
    for start in range(0, flat.shape[1], block):
        part = flat[:, start:start + block].contiguous()
        got = torch.empty_like(part)
        call(part, got, part.shape[1])
        out[:, start:start + block] = got
    return out


def _send_forward(data: Any, flat: Tensor) -> Tensor:
    """LAMMPS's forward exchange of ``flat`` [ntotal, width], float32 packed two to a float64 word (the reverse
    exchange adds its values up and cannot be packed so)."""
    if flat.dtype != torch.float32:
        return _send(data.forward_exchange, flat, HOST_FORWARD_WIDTH)
    width = flat.shape[1]
    if width % 2:
        flat = torch.cat([flat, flat.new_zeros(flat.shape[0], 1)], dim=1)
    out = _send(data.forward_exchange, flat.contiguous().view(torch.float64), HOST_FORWARD_WIDTH)
    return out.view(torch.float32)[:, :width]


class _Exchange(torch.autograd.Function):
    """Node features [nodes, ...] (local atoms, then the ghosts of other ranks, then padding) in, the same with the
    other ranks' ghosts' rows from their owners out; the backward sends their gradients back to the owners."""

    @staticmethod
    def forward(ctx: Any, feats: Tensor, data: Any, ghosts: GhostMap, timers: Any) -> Tensor:  # noqa: D102
        flat = feats.reshape(feats.shape[0], -1)
        full = flat.new_zeros(ghosts.ntotal, flat.shape[1])  # LAMMPS's rows: only the local ones are read
        full[:ghosts.nlocal] = flat[:ghosts.nlocal]
        with timers.phase("exchange forward"):
            got = _send_forward(data, full)
        out = torch.zeros_like(flat)
        out[:ghosts.nlocal] = flat[:ghosts.nlocal]
        out[ghosts.nlocal:ghosts.nodes] = got[ghosts.nlocal:] if ghosts.identity else got.index_select(0, ghosts.remote)
        ctx.data, ctx.ghosts, ctx.shape, ctx.timers = data, ghosts, feats.shape, timers
        return out.view(feats.shape)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:  # noqa: D102
        g = ctx.ghosts
        flat = grad.reshape(grad.shape[0], -1)
        full = flat.new_zeros(g.ntotal, flat.shape[1])
        full[:g.nlocal] = flat[:g.nlocal]
        if g.identity:
            full[g.nlocal:] = flat[g.nlocal:g.nodes]
        else:
            full.index_copy_(0, g.remote, flat[g.nlocal:g.nodes].contiguous())
        with ctx.timers.phase("exchange reverse"):
            got = _send(ctx.data.reverse_exchange, full, HOST_REVERSE_WIDTH)  # owners: their own + their ghosts'
        out = torch.zeros_like(flat)
        out[:g.nlocal] = got[:g.nlocal]
        return out.view(ctx.shape), None, None, None


@dataclass(frozen=True)
class GhostMap:
    """Where a domain's ``ntotal`` atoms (``nlocal`` local ones, then ghosts) are among the model's nodes
    (``node_of`` [ntotal]): a ghost that is an image of a local atom is that atom, each ghost of another rank (the
    rows ``remote``) a node of its own after the local atoms; ``identity``: every atom is its own node."""

    nlocal: int
    ntotal: int
    node_of: Tensor
    remote: Tensor
    identity: bool = False

    @property
    def nodes(self) -> int:
        """Local atoms plus the ghosts of other ranks."""
        return self.nlocal + int(self.remote.shape[0])

    @classmethod
    def every_ghost(cls, nlocal: int, ntotal: int, device: torch.device) -> GhostMap:
        """Every atom a node of its own, every ghost exchanged (no owner exchange made)."""
        return cls(nlocal, ntotal, torch.arange(ntotal, device=device), torch.arange(nlocal, ntotal, device=device),
                   identity=True)

    @property
    def one_domain(self) -> bool:
        """Every ghost is an image of a local atom: no exchange is needed inside the model."""
        return int(self.remote.shape[0]) == 0


def ghost_map(data: Any, nlocal: int, ntotal: int, device: torch.device) -> GhostMap:
    """The ``GhostMap`` of this call's atoms from one (collective) forward exchange of two random 52-bit tags and the
    atom index: a ghost whose tags came back as this call's is an image of the local atom whose index came with them."""
    tags = [float(secrets.randbits(52)) for _ in range(2)]
    cols = torch.zeros(ntotal, 3, dtype=torch.float64, device=device)
    cols[:nlocal, 0], cols[:nlocal, 1] = tags
    cols[:nlocal, 2] = torch.arange(nlocal, dtype=torch.float64, device=device)
    got = _send(data.forward_exchange, cols, HOST_FORWARD_WIDTH)
    if got.is_cuda:
        torch.cuda.synchronize(got.device)  # LAMMPS wrote it on its own stream
    owner = got[:, 2].to(torch.int64)
    ours = (got[:, 0] == tags[0]) & (got[:, 1] == tags[1]) & (owner >= 0) & (owner < nlocal)
    remote = (~ours).nonzero().flatten()  # one host read
    node_of = torch.where(ours, owner, 0)
    node_of[remote] = nlocal + torch.arange(remote.shape[0], device=device)
    return GhostMap(nlocal, ntotal, node_of, remote)


class ExchangeHooks:
    """Forward pre-hooks on layers 2..L of an adapter's model that exchange the ghosts' input features while active."""

    def __init__(self, adapter: Any) -> None:
        self._data = self._ghosts = None  # LAMMPS's data object and the GhostMap while active
        self.calls = 0  # exchanges done (a test checks that they happen)
        self.timers: Any = OFF  # times each exchange (``timers.PhaseTimers``)
        mace = adapter.kind == "mace"
        self._handles = [layer.register_forward_pre_hook(self._mace_hook, with_kwargs=True) if mace else
                         layer.register_forward_pre_hook(self._nequip_hook) for layer in adapter.message_layers()[1:]]

    @contextmanager
    def active(self, data: Any, ghosts: GhostMap) -> Iterator[None]:
        """Within the block, the hooked layers exchange the other ranks' ghosts' features through ``data``."""
        self._data, self._ghosts = data, ghosts
        try:
            yield
        finally:
            self._data = None

    def _mace_hook(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if self._data is None:
            return None
        if "node_feats" not in kwargs:
            raise RuntimeError(f"exchange: {type(module).__name__} was called without a node_feats keyword; this "
                               "MACE version calls its interaction blocks differently from mace-torch 0.3.16")
        return args, dict(kwargs, node_feats=self._exchange(kwargs["node_feats"]))

    def _nequip_hook(self, module: torch.nn.Module, args: tuple) -> None:
        if self._data is not None:
            args[0][_NEQUIP_FEATURES] = self._exchange(args[0][_NEQUIP_FEATURES])

    def _exchange(self, feats: Tensor) -> Tensor:
        """``feats`` [nodes or more, ...] with the other ranks' ghosts' rows from their owners (differentiable)."""
        if feats.shape[0] < self._ghosts.nodes:
            raise ValueError(f"exchange: node features have {feats.shape[0]} rows, fewer than the {self._ghosts.nodes} "
                             "nodes")
        self.calls += 1
        return _Exchange.apply(feats, self._data, self._ghosts, self.timers)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
