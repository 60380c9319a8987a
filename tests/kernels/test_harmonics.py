"""The spherical-harmonics kernel against e3nn's SphericalHarmonics in FP64: the polynomials read off the module, the
torch reference (values and two derivatives), and the generated CUDA source, run on the CPU as C++ (g++) and
compiled by NVRTC; on a GPU the kernel itself."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from e3nn import o3
from oracles import replayed

from cgforge.kernels.harmonics import (
    HarmonicsPolynomials,
    harmonics,
    harmonics_eval,
    harmonics_reference,
    harmonics_source,
    harmonics_vjp,
    register,
)

CASES = [("0e+1o", "component"), (str(o3.Irreps.spherical_harmonics(2)), "component"),
         (str(o3.Irreps.spherical_harmonics(3)), "norm"), ("1x0e+1x2e", "integral"), ("2e+3o", "component"),
         (str(o3.Irreps.spherical_harmonics(4)), "component")]


def _module(irreps: str, normalization: str) -> torch.nn.Module:
    return o3.SphericalHarmonics(irreps, normalize=True, normalization=normalization)


def _vectors(n: int, seed: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Random directions at lengths 1e-3 .. 1e2, a zero vector first (normalize's clamp)."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(n, 3, dtype=torch.float64, generator=g) * torch.logspace(-3, 2, n, dtype=torch.float64)[:, None]
    v[0] = 0.0
    return v.to(dtype)


def _derivatives(fn, v: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:  # noqa: ANN001
    """At ``v``: the gradient of sum(fn(v) * w) without and with create_graph (the first is the op's own backward,
    the second goes through the graph a second derivative needs), and the gradient of the squared second."""
    x = v.clone().requires_grad_()
    (first,) = torch.autograd.grad((fn(x) * w).sum(), x)
    (g,) = torch.autograd.grad((fn(x) * w).sum(), x, create_graph=True)
    (gg,) = torch.autograd.grad(g.square().sum(), x)
    return first, g.detach(), gg


def _assert_same_derivatives(ours: tuple, theirs: tuple, tol: float) -> None:
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * float(b.abs().max()))


@pytest.mark.parametrize("irreps,normalization", CASES)
def test_reference_equals_e3nn_with_two_derivatives(irreps: str, normalization: str) -> None:
    module = _module(irreps, normalization)
    polys = HarmonicsPolynomials.of(module)
    v = _vectors(300, seed=2)
    torch.testing.assert_close(harmonics(v, polys), module(v), rtol=1e-12, atol=1e-12)
    w = torch.randn(299, polys.dim, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    _assert_same_derivatives(_derivatives(lambda x: harmonics_reference(x, polys), v[1:], w),
                             _derivatives(module, v[1:], w), 1e-10)


def test_the_custom_ops_pass_torchs_checks_and_differentiate_twice_on_the_cpu() -> None:
    """The ops the CUDA path calls (``harmonics_eval``, ``harmonics_vjp``; the reference inside them off CUDA):
    torch.library's checks (schema, fake tensors, autograd registration; the forward's also under compile's
    tracing), the vjp's formula (the kernel's, in torch) and two derivatives through the ops equal e3nn's, so their
    autograd formulas are the ones a GPU run uses."""
    module = _module(str(o3.Irreps.spherical_harmonics(3)), "component")
    polys = HarmonicsPolynomials.of(module)
    key = register(polys)
    v = _vectors(64, seed=9)[1:]
    torch.library.opcheck(harmonics_eval, (v.clone().requires_grad_(), key))
    g = torch.randn(63, polys.dim, dtype=torch.float64, generator=torch.Generator().manual_seed(11))
    # the vjp's own backward (second derivatives) runs torch's autograd on the reference: eager only
    torch.library.opcheck(harmonics_vjp, (v.clone().requires_grad_(), g.clone().requires_grad_(), key),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    x = v.clone().requires_grad_()
    (want,) = torch.autograd.grad(module(x), x, g)
    torch.testing.assert_close(harmonics_vjp(v, g, key), want, rtol=1e-12, atol=1e-12 * float(want.abs().max()))
    w = torch.randn(63, polys.dim, dtype=torch.float64, generator=torch.Generator().manual_seed(10))
    _assert_same_derivatives(_derivatives(lambda x: harmonics_eval(x, key), v, w), _derivatives(module, v, w), 1e-10)


def test_the_polynomials_are_read_without_touching_the_module() -> None:
    module = _module("0e+1o+2e", "component")
    polys = HarmonicsPolynomials.of(module)
    assert polys.degrees == (0, 1, 1, 1, 2, 2, 2, 2, 2) and polys.lmax == 2 and polys.dim == 9
    assert HarmonicsPolynomials.of(module) == polys and hash(HarmonicsPolynomials.of(module)) == hash(polys)
    assert all(sum(m) in (0, 1, 2) for m in polys.monomials)


def test_other_modules_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="normalize=True"):
        HarmonicsPolynomials.of(o3.SphericalHarmonics("0e+1o", normalize=False, normalization="component"))
    with pytest.raises(ValueError, match="SphericalHarmonics"):
        HarmonicsPolynomials.of(torch.nn.Linear(3, 3))
    with pytest.raises(ValueError, match=r"\[E, 3\]"):
        harmonics(torch.zeros(4, 2), HarmonicsPolynomials.of(_module("0e+1o", "component")))


# --- the generated source, as host C++ ----------------------------------------------------------------------------

_HOST_PRELUDE = """
#include <cmath>
#define __device__
#define __global__
#define __forceinline__ inline
#define __restrict__
using std::sqrt;
struct Index { long long x; };
static Index blockIdx = {0}, blockDim = {1}, threadIdx = {0};
"""

_HOST_DRIVER = """
extern "C" void run_fwd_f64(const double* v, double* out, long long n) {
    for (long long e = 0; e < n; ++e) { blockIdx.x = e; harmonics_fwd_f64(v, out, n); }
}
extern "C" void run_bwd_f64(const double* v, const double* g, double* gv, long long n) {
    for (long long e = 0; e < n; ++e) { blockIdx.x = e; harmonics_bwd_f64(v, g, gv, n); }
}
extern "C" void run_fwd_f32(const float* v, float* out, long long n) {
    for (long long e = 0; e < n; ++e) { blockIdx.x = e; harmonics_fwd_f32(v, out, n); }
}
extern "C" void run_bwd_f32(const float* v, const float* g, float* gv, long long n) {
    for (long long e = 0; e < n; ++e) { blockIdx.x = e; harmonics_bwd_f32(v, g, gv, n); }
}
"""


def _host_library(polys: HarmonicsPolynomials, folder: Path) -> ctypes.CDLL:
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("g++ is not installed")
    source = folder / "harmonics_host.cpp"
    source.write_text(_HOST_PRELUDE + harmonics_source(polys) + _HOST_DRIVER)
    library = folder / "harmonics_host.so"
    run = subprocess.run([compiler, "-O1", "-shared", "-fPIC", "-o", str(library), str(source)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    return ctypes.CDLL(str(library))


def _call(function, *arrays: np.ndarray) -> None:  # noqa: ANN001
    function(*[a.ctypes.data_as(ctypes.c_void_p) for a in arrays], ctypes.c_longlong(arrays[0].shape[0]))


@pytest.mark.parametrize("irreps,normalization", CASES)
def test_generated_source_run_as_cpp_equals_the_reference(irreps: str, normalization: str, tmp_path: Path) -> None:
    """The CUDA source with CUDA's keywords defined away, one loop iteration per thread: forward and backward equal
    the reference's values and vector-Jacobian product (FP64 to 1e-12, FP32 to 1e-4 of a row's largest)."""
    polys = HarmonicsPolynomials.of(_module(irreps, normalization))
    lib = _host_library(polys, tmp_path)
    v = _vectors(257, seed=5)
    g = torch.randn(257, polys.dim, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    x = v.clone().requires_grad_()
    want = harmonics_reference(x, polys)
    (want_gv,) = torch.autograd.grad(want, x, g)
    for suffix, dtype, tol in (("f64", np.float64, 1e-12), ("f32", np.float32, 1e-4)):
        vn, gn = v.numpy().astype(dtype), g.numpy().astype(dtype)
        out, gv = np.zeros((257, polys.dim), dtype), np.zeros((257, 3), dtype)
        _call(getattr(lib, f"run_fwd_{suffix}"), vn, out)
        _call(getattr(lib, f"run_bwd_{suffix}"), vn, gn, gv)
        np.testing.assert_allclose(out, want.detach().numpy(), rtol=tol, atol=tol)
        # per row (the clamped zero vector's gradient is 1e12-sized): FP32 loses digits in the projection
        scale = np.maximum(np.abs(want_gv.numpy()).max(axis=1, keepdims=True), 1.0)
        np.testing.assert_allclose(gv / scale, want_gv.numpy() / scale, rtol=tol, atol=tol)


def test_source_compiles_with_nvrtc_without_spills() -> None:
    from cgforge.kernels.core.compiler import compile_cubin, nvrtc_available

    if not nvrtc_available():
        pytest.skip("NVRTC is not installed")
    polys = HarmonicsPolynomials.of(_module(str(o3.Irreps.spherical_harmonics(3)), "component"))
    result = compile_cubin(harmonics_source(polys), arch="sm_90", name="harmonics.cu")
    for name in ("harmonics_fwd_f32", "harmonics_fwd_f64", "harmonics_bwd_f32", "harmonics_bwd_f64"):
        res = result.resources(name)
        assert not res.spills and res.stack_frame == 0, (name, res)


# --- on a GPU ----------------------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_kernel_equals_the_reference_with_two_derivatives(dtype: torch.dtype) -> None:
    module = _module(str(o3.Irreps.spherical_harmonics(3)), "component")
    polys = HarmonicsPolynomials.of(module)
    v = _vectors(100_003, seed=7, dtype=dtype).cuda()
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(harmonics(v, polys), harmonics_reference(v, polys), rtol=tol, atol=tol)
    w = torch.randn(v.shape[0] - 1, polys.dim, dtype=dtype, device="cuda")
    _assert_same_derivatives(_derivatives(lambda x: harmonics(x, polys), v[1:], w),
                             _derivatives(lambda x: harmonics_reference(x, polys), v[1:], w), tol * 10)


@pytest.mark.cuda
def test_cuda_graph_capture() -> None:
    polys = HarmonicsPolynomials.of(_module(str(o3.Irreps.spherical_harmonics(2)), "component"))
    v = _vectors(4096, seed=8, dtype=torch.float32).cuda()
    out = replayed(lambda: harmonics(v, polys), v)
    torch.testing.assert_close(out, harmonics_reference(v, polys), rtol=1e-5, atol=1e-5)
