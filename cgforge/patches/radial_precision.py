"""Optional TF32 tensor-core products in the radial MLPs (FP32 unless asked for).

Two modes (their accuracy: docs/calculator.md): ``"tf32"``, both products on TF32 tensor cores; ``"3xtf32"``, the
forward product as a_hi b_hi + a_hi b_lo + a_lo b_hi in one TF32 GEMM (FP32-level accuracy), only for compute-bound
products (K >= 32, N >= 2K). The calculator measures the forces' change before keeping a mode;
``set_radial_precision`` sets every radial MLP layer of a patched model.
"""

from __future__ import annotations

import torch

from . import stand_in
from .stand_in import StandIn
from .torch_internals import adopt

MODES = ("fp32", "tf32", "3xtf32")


def _tf32_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with cuBLAS allowed to use TF32 (CPU tensors: plain FP32; tests replace this to emulate TF32)."""
    matmul = torch.backends.cuda.matmul
    previous, matmul.allow_tf32 = matmul.allow_tf32, True
    try:
        return a @ b
    finally:
        matmul.allow_tf32 = previous


def tf32_round(t: torch.Tensor) -> torch.Tensor:
    """FP32 values rounded to the nearest TF32 value (10-bit mantissa; ties away from zero): the 13 low
    mantissa bits cleared after adding half of their range."""
    bits = t.contiguous().view(torch.int32)
    return torch.bitwise_and(bits + 0x1000, -0x2000).view(torch.float32)


def _split3_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b to about FP32 accuracy from one TF32 GEMM: [a_hi, a_hi, a_lo] @ [b_hi; b_lo; b_hi]."""
    a_hi, b_hi = tf32_round(a), tf32_round(b)
    return _tf32_mm(torch.cat([a_hi, a_hi, a - a_hi], dim=1), torch.cat([b_hi, b - b_hi, b_hi], dim=0))


class _TF32MatMul(torch.autograd.Function):
    """x @ w with TF32 allowed in the forward product and, for ``"tf32"``, in the backward's too."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, mode: str) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.mode = mode
        return _split3_mm(x, w) if mode == "3xtf32" else _tf32_mm(x, w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, w = ctx.saved_tensors
        mode = ctx.mode if ctx.mode == "tf32" else "fp32"
        gx = radial_matmul(grad, w.t(), mode) if ctx.needs_input_grad[0] else None
        gw = radial_matmul(x.t(), grad, mode) if ctx.needs_input_grad[1] else None
        return gx, gw, None


def _compute_bound(w: torch.Tensor) -> bool:
    """Whether an [E, K] x [K, N] product is worth 3xTF32: FP32 FLOPs, not the output's bytes, bound it."""
    k, n = w.shape
    return k >= 32 and n >= 2 * k


def radial_matmul(x: torch.Tensor, w: torch.Tensor, mode: str = "fp32") -> torch.Tensor:
    """x @ w in one of ``MODES`` (differentiable to any order; FP32 tensors for the TF32 modes)."""
    if mode == "fp32" or x.dtype != torch.float32 or (mode == "3xtf32" and not _compute_bound(w)):
        return x @ w
    return _TF32MatMul.apply(x, w, mode)


class RadialLinear(torch.nn.Module, StandIn):
    """nequip's ``ScalarLinearLayer`` (``input @ (weight * alpha) [+ bias]``) with a ``precision`` mode.

    Holds the original's parameters under the same names (same state_dict); the original rides along."""

    precision = "fp32"

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        adopt(self, layer)  # a bias of None too, as nequip registers it; alpha is a buffer in nequip
        if not hasattr(self, "bias"):
            self.register_parameter("bias", None)
        if not hasattr(self, "alpha"):
            self.alpha = float(layer.alpha)
        self.original = (layer,)

    @classmethod
    def supports(cls, layer: torch.nn.Module) -> bool:
        return (type(layer).__name__ == "ScalarLinearLayer" and hasattr(layer, "alpha")
                and isinstance(getattr(layer, "weight", None), torch.nn.Parameter)
                and not hasattr(layer, "parametrizations") and not list(layer.children()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = radial_matmul(x, self.weight * self.alpha, self.precision)
        return out if self.bias is None else out + self.bias

    def self_check(self, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.random(generator, 7, self.weight.shape[0])
        return self(x), self.original[0](x)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, alpha={float(self.alpha):.6f}, precision={self.precision}"


def swap_in(model: torch.nn.Module, mlp_attribute: str = "edge_mlp") -> int:
    """Replace the linear layers of every ``mlp_attribute`` MLP (nequip's radial MLPs) by ``RadialLinear``,
    each checked against its original (``stand_in.checked``). In place; returns how many."""

    def make(where: str, child: torch.nn.Module) -> StandIn | None:
        inside = f".{mlp_attribute}." in f".{where}"  # a layer of (a submodule of) an ``mlp_attribute`` MLP
        return RadialLinear(child) if inside and RadialLinear.supports(child) else None

    return len(stand_in.swap_in(model, make))


def swap_out(model: torch.nn.Module) -> int:
    """Put nequip's own linear layers back. In place; returns how many."""
    return stand_in.swap_out(model, (RadialLinear,))


def radial_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The radial MLP layers of a patched model (those with a ``precision`` mode)."""
    return [m for m in model.modules() if getattr(m, "precision", None) in MODES]


def set_radial_precision(model: torch.nn.Module, mode: str) -> int:
    """Set the mode of every radial MLP layer of a patched model; returns how many layers."""
    if mode not in MODES:
        raise ValueError(f"radial precision: expected one of {', '.join(MODES)}, got {mode!r}")
    layers = radial_layers(model)
    for layer in layers:
        layer.precision = mode
    return len(layers)
