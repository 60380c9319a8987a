"""The table convolution's generated kernels run on the CPU as C++ (``host_cuda``: a warp's lanes as threads):
forward, the sender-order backward, the receiver-order backward without grad x and the one with grad x added by
atomics, each against the CPU path of the same op (torch, FP64), on a random graph. What the CUDA tests check on
a GPU, checked here on the source itself."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
import torch
from host_cuda import build, call
from tp_cases import PROBLEMS, e3nn_tp

from cgforge.kernels import ConvGraph, Convolution, TPTuning
from cgforge.kernels.tensor_product import plan as plans
from cgforge.kernels.tensor_product.layout import (
    CONV_BACKWARD,
    CONV_BACKWARD_NO_GX,
    CONV_BACKWARD_RECEIVERS,
    CONV_FORWARD,
    Layout,
)

R_MAX = 5.0
INTERVALS = 32

_FORWARD = """
extern "C" void run(const S* x, const S* y, S* out, const long long* rowptr, const int* perm, const int* xidx,
                    const S* table, const S* r, int n, S tscale, S r_max, long long rows) {
    run_warps(WARPS, [&] { NAME(x, y, nullptr, out, rowptr, perm, xidx, nullptr, table, r, n, tscale, r_max, rows); });
}
"""
_BACKWARD = """
extern "C" void run(const S* x, const S* y, const S* g, S* gx, S* gy, const long long* rowptr, const int* perm,
                    const int* xidx, const int* gidx, const S* table, const S* r, S* grad_r, int n, S tscale,
                    S r_max, long long rows, int group_pass) {
    run_warps(WARPS, [&] { NAME(x, y, nullptr, g, gx, gy, nullptr, rowptr, perm, xidx, gidx, table, r, grad_r, n,
                                tscale, r_max, rows, group_pass); });
}
"""


def _kernel(plan, dtype: torch.dtype, layout: Layout, backward: bool, folder: Path):
    source, name = plan.source(dtype, layout.with_table(), backward)
    scalar = "float" if dtype == torch.float32 else "double"
    warps = plan.schedule(dtype, True).launch(backward).warps_per_block
    driver = (_BACKWARD if backward else _FORWARD).replace("NAME", name).replace("WARPS", str(warps))
    return build(source, f"typedef {scalar} S;\n" + driver, folder, name).run


def _case(problem: str, tuning: TPTuning | None, seed: int = 0, n: int = 7, e: int = 40):
    gen = torch.Generator().manual_seed(seed)
    conv = Convolution.from_e3nn(e3nn_tp(PROBLEMS[problem]), tuning=tuning)
    sender, receiver = torch.randint(0, n, (e,), generator=gen), torch.randint(0, n, (e,), generator=gen)
    receiver[0] = sender[0]  # a self-loop
    x = torch.randn(n, conv.irreps_in1.dim, generator=gen, dtype=torch.float64, requires_grad=True)
    y = torch.randn(e, conv.irreps_in2.dim, generator=gen, dtype=torch.float64, requires_grad=True)
    r = (torch.rand(e, generator=gen, dtype=torch.float64) * (R_MAX + 1.0) - 0.5).requires_grad_()
    coeffs = torch.randn(INTERVALS, conv.weight_numel, 4, generator=gen, dtype=torch.float64)
    return conv, ConvGraph(sender, receiver, n), x, y, r, coeffs


@pytest.mark.slow  # 9-12 s a case on 2 cores; the fast tier runs other kernels' sources as C++
@pytest.mark.parametrize("problem", ["nequip-water", "mace-medium", "diffdock-L2"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_generated_kernels_run_as_cpp_equal_the_cpu_path(problem: str, dtype: torch.dtype, tmp_path: Path) -> None:
    """nequip-water and mace-medium take the segments order in FP64 and the chunks order in FP32 (the backward's
    grad-out block staged once per row, or per edge); diffdock-L2 has uvw paths."""
    tuning = TPTuning(receiver_backward_atomic=True)
    conv, graph, x, y, r, coeffs = _case(problem, tuning, seed=3)
    out = conv.forward_table(x, y, r, coeffs, R_MAX, graph)
    g = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    want_gx, want_gy, want_gr = torch.autograd.grad(out, (x, y, r), g)
    plan = plans.get(conv.key)
    t = graph.tensors()
    np_dtype = np.float32 if dtype == torch.float32 else np.float64
    real = ctypes.c_float if dtype == torch.float32 else ctypes.c_double
    xs, ys, gs, rs, cs = (v.detach().numpy().astype(np_dtype) for v in (x, y, g, r, coeffs))
    ints = {k: getattr(t, k).numpy() for k in ("sender", "receiver", "rowptr", "perm", "rowptr_t", "perm_t")}
    n = x.shape[0]
    table = [cs, rs]
    scalars = [ctypes.c_int(INTERVALS), real(INTERVALS / R_MAX), real(R_MAX)]
    tol = 1e-11 if dtype == torch.float64 else 2e-4

    def close(got: np.ndarray, want: torch.Tensor) -> None:
        want = want.detach().numpy()
        assert np.abs(got - want).max() <= tol * max(np.abs(want).max(), 1.0) and np.abs(want).max() > 0

    got = np.zeros(out.shape, np_dtype)
    call(_kernel(plan, dtype, CONV_FORWARD, False, tmp_path),
         [xs, ys, got, ints["rowptr"], ints["perm"], ints["sender"], *table, *scalars, n])
    close(got, out)
    for layout, rows, xidx, gidx in ((CONV_BACKWARD, "rowptr_t", None, "receiver"),
                                     (CONV_BACKWARD_NO_GX, "rowptr", "sender", None),
                                     (CONV_BACKWARD_RECEIVERS, "rowptr", "sender", None)):
        gx, gy, gr = np.zeros_like(xs), np.zeros_like(ys), np.zeros_like(rs)
        perm = ints["perm_t" if rows == "rowptr_t" else "perm"]
        call(_kernel(plan, dtype, layout, True, tmp_path),
             [xs, ys, gs, gx if layout.grad_x else None, gy, ints[rows], perm, ints.get(xidx), ints.get(gidx),
              cs, rs, gr, *scalars, n, ctypes.c_int(-1)])
        close(gy, want_gy)
        close(gr, want_gr)
        if layout.grad_x:
            close(gx, want_gx)
