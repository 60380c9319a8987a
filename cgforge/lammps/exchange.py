"""Node features sent between message-passing layers: LAMMPS's ``forward_exchange`` / ``reverse_exchange``.

In exchange mode LAMMPS gives each domain one cutoff of ghost atoms and pairs centred on its own (local)
atoms only. A layer's messages are then right for local atoms and wrong (missing neighbours) for ghosts, so
before every layer but the first the ghosts' node features are replaced by their owners' (on this or another
MPI rank):

    feats = [feats[:nlocal], zeros for the ghosts]      # only the local rows are meaningful
    data.forward_exchange(feats, out, width)            # out[:nlocal] = feats[:nlocal], out[ghost] = owner's
    backward: data.reverse_exchange(grad, gout, width)  # gout[local] = grad[local] + grads of its ghost copies

(the contract of the Kokkos ML-IAP data object of LAMMPS 22 Jul 2025 and later, which MACE's and nequip's
LAMMPS classes use in the same way; only ``gout[:nlocal]`` is read here). The first layer needs no exchange:
its input is the species embedding, known for ghosts too.

On the host (a Kokkos host build: arrays and features in host memory) LAMMPS sends the features through its
classic communication, whose buffers are sized at each run's setup for the widest per-atom message then
known: size_border (at least 6: x, tag, type, mask) forward, size_reverse (3: f) in reverse. PairMLIAPKokkos
sets its message width to ``vec_len`` only inside the exchange, and ``CommBrick::forward_comm(Pair *)`` /
``reverse_comm(Pair *)`` do not grow the buffers: a wider exchange writes past them (heap corruption, seen as
``corrupted size vs. prev_size`` after a right energy). So host exchanges go in column blocks of at most
``HOST_FORWARD_WIDTH`` / ``HOST_REVERSE_WIDTH``; Kokkos's device communication grows its own buffers, so device
features go whole.

One domain (one MPI rank) needs no exchange inside the model: every ghost is a periodic image of one of its own
local atoms. ``ghost_owners`` finds each ghost's owner with one forward exchange of the local atoms' indices
(tagged by a random number of this call, so ghosts owned by another rank are told apart); where every ghost has
a local owner, the caller rewires each pair's ghost neighbour to its owner and runs the model on the local atoms
alone, a periodic graph like the calculator's, which needs no call back into LAMMPS and so can be captured.

The hooks are forward pre-hooks on the model's message-passing layers (MACE: ``model.interactions[1:]``,
whose ``node_feats`` keyword is replaced; NequIP: the ``ConvNetLayer`` modules after the first, whose data
dict's ``node_features`` is replaced). They are registered once, in the LAMMPS process (never pickled), and
act only while ``ExchangeHooks.active`` holds a data object.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

__all__ = ["HOST_FORWARD_WIDTH", "HOST_REVERSE_WIDTH", "ExchangeHooks", "exchange_features", "ghost_owners",
           "message_layers"]

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


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, feats: Tensor, data: Any) -> Tensor:  # noqa: D102
        out = _send(data.forward_exchange, feats.reshape(feats.shape[0], -1).contiguous(), HOST_FORWARD_WIDTH)
        ctx.data = data
        ctx.shape = feats.shape
        return out.view(feats.shape)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # noqa: D102
        gout = _send(ctx.data.reverse_exchange, grad.reshape(grad.shape[0], -1).contiguous(),
                     HOST_REVERSE_WIDTH)
        return gout.view(ctx.shape), None


def exchange_features(feats: Tensor, data: Any, nlocal: int) -> Tensor:
    """``feats`` [ntotal, ...] with the ghost rows replaced by their owners' rows (differentiable)."""
    ghosts = feats.shape[0] - nlocal
    if ghosts < 0:
        raise ValueError(f"exchange: node features have {feats.shape[0]} rows, fewer than nlocal={nlocal}")
    padded = torch.cat([feats[:nlocal], feats.new_zeros((ghosts, *feats.shape[1:]))])
    return _Exchange.apply(padded, data)


def ghost_owners(data: Any, nlocal: int, ntotal: int, device: torch.device) -> Tensor | None:
    """The owner of every atom of this domain ([ntotal] int64 on ``device``: ``i`` for a local atom, the local atom a
    ghost is an image of) when every ghost has a local owner (one MPI rank), else None (some ghost belongs to
    another rank).

    One forward exchange of three float64 columns: two random 52-bit tags of this call and the atom index (all
    exact in float64); a ghost whose tags came back as this call's is an image of the local atom whose index came
    with them. Another rank's tags match with probability 2**-104."""
    if ntotal == nlocal:
        return torch.arange(ntotal, device=device)
    tags = [float(secrets.randbits(52)) for _ in range(2)]
    cols = torch.zeros(ntotal, 3, dtype=torch.float64, device=device)
    cols[:nlocal, 0], cols[:nlocal, 1] = tags
    cols[:nlocal, 2] = torch.arange(nlocal, dtype=torch.float64, device=device)
    got = _send(data.forward_exchange, cols, HOST_FORWARD_WIDTH)
    if got.is_cuda:
        torch.cuda.synchronize(got.device)  # LAMMPS wrote it on its own stream
    owner = got[:, 2].to(torch.int64)
    ours = (got[:, 0] == tags[0]) & (got[:, 1] == tags[1]) & (owner >= 0) & (owner < nlocal)
    if not bool(ours.all()):
        return None
    return owner


def message_layers(model: torch.nn.Module, kind: str) -> list[torch.nn.Module]:
    """The model's message-passing layers in call order: MACE's interaction blocks, NequIP's ConvNetLayers."""
    if kind == "mace":
        return list(model.interactions)
    if kind == "nequip":
        from cgforge.patches.nequip.adapter import energy_model_of

        return [m for m in energy_model_of(model).modules() if type(m).__name__ == "ConvNetLayer"]
    raise ValueError(f"kind: expected 'mace' or 'nequip', got {kind!r}")


class ExchangeHooks:
    """Forward pre-hooks on layers 2..L of a model that exchange the ghosts' input features while active."""

    def __init__(self, model: torch.nn.Module, kind: str) -> None:
        self.kind = kind
        self.layers = message_layers(model, kind)
        self._data: Any = None
        self._nlocal = 0
        self.calls = 0  # exchanges done (a test checks that they happen)
        self._handles = []
        for layer in self.layers[1:]:
            if kind == "mace":
                self._handles.append(layer.register_forward_pre_hook(self._mace_hook, with_kwargs=True))
            else:
                self._handles.append(layer.register_forward_pre_hook(self._nequip_hook))

    @contextmanager
    def active(self, data: Any, nlocal: int) -> Iterator[None]:
        """Within the block, the hooked layers exchange ghost features through ``data``."""
        self._data, self._nlocal = data, int(nlocal)
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
        self.calls += 1
        kwargs = dict(kwargs, node_feats=exchange_features(kwargs["node_feats"], self._data, self._nlocal))
        return args, kwargs

    def _nequip_hook(self, module: torch.nn.Module, args: tuple) -> None:
        if self._data is None:
            return None
        data = args[0]
        self.calls += 1
        data[_NEQUIP_FEATURES] = exchange_features(data[_NEQUIP_FEATURES], self._data, self._nlocal)
        return None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
