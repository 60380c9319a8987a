"""Generated warp-level CUDA run on the CPU as C++ (g++): each warp's 32 lanes are host threads that meet at a
barrier wherever CUDA's lanes synchronise (``__syncwarp``, ``__shfl_xor_sync``, ``__ballot_sync``), so the kernels'
shared-memory staging and warp reductions run as written. The warps of one block run one after another (a grid of
one block: the kernels' grid-stride loops then cover every row); ``atomicAdd`` takes a lock. For tests of what a
kernel computes, not of its speed; only the CUDA constructs the generated kernels use are defined."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

PRELUDE = r"""
#include <algorithm>
#include <barrier>
#include <cmath>
#include <mutex>
#include <thread>
#include <vector>
#define __device__
#define __global__
#define __shared__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(...)
#define __align__(n)  // the definition below is aligned
using std::min; using std::max; using std::isnan; using std::isfinite; using std::fabs; using std::sqrt;
struct Dim { long long x; };
static thread_local Dim threadIdx = {0};
static Dim blockIdx = {0}, blockDim = {32}, gridDim = {1};
struct float4 { float x, y, z, w; };
struct double2 { double x, y; };
template <typename T> inline T __ldg(const T* p) { return *p; }
alignas(16) unsigned char smem_bytes[1 << 20];
static std::barrier<>* warp_barrier = nullptr;
static double shuffle_slots[32];
static std::mutex atomic_lock;
inline void __syncwarp(unsigned = 0xffffffffu) { warp_barrier->arrive_and_wait(); }
template <typename T> inline T __shfl_xor_sync(unsigned, T v, int mask) {
    const int lane = threadIdx.x & 31;
    shuffle_slots[lane] = (double)v;  // exact for float and double
    warp_barrier->arrive_and_wait();
    const T other = (T)shuffle_slots[lane ^ mask];
    warp_barrier->arrive_and_wait();
    return other;
}
inline unsigned __ballot_sync(unsigned, int predicate) {
    const int lane = threadIdx.x & 31;
    shuffle_slots[lane] = predicate ? 1.0 : 0.0;
    warp_barrier->arrive_and_wait();
    unsigned bits = 0;
    for (int l = 0; l < 32; ++l) bits |= (shuffle_slots[l] != 0.0 ? 1u : 0u) << l;
    warp_barrier->arrive_and_wait();
    return bits;
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }
template <typename T> inline T atomicAdd(T* p, T v) {
    std::lock_guard<std::mutex> hold(atomic_lock);
    const T old = *p;
    *p = old + v;
    return old;
}
// Run `body(warp, lane)` for every lane of `warps` warps, one warp at a time.
template <typename F> void run_warps(int warps, F body) {
    blockDim.x = 32LL * warps;
    for (int w = 0; w < warps; ++w) {
        std::barrier<> bar(32);
        warp_barrier = &bar;
        std::vector<std::thread> lanes;
        for (int lane = 0; lane < 32; ++lane)
            lanes.emplace_back([&, w, lane] { threadIdx.x = 32LL * w + lane; body(); });
        for (auto& t : lanes) t.join();
    }
}
"""


def build(source: str, driver: str, folder: Path, name: str = "kernel") -> ctypes.CDLL:
    """``PRELUDE + source + driver`` compiled as a shared library (skips the test where g++ is missing)."""
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("g++ is not installed")
    path = folder / f"{name}.cpp"
    path.write_text(PRELUDE + source + driver)
    library = folder / f"{name}.so"
    run = subprocess.run([compiler, "-std=c++20", "-O0", "-w", "-shared", "-fPIC", "-pthread", "-o", str(library),
                          str(path)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-4000:]
    return ctypes.CDLL(str(library))


def pointer(array: np.ndarray | None) -> ctypes.c_void_p:
    """A C pointer to ``array``'s data (a null one for None); the caller keeps the array alive."""
    return ctypes.c_void_p(None if array is None else array.ctypes.data)


def call(function, args: Sequence[object]) -> None:  # noqa: ANN001
    """``function(*args)``: arrays (or None) as pointers, Python ints as long long, ``ctypes`` values as given."""
    converted = [a if isinstance(a, ctypes._SimpleCData) else ctypes.c_longlong(a) if isinstance(a, int)
                 else pointer(a) for a in args]
    function(*converted)


def assert_compiles_without_spills(source: str, filename: str, names: Sequence[str]) -> None:
    """NVRTC (no GPU needed) compiles a fixed CUDA source for sm_90 with no spills and no stack frame in any of the
    kernels ``names`` (skips where NVRTC is missing)."""
    from cgforge.kernels.core.compiler import compile_cubin, nvrtc_available

    if not nvrtc_available():
        pytest.skip("NVRTC is not installed")
    result = compile_cubin(source, arch="sm_90", name=filename)
    for name in names:
        res = result.resources(name)
        assert not res.spills and res.stack_frame == 0, (name, res)
