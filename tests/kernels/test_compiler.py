"""NVRTC compilation on the CPU machine: cubins, the parsed ptxas report, errors, library discovery."""

from __future__ import annotations

import os

import pytest

from cgforge.kernels.core import compiler
from cgforge.kernels.core.compiler import CompileError, compile_cubin, parse_ptxas_report

AXPY = r"""
extern "C" __global__ void axpy(float a, const float* __restrict__ x, float* __restrict__ y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] += a * x[i];
}
"""

TEMPLATED = r"""
template <int N>
__global__ void reverse_block(double* y) {
    __shared__ double s[N];
    s[threadIdx.x] = y[threadIdx.x];
    __syncthreads();
    y[threadIdx.x] = s[N - 1 - threadIdx.x];
}
"""

# 24 live doubles per iteration: with --maxrregcount=24 ptxas must spill.
REGISTER_HEAVY = r"""
extern "C" __global__ void heavy(const double* x, double* y) {
    double acc[24];
    #pragma unroll
    for (int k = 0; k < 24; k++) acc[k] = x[threadIdx.x * 24 + k];
    #pragma unroll
    for (int it = 0; it < 8; it++) {
        #pragma unroll
        for (int k = 0; k < 24; k++) acc[k] = acc[k] * acc[(k + it + 1) % 24] + x[k];
    }
    double s = 0;
    #pragma unroll
    for (int k = 0; k < 24; k++) s += acc[k] * k;
    y[threadIdx.x] = s;
}
"""


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CGFORGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("CGFORGE_CACHE_DISABLE", raising=False)
    compiler.clear_memory_cache()
    yield
    compiler.clear_memory_cache()


def test_nvrtc_is_found_and_reports_its_version():
    # Not a skip: CI installs the NVRTC wheel, and a machine without it must fail loudly here.
    assert compiler.nvrtc_available(), "libnvrtc not loadable; install nvidia-cuda-nvrtc-cu12"
    major, minor = compiler.nvrtc_version()
    assert major >= 11 and minor >= 0
    assert os.path.basename(compiler.nvrtc_library_path()).startswith("libnvrtc")
    archs = compiler.supported_archs()
    assert "sm_80" in archs and "sm_90" in archs


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_compile_gives_cubin_and_register_report(arch):
    result = compile_cubin(AXPY, arch=arch)
    assert result.cubin[:4] == b"\x7fELF"
    assert result.arch == arch
    assert f"--gpu-architecture={arch}" in result.options
    assert "--use_fast_math" not in result.options and "-lineinfo" not in result.options
    res = result.resources("axpy")
    assert 4 <= res.registers <= 64
    assert res.spill_stores == 0 and res.spill_loads == 0 and not res.spills
    assert f"for '{arch}'" in result.log


def test_recompiling_still_gives_the_report():
    # NVRTC's own cache (active where a driver is installed) would return an empty log on a repeat.
    for _ in range(2):
        compiler.clear_memory_cache()
        result = compile_cubin(AXPY, arch="sm_80", options=["-DREPEAT=1"])
        assert result.resources("axpy").registers > 0
        compiler.cache_entry_path(result.cache_key).unlink()


def test_name_expressions_are_lowered_and_report_shared_memory():
    result = compile_cubin(TEMPLATED, arch="sm_80", name_expressions=["reverse_block<128>"])
    lowered = result.lowered_names["reverse_block<128>"]
    assert lowered != "reverse_block<128>" and "reverse_block" in lowered  # a mangled name
    res = result.resources("reverse_block<128>")
    assert res is result.kernels[lowered]
    assert res.shared_mem == 128 * 8
    assert res.barriers == 1


def test_spills_are_reported():
    result = compile_cubin(REGISTER_HEAVY, arch="sm_80", options=["--maxrregcount=24"])
    res = result.resources("heavy")
    assert res.registers <= 24
    assert res.spill_stores > 0 and res.spill_loads > 0 and res.spills
    assert res.stack_frame >= res.spill_stores // 8


def test_parse_ptxas_report_handles_device_functions_and_missing_fields():
    log = "\n".join([
        "ptxas info    : 0 bytes gmem",
        "ptxas info    : Function properties for helper",  # a non-inlined device function: not a kernel
        "ptxas         .     16 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads",
        "ptxas info    : Compiling entry function 'k1' for 'sm_90'",
        "ptxas info    : Function properties for k1",
        "ptxas         .     0 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads",
        "ptxas info    : Used 168 registers, used 1 barriers, 4096 bytes smem, 400 bytes cmem[0]",
        "ptxas info    : Compiling entry function 'k2' for 'sm_90'",
        "ptxas info    : Used 7 registers",
    ])
    report = parse_ptxas_report(log)
    assert set(report) == {"k1", "k2"}
    k1 = report["k1"]
    assert (k1.registers, k1.spill_stores, k1.spill_loads, k1.shared_mem, k1.barriers, k1.const_mem) == \
        (168, 4, 12, 4096, 1, 400)
    assert report["k2"].registers == 7 and report["k2"].shared_mem == 0 and not report["k2"].spills


def test_compile_error_carries_log_and_source_context():
    bad = AXPY + "\n__global__ void broken(float* y) {\n    y[0] = undefined_symbol;\n}\n"
    bad_line = bad.splitlines().index("    y[0] = undefined_symbol;") + 1
    with pytest.raises(CompileError) as info:
        compile_cubin(bad, arch="sm_80", name="broken.cu")
    err = info.value
    assert isinstance(err, RuntimeError)
    assert "undefined_symbol" in err.log and f"broken.cu({bad_line})" in err.log
    assert f"> {bad_line} |     y[0] = undefined_symbol;" in str(err)
    assert err.source_name == "broken.cu"


def test_bad_arguments_are_rejected_clearly():
    with pytest.raises(ValueError, match="arch"):
        compile_cubin(AXPY, arch="compute_90")
    with pytest.raises(ValueError, match="arch"):
        compile_cubin(AXPY, arch="sm90")
    with pytest.raises(ValueError, match="not supported by NVRTC"):
        compile_cubin(AXPY, arch="sm_30")
    with pytest.raises(TypeError, match="options"):
        compile_cubin(AXPY, arch="sm_80", options="-O3")
    with pytest.raises(ValueError, match="arch="):
        compile_cubin(AXPY, arch="sm_80", options=["-arch=sm_90"])
    with pytest.raises(TypeError, match="source"):
        compile_cubin(b"bytes", arch="sm_80")
    with pytest.raises(TypeError, match="source"):
        compile_cubin("   ", arch="sm_80")


def test_user_std_option_replaces_the_default():
    result = compile_cubin(AXPY, arch="sm_80", options=["--std=c++20"])
    assert "--std=c++20" in result.options and "--std=c++17" not in result.options
    assert compile_cubin(AXPY, arch="sm_80").options.count("--std=c++17") == 1


def test_library_search_prefers_override_then_wheels(monkeypatch, tmp_path):
    found = compiler._candidate_library_paths()
    loaded = compiler.nvrtc_library_path()
    assert loaded in found
    if f"{os.sep}nvidia{os.sep}" in loaded:  # the pip wheel is found before system locations
        assert found.index(loaded) <= min(i for i, p in enumerate(found) if "/nvidia/" in p)
    assert not any("builtins" in os.path.basename(p) or ".alt." in p for p in found)
    monkeypatch.setenv("CGFORGE_NVRTC_PATH", str(tmp_path / "libnvrtc.so.99"))
    assert compiler._candidate_library_paths()[0] == str(tmp_path / "libnvrtc.so.99")


def test_results_can_be_copied_and_pickled():
    import copy
    import pickle

    result = compile_cubin(TEMPLATED, arch="sm_80", name_expressions=["reverse_block<64>"])
    for clone in (copy.deepcopy(result), pickle.loads(pickle.dumps(result))):
        assert clone == result
        assert clone.resources("reverse_block<64>").shared_mem == 64 * 8
