"""MACE's ``reshape_irreps`` ([N, sum mul * d] in e3nn's mul_ir order -> [N, mul, sum d]) with a lean backward.

The forward is MACE's concatenation; the backward writes each irrep's gradient block once (``IrrepsToColumns``
and ``ColumnsToIrreps``, each the other's backward). Under torch.compile it is MACE's plain ops (``_to_columns``).
"""

from __future__ import annotations

import torch

from .. import stand_in
from ..stand_in import StandIn, checked


def _blocks(x: torch.Tensor, mul: int, dims: list[int]) -> list[torch.Tensor]:
    """Views of x [N, sum mul * d] as [N, mul, d] per irrep."""
    out, start = [], 0
    for d in dims:
        out.append(x.narrow(1, start, mul * d).view(x.shape[0], mul, d))
        start += mul * d
    return out


def _to_columns(x: torch.Tensor, mul: int, dims: list[int]) -> torch.Tensor:
    """MACE's reshape as plain ops: [N, sum mul * d] -> [N, mul, sum d]."""
    return torch.cat(_blocks(x.contiguous(), mul, dims), dim=-1)  # views need unit-stride rows


class IrrepsToColumns(torch.autograd.Function):
    """x [N, sum mul * d] (mul_ir) -> [N, mul, sum d]: the irreps' [N, mul, d] blocks side by side."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mul: int, dims: list[int]) -> torch.Tensor:  # noqa: D102
        ctx.mul, ctx.dims = mul, dims
        return _to_columns(x, mul, dims)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN205, D102
        return ColumnsToIrreps.apply(grad, ctx.mul, ctx.dims), None, None


class ColumnsToIrreps(torch.autograd.Function):
    """The inverse: [N, mul, sum d] -> [N, sum mul * d], each irrep's block written once into a new tensor."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, mul: int, dims: list[int]) -> torch.Tensor:  # noqa: D102
        ctx.mul, ctx.dims = mul, dims
        x = y.new_empty(y.shape[0], mul * sum(dims))
        column = 0
        for block, d in zip(_blocks(x, mul, dims), dims, strict=True):
            block.copy_(y[:, :, column:column + d])
            column += d
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN205, D102
        return IrrepsToColumns.apply(grad, ctx.mul, ctx.dims), None, None


def _is_reshape_irreps(module: torch.nn.Module) -> bool:
    cls = type(module)
    return cls.__name__ == "reshape_irreps" and cls.__module__.startswith("mace.")


class BlockReshape(torch.nn.Module, StandIn):
    """``reshape_irreps`` (mul_ir layout, one multiplicity for every irrep) with a one-write backward."""

    def __init__(self, reshape: torch.nn.Module) -> None:
        super().__init__()
        self.muls, self.dims = [int(m) for m in reshape.muls], [int(d) for d in reshape.dims]
        self.original = (reshape,)

    @classmethod
    def supports(cls, reshape: torch.nn.Module) -> bool:
        config = getattr(reshape, "cueq_config", None)
        return (_is_reshape_irreps(reshape) and len(reshape.muls) > 0 and len(set(reshape.muls)) == 1
                and (config is None or getattr(config, "layout_str", "mul_ir") == "mul_ir"))

    @classmethod
    def wrap(cls, reshape: torch.nn.Module, where: str = "") -> BlockReshape | None:
        return checked(cls(reshape), where) if cls.supports(reshape) else None

    def self_check(self, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.random(generator, 5, self.muls[0] * sum(self.dims))
        return self(x), self.original[0](x)

    def forward(self, tensor: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # Inductor fuses the plain ops' backward itself, and an autograd.Function
            # in the graph keeps AOTAutograd from caching it across processes
            return _to_columns(tensor, self.muls[0], self.dims)
        return IrrepsToColumns.apply(tensor, self.muls[0], self.dims)

    def extra_repr(self) -> str:
        return f"{self.muls[0]} x dims {self.dims}: one-write backward"


def swap_in(model: torch.nn.Module) -> int:
    """Replace every MACE ``reshape_irreps`` of ``model`` that ``BlockReshape`` supports. In place; returns how many."""
    return len(stand_in.swap_in(
        model, lambda where, child: BlockReshape(child) if BlockReshape.supports(child) else None))


def swap_out(model: torch.nn.Module) -> int:
    """Put MACE's ``reshape_irreps`` back. In place; returns how many."""
    return stand_in.swap_out(model, (BlockReshape,))
