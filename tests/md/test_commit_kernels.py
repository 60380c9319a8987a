"""The engine's commit rule as two CUDA kernels (``commit_step_kernels``) against its torch expression
(``commit_step``), case by case: clean steps, every kind of blow-up, stale and overflowing lists, a block already
stopped, a NaN in the report."""

from __future__ import annotations

import ctypes
import itertools
import math
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from cgforge.kernels import commit as kernels
from cgforge.plugin.md import commit


def test_one_report_order() -> None:
    """The engine's report and the kernel's indices are one tuple."""
    assert commit.REPORT is kernels.REPORT and len(set(commit.REPORT)) == 10


def test_commit_kernels_compile_without_spills() -> None:
    from cgforge.kernels.core.compiler import compile_cubin, nvrtc_available

    if not nvrtc_available():
        pytest.skip("NVRTC is not installed")
    for arch in ("sm_80", "sm_90"):
        result = compile_cubin(kernels.COMMIT_SOURCE, arch=arch, name="md_commit.cu")
        for name in ("commit_partials", "commit_finish"):
            res = result.resources(name)
            assert not res.spills and res.stack_frame == 0, (arch, name, res)


def _case(n: int, device: str, *, energy: float = -12.5, force: float | None = None, hot: bool = False,
          stale: bool = False, overflow: bool = False, stopped: bool = False, count_max: float = 40.0,
          momentum: float | None = None, seed: int = 0) -> tuple:
    g = torch.Generator().manual_seed(seed)
    f64 = {"dtype": torch.float64}
    forces = torch.randn(n, 3, generator=g, **f64)
    if force is not None:
        forces[n // 2, 1] = force
    masses = (1.0 + 15.0 * torch.rand(n, 1, generator=g, **f64))
    momenta = torch.randn(n, 3, generator=g, **f64) * masses.sqrt() * (3.0 if hot else 0.05)
    if momentum is not None:  # a NaN temperature is too hot (not <= the limit)
        momenta[0, 2] = momentum
    report = torch.tensor([7.0, 1.0 if stopped else 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, count_max, 0.3, 280.0], **f64)
    args = (torch.tensor(energy, **f64), forces, momenta, masses, torch.tensor(41), torch.tensor(stale),
            torch.tensor(overflow), torch.tensor(55), torch.tensor(0.21, **f64), 2000.0, report)
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal, NaN where NaN; the temperature (last entry) and blow_value to 1e-12 (another summation order)."""
    got, want = got.cpu(), want.cpu()
    assert torch.equal(got.isnan(), want.isnan()), (got, want)
    torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), rtol=1e-12, atol=0.0)


CASES = [dict(), dict(energy=math.nan), dict(energy=math.inf), dict(force=math.nan), dict(force=-math.inf),
         dict(force=math.inf, energy=math.nan), dict(hot=True), dict(stale=True), dict(overflow=True),
         dict(stale=True, force=math.nan), dict(stopped=True), dict(stopped=True, hot=True), dict(count_max=math.nan),
         dict(count_max=99.0), dict(momentum=math.nan), dict(momentum=math.nan, stopped=True)]


_HOST_PRELUDE = """
#include <cmath>
#define __device__
#define __global__
#define __forceinline__ inline
#define __restrict__
#define __shared__ static
using std::isfinite; using std::isnan; using std::fmax; using std::fabs; using std::nan;
struct Dim { long long x; };
static Dim blockIdx = {0}, blockDim = {1}, threadIdx = {0}, gridDim = {1};
static void __syncthreads() {}
"""

_HOST_DRIVER = """
extern "C" void run_commit(const double* momenta, const double* masses, const double* forces, long long elements,
                           double energy, long long step, int stale, int overflow, long long count, double slack,
                           const double* report, double temperature_per_kinetic, double max_temperature,
                           int* bad, long long* step_out, double* new_report) {
    Partial all = {0.0, 0.0, 0, 0};
    for (long long e = 0; e < elements; ++e) add_element(all, momenta[e], masses[e / 3], forces[e]);
    bool b = false;
    apply_rule(all, energy, step, stale != 0, overflow != 0, count, slack, report, temperature_per_kinetic,
               max_temperature, &b, step_out, new_report);
    *bad = b ? 1 : 0;
}
"""


@pytest.fixture(scope="module")
def host_rule(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """The kernels' source as C++ on the CPU (CUDA's keywords defined away): the per-element sums in one sequence
    and the rule, as the GPU's thread 0 applies it."""
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("g++ is not installed")
    folder = Path(tmp_path_factory.mktemp("commit"))
    source = folder / "commit_host.cpp"
    source.write_text(_HOST_PRELUDE + kernels.COMMIT_SOURCE + _HOST_DRIVER)
    library = folder / "commit_host.so"
    run = subprocess.run([compiler, "-O1", "-shared", "-fPIC", "-o", str(library), str(source)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    return ctypes.CDLL(str(library))


@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_rule_run_as_cpp_equals_the_torch_rule(host_rule: ctypes.CDLL, case: int) -> None:
    from ase import units

    n = 37
    args = _case(n, "cpu", seed=case, **CASES[case])
    energy, forces, momenta, masses, step, stale, overflow, count, slack, max_t, report = args
    bad, new_step = ctypes.c_int(), ctypes.c_longlong()
    new_report = np.zeros(len(commit.REPORT))
    arrays = [np.ascontiguousarray(t.numpy()) for t in (momenta, masses, forces)]
    pointer = ctypes.c_void_p
    host_rule.run_commit(*[pointer(a.ctypes.data) for a in arrays], ctypes.c_longlong(3 * n),
                         ctypes.c_double(float(energy)), ctypes.c_longlong(int(step)), ctypes.c_int(int(stale)),
                         ctypes.c_int(int(overflow)), ctypes.c_longlong(int(count)), ctypes.c_double(float(slack)),
                         pointer(np.ascontiguousarray(report.numpy()).ctypes.data),
                         ctypes.c_double(1.0 / (1.5 * n * units.kB)), ctypes.c_double(max_t), ctypes.byref(bad),
                         ctypes.byref(new_step), pointer(new_report.ctypes.data))
    want_bad, want_step, want_report = commit.commit_step(*args)
    assert bool(bad.value) == bool(want_bad) and new_step.value == int(want_step)
    _same(torch.from_numpy(new_report), want_report)


@pytest.mark.cuda
@pytest.mark.parametrize("n, case", list(itertools.product([1, 7, 5184, 100003], range(len(CASES)))))
def test_commit_kernels_equal_the_torch_rule(n: int, case: int) -> None:
    args = _case(n, "cuda", seed=case, **CASES[case])
    bad, step, report = commit.commit_step_kernels(*args)
    want_bad, want_step, want_report = commit.commit_step(*args)
    assert bad.dtype == torch.bool and bad.shape == () and bool(bad) == bool(want_bad)
    assert step.dtype == torch.int64 and int(step) == int(want_step)
    _same(report, want_report)


@pytest.mark.cuda
def test_commit_kernels_are_capturable_and_repeatable() -> None:
    """Inside a CUDA graph the kernels read the tensors as they are at replay, and the same inputs give the same
    bits every time (fixed summation order)."""
    args = list(_case(5184, "cuda"))
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        commit.commit_step_kernels(*args)  # compiled and loaded before the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            outs = commit.commit_step_kernels(*args)
    results = []
    for energy in (-12.5, math.nan, -3.0):
        args[0].fill_(energy)
        graph.replay()
        torch.cuda.synchronize()
        results.append(tuple(t.clone() for t in outs))
        want = commit.commit_step(*args)
        assert bool(results[-1][0]) == bool(want[0]) and int(results[-1][1]) == int(want[1])
        _same(results[-1][2], want[2])
    args[0].fill_(-12.5)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(outs, results[0], strict=True))


def test_commit_kernels_refuse_what_the_engine_never_passes() -> None:
    """Wrong dtypes or devices are named before any launch (here on the CPU: every tensor is off CUDA)."""
    args = list(_case(4, "cpu"))
    with pytest.raises(ValueError, match="commit_step_cuda: energy must be torch.float64 on cpu"):
        kernels.commit_step_cuda(*[a.float() if i == 0 else a for i, a in enumerate(args)], 1.0)
