"""MACE's ``reshape_irreps`` ([N, sum mul * d] in e3nn's mul_ir order -> [N, mul, sum d]) as one column gather.

MACE slices its input irrep by irrep, reshapes each slice and concatenates them. Autograd turns each slice
into a zero-filled full-width gradient and adds them up, and each reshape of a strided gradient into a copy:
in MACE-MP-medium's two interaction blocks, on [N, 2048] rows, about 80 KiB per atom of memory traffic a force
call (``benchmarks/copy_traffic.py``). The map only permutes columns, so ``ColumnGather`` makes it one
``index_select`` forward and one backward (the inverse permutation), differentiable to any order.
"""

from __future__ import annotations

import torch

from .. import stand_in
from ..stand_in import StandIn, checked

__all__ = ["ColumnGather", "GatheredReshape", "swap_in", "swap_out"]


class ColumnGather(torch.autograd.Function):
    """``x[..., index]`` for a permutation ``index`` of the last axis; its gradient is the gather by ``inverse``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:  # noqa: D102
        ctx.index, ctx.inverse = index, inverse
        return x.index_select(-1, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN205, D102
        return ColumnGather.apply(grad, ctx.inverse, ctx.index), None, None


def _is_reshape_irreps(module: torch.nn.Module) -> bool:
    cls = type(module)
    return cls.__name__ == "reshape_irreps" and cls.__module__.startswith("mace.")


class GatheredReshape(torch.nn.Module, StandIn):
    """``reshape_irreps`` (mul_ir layout, one multiplicity for every irrep) by one column gather."""

    def __init__(self, reshape: torch.nn.Module) -> None:
        super().__init__()
        self.muls, self.dims = [int(m) for m in reshape.muls], [int(d) for d in reshape.dims]
        mul, total = self.muls[0], sum(self.dims)
        index, start, column = torch.empty(mul * total, dtype=torch.long), 0, 0
        for d in self.dims:  # output [u, column + m] reads input [start + u * d + m]
            for u in range(mul):
                index[u * total + column:u * total + column + d] = torch.arange(start + u * d, start + (u + 1) * d)
            start, column = start + mul * d, column + d
        self.register_buffer("index", index, persistent=False)  # not in the state_dict: MACE's has nothing here
        self.register_buffer("inverse", torch.argsort(index), persistent=False)
        self.original = (reshape,)

    @classmethod
    def supports(cls, reshape: torch.nn.Module) -> bool:
        config = getattr(reshape, "cueq_config", None)
        return (_is_reshape_irreps(reshape) and len(reshape.muls) > 0 and len(set(reshape.muls)) == 1
                and (config is None or getattr(config, "layout_str", "mul_ir") == "mul_ir"))

    @classmethod
    def wrap(cls, reshape: torch.nn.Module, where: str = "") -> GatheredReshape | None:
        return checked(cls(reshape), where) if cls.supports(reshape) else None

    def self_check(self, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.random(generator, 5, self.muls[0] * sum(self.dims))
        return self(x), self.original[0](x)

    def forward(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.index.device != tensor.device:  # MACE's module has no tensor to say where the model lives: once
            self.index, self.inverse = self.index.to(tensor.device), self.inverse.to(tensor.device)
        gathered = ColumnGather.apply(tensor, self.index, self.inverse)
        return gathered.view(tensor.shape[0], self.muls[0], sum(self.dims))

    def extra_repr(self) -> str:
        return f"{self.muls[0]} x dims {self.dims}: one column gather"


def swap_in(model: torch.nn.Module) -> int:
    """Replace every MACE ``reshape_irreps`` of ``model`` that ``GatheredReshape`` supports. In place; returns
    how many."""
    return len(stand_in.swap_in(
        model, lambda where, child: GatheredReshape(child) if GatheredReshape.supports(child) else None))


def swap_out(model: torch.nn.Module) -> int:
    """Put MACE's ``reshape_irreps`` back. In place; returns how many."""
    return stand_in.swap_out(model, (GatheredReshape,))
