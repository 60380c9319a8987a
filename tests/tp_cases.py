"""Shared helpers for tensor-product tests: e3nn references and relative errors."""

from __future__ import annotations

import torch
from e3nn import o3

from cgforge.kernels.problem_set import PROBLEMS, channelwise, fully_connected  # noqa: F401  (re-exported)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm of the difference over norm of the reference (0 when both are zero)."""
    den = b.norm().item()
    num = (a - b).norm().item()
    return num / den if den > 0 else num


def e3nn_tp(args: tuple, shared: bool = False, dtype=torch.float64, device="cpu") -> o3.TensorProduct:
    """e3nn's module, built under a float64 default so its CG buffers are exact before any cast."""
    i1, i2, io, ins = args
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        tp = o3.TensorProduct(i1, i2, io, ins, shared_weights=shared, internal_weights=False)
    finally:
        torch.set_default_dtype(previous)
    return tp.to(dtype=dtype, device=device)


def random_inputs(tp: o3.TensorProduct, batch: int, dtype=torch.float64, device="cpu", seed: int = 0):
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype).to(device).requires_grad_(True)

    x, y = r(batch, tp.irreps_in1.dim), r(batch, tp.irreps_in2.dim)
    w = r(tp.weight_numel) if tp.shared_weights else r(batch, tp.weight_numel)
    return x, y, w


def single_path(l1: int, l2: int, l3: int, mul1: int, mul2: int, mode: str, mul_out: int | None = None) -> tuple:
    p = (-1) ** (l1 + l2)
    i1 = o3.Irreps([(mul1, (l1, (-1) ** l1))])
    i2 = o3.Irreps([(mul2, (l2, 1))])
    io = o3.Irreps([(mul1 if mode == "uvu" else (mul_out or mul1), (l3, p * 1 if l2 % 2 == 0 else p))])
    # parity of out = p1 * p2 with p1 = (-1)^l1, p2 = +1
    io = o3.Irreps([(io[0].mul, (l3, (-1) ** l1))])
    return i1, i2, io, [(0, 0, 0, mode, True)]
