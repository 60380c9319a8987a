"""Loading and launching compiled kernels on a GPU: streams, CUDA graphs, shared memory, arguments."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from cgforge.kernels.core import compiler, runtime
from cgforge.kernels.core.registry import load_source
from cgforge.kernels.core.runtime import F32, F64, I32, I64, device_arch, load_kernels

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SOURCE = r"""
extern "C" __global__ void axpy(double a, const double* __restrict__ x, double* __restrict__ y, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] += a * x[i];
}

// Sleeps first, so work that is wrongly ordered after it on another stream would overtake it.
extern "C" __global__ void slow_fill(float* y, float value, int n, long long spin_cycles) {
    long long start = clock64();
    while (clock64() - start < spin_cycles) { }
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = value;
}

// Every argument width in one kernel: a wrong width would shift the following ones.
extern "C" __global__ void widths(int a, long long b, float c, double d, const float* maybe_null,
                                  double* out) {
    out[0] = a; out[1] = (double)b; out[2] = c; out[3] = d; out[4] = maybe_null == nullptr ? 1.0 : 0.0;
}

// Reverses each block's slice through dynamic shared memory.
extern "C" __global__ void reverse_smem(const float* x, float* y, int per_block) {
    extern __shared__ float buf[];
    const float* xb = x + (long long)blockIdx.x * per_block;
    for (int i = threadIdx.x; i < per_block; i += blockDim.x) buf[i] = xb[i];
    __syncthreads();
    for (int i = threadIdx.x; i < per_block; i += blockDim.x)
        y[(long long)blockIdx.x * per_block + i] = buf[per_block - 1 - i];
}

template <typename T, int K>
__global__ void scale_by(T* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] *= T(K);
}
"""
NAMES = ["axpy", "slow_fill", "widths", "reverse_smem"]


@pytest.fixture(scope="module")
def kernels():
    result = compiler.compile_cubin(SOURCE, arch=device_arch())
    return result, load_kernels(result.cubin, NAMES)


def _axpy(kernel, a, x, y):
    n = x.numel()
    kernel.launch(((n + 255) // 256,), (256,), [np.float64(a), x, y, I64(n)])


def test_device_arch_matches_capability():
    major, minor = torch.cuda.get_device_capability()
    assert device_arch() == f"sm_{major}{minor}"


def test_axpy_matches_torch(kernels):
    _, k = kernels
    x = torch.randn(10_007, dtype=torch.float64, device="cuda")
    y = torch.randn(10_007, dtype=torch.float64, device="cuda")
    expected = y + 0.75 * x
    _axpy(k["axpy"], 0.75, x, y)
    torch.testing.assert_close(y, expected, rtol=0, atol=1e-15)


def test_argument_widths_and_null_pointer(kernels):
    _, k = kernels
    out = torch.zeros(5, dtype=torch.float64, device="cuda")
    k["widths"].launch((1,), (1,), [I32(-7), I64(2**40 + 3), F32(1.5), F64(-2.25), None, out])
    assert out.tolist() == [-7.0, float(2**40 + 3), 1.5, -2.25, 1.0]
    out.zero_()
    k["widths"].launch((1,), (1,), [np.int32(4), np.int64(-5), np.float32(0.5), np.float64(8.0), out, out])
    assert out.tolist() == [4.0, -5.0, 0.5, 8.0, 0.0]


def test_launch_uses_torchs_current_stream(kernels):
    _, k = kernels
    n = 4096
    side = torch.cuda.Stream()
    y = torch.zeros(n, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        assert runtime._current_raw_stream(torch.cuda.current_device()) == side.cuda_stream
        # ~50 ms of spinning at ~2 GHz, then torch reads y on the same stream: it must see the fill.
        k["slow_fill"].launch(((n + 255) // 256,), (256,), [y, F32(3.0), I32(n), I64(100_000_000)])
        total = y.sum()
    side.synchronize()
    assert total.item() == 3.0 * n


def test_cuda_graph_capture_and_replay(kernels):
    _, k = kernels
    n = 3000
    x = torch.randn(n, dtype=torch.float64, device="cuda")
    y = torch.zeros(n, dtype=torch.float64, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _axpy(k["axpy"], 2.0, x, y)  # warm-up outside capture, as torch recommends
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y.zero_()
        _axpy(k["axpy"], 2.0, x, y)
    x.copy_(torch.arange(n, dtype=torch.float64, device="cuda"))
    y.fill_(123.0)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, 2.0 * x, rtol=0, atol=0)
    x.mul_(-1)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, 2.0 * x, rtol=0, atol=0)


def test_dynamic_shared_memory_above_48k(kernels):
    _, k = kernels
    per_block = 24 * 1024  # floats: 96 KiB of shared memory, needs the opt-in attribute
    blocks = 3
    x = torch.randn(blocks * per_block, device="cuda")
    y = torch.empty_like(x)
    k["reverse_smem"].launch((blocks,), (256,), [x, y, I32(per_block)], shared_mem=per_block * 4)
    torch.cuda.synchronize()
    expected = x.view(blocks, per_block).flip(1).reshape(-1)
    assert torch.equal(y, expected)


def test_registers_reported_by_ptxas_match_the_driver(kernels):
    from cupy.cuda import driver

    result, k = kernels
    for name in NAMES:
        assert k[name].attribute(driver.CU_FUNC_ATTRIBUTE_NUM_REGS) == result.resources(name).registers


def test_templated_kernels_through_load_source():
    handles = load_source(SOURCE, ["scale_by<float, 3>", "scale_by<double, 5>"])
    yf = torch.ones(100, device="cuda")
    yd = torch.ones(100, dtype=torch.float64, device="cuda")
    handles["scale_by<float, 3>"].launch((1,), (128,), [yf, I32(100)])
    handles["scale_by<double, 5>"].launch((1,), (128,), [yd, I32(100)])
    torch.cuda.synchronize()
    assert torch.all(yf == 3) and torch.all(yd == 5)


def test_modules_are_loaded_once_per_cubin_and_device(kernels):
    result, _ = kernels
    before = len(runtime._modules)
    again = load_kernels(result.cubin, ["axpy"])
    assert len(runtime._modules) == before
    x = torch.ones(10, dtype=torch.float64, device="cuda")
    y = torch.zeros(10, dtype=torch.float64, device="cuda")
    _axpy(again["axpy"], 1.0, x, y)
    torch.cuda.synchronize()
    assert torch.all(y == 1)


def test_a_deep_copied_handle_launches(kernels):
    import copy

    _, k = kernels
    clone = copy.deepcopy(k["axpy"])
    x = torch.full((50,), 2.0, dtype=torch.float64, device="cuda")
    y = torch.zeros(50, dtype=torch.float64, device="cuda")
    _axpy(clone, 3.0, x, y)
    torch.cuda.synchronize()
    assert torch.all(y == 6)


def test_launch_from_a_fresh_thread(kernels):
    # Autograd runs backward on worker threads; a thread may have no current CUDA context yet.
    _, k = kernels
    x = torch.ones(64, dtype=torch.float64, device="cuda")
    y = torch.zeros(64, dtype=torch.float64, device="cuda")
    errors = []

    def work():
        try:
            _axpy(k["axpy"], 4.0, x, y)
            torch.cuda.synchronize()
        except Exception as e:  # surfaced below
            errors.append(e)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert not errors, errors
    assert torch.all(y == 4)


def test_bad_launches_are_rejected(kernels):
    _, k = kernels
    y = torch.zeros(4, dtype=torch.float64, device="cuda")
    with pytest.raises(ValueError, match="tensor is on cpu"):
        _axpy(k["axpy"], 1.0, torch.zeros(4, dtype=torch.float64), y)
    with pytest.raises(TypeError, match="Python int"):
        k["axpy"].launch((1,), (32,), [np.float64(1.0), y, y, 4])
    with pytest.raises(TypeError, match="Python float"):
        k["axpy"].launch((1,), (32,), [1.0, y, y, I64(4)])
    with pytest.raises(ValueError, match="grid"):
        k["axpy"].launch((1, 70_000), (32,), [np.float64(1.0), y, y, I64(4)])
    with pytest.raises(ValueError, match="block"):
        k["axpy"].launch((1,), (2048,), [np.float64(1.0), y, y, I64(4)])
    with pytest.raises(ValueError, match="not in the cubin"):
        load_kernels(kernels[0].cubin, ["no_such_kernel"])
    with pytest.raises(OverflowError):
        I32(2**31).ctype()


def test_doctor_runs_the_gpu_check(capsys):
    from cgforge.plugin.cli import doctor

    assert doctor.main() == 0
    out = capsys.readouterr().out
    assert "load and run on the GPU: axpy result exact" in out
    assert "[  ok] generated tensor product on the GPU" in out
