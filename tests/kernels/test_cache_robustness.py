"""The kernel disk cache under damage, unwritable directories, crashes and concurrent writers."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from cgforge.kernels.core import compiler
from cgforge.kernels.core.compiler import KernelCacheWarning, cache_entry_path, cache_key, compile_cubin

SOURCE = r"""
extern "C" __global__ void scale(double a, double* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] *= a;
}
"""


def _unrolled_source(terms: int) -> str:
    """A kernel that takes NVRTC a noticeable time, so concurrent compilations overlap."""
    body = "\n".join(f"    acc = fma(acc, x[(i + {k}) % n], {k + 1}.0 / {k + 3}.0);" for k in range(terms))
    return ("extern \"C\" __global__ void unrolled(const double* x, double* y, int n) {\n"
            "    int i = blockIdx.x * blockDim.x + threadIdx.x;\n    if (i >= n) return;\n"
            f"    double acc = 0;\n{body}\n    y[i] = acc;\n}}\n")


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    directory = tmp_path / "kernels"
    monkeypatch.setenv("CGFORGE_CACHE_DIR", str(directory))
    monkeypatch.delenv("CGFORGE_CACHE_DISABLE", raising=False)
    compiler.clear_memory_cache()
    yield directory
    compiler.clear_memory_cache()


@pytest.fixture
def nvrtc_calls(monkeypatch) -> list:
    """Records every real NVRTC compilation."""
    calls = []
    real = compiler._compile_with_nvrtc

    def counting(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(compiler, "_compile_with_nvrtc", counting)
    return calls


def _entries(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.cgk"))


def _entry_cubin(path: Path, like: compiler.CompileResult) -> bytes:
    """The cubin of a whole, checksummed entry (raises ValueError for a damaged one).

    Entries of the same kernel are not byte-identical: the stored ptxas log has compile times.
    """
    return compiler._decode_entry(path.read_bytes(), like.cache_key, like.options).cubin


def test_memory_then_disk_cache_hits_skip_nvrtc(cache, nvrtc_calls):
    first = compile_cubin(SOURCE, arch="sm_80")
    assert len(nvrtc_calls) == 1
    assert _entries(cache) == [cache_entry_path(first.cache_key)]
    again = compile_cubin(SOURCE, arch="sm_80")
    assert again is first and len(nvrtc_calls) == 1  # in-process cache
    compiler.clear_memory_cache()
    from_disk = compile_cubin(SOURCE, arch="sm_80")
    assert len(nvrtc_calls) == 1  # disk cache
    assert from_disk.cubin == first.cubin and from_disk.log == first.log
    assert dict(from_disk.kernels) == dict(first.kernels) and from_disk.options == first.options


def test_key_depends_on_arch_options_and_source(cache, nvrtc_calls):
    keys = {
        cache_key(SOURCE, arch="sm_80"),
        cache_key(SOURCE, arch="sm_90"),
        cache_key(SOURCE, arch="sm_80", options=["-DFOO=1"]),
        cache_key(SOURCE + "\n", arch="sm_80"),
    }
    assert len(keys) == 4
    a80, a90 = compile_cubin(SOURCE, arch="sm_80"), compile_cubin(SOURCE, arch="sm_90")
    assert a80.cache_key != a90.cache_key and a80.cubin != a90.cubin
    assert len(_entries(cache)) == 2 and len(nvrtc_calls) == 2


def test_cache_disable_writes_nothing(cache, nvrtc_calls, monkeypatch):
    monkeypatch.setenv("CGFORGE_CACHE_DISABLE", "1")
    compile_cubin(SOURCE, arch="sm_80")
    compiler.clear_memory_cache()
    compile_cubin(SOURCE, arch="sm_80")
    assert len(nvrtc_calls) == 2
    assert not cache.exists() or not any(cache.iterdir())


@pytest.mark.parametrize("damage", ["flip_payload_byte", "truncate", "garbage", "empty", "wrong_key"])
def test_damaged_entry_is_replaced_with_a_warning(cache, nvrtc_calls, damage):
    good = compile_cubin(SOURCE, arch="sm_80")
    path = cache_entry_path(good.cache_key)
    data = path.read_bytes()
    if damage == "flip_payload_byte":
        broken = data[:-10] + bytes([data[-10] ^ 0xFF]) + data[-9:]
    elif damage == "truncate":
        broken = data[: len(data) // 2]
    elif damage == "garbage":
        broken = b"this is not a cubin entry" * 10
    elif damage == "empty":
        broken = b""
    else:  # a whole, valid entry of another kernel under this name (a bad copy, say)
        other = compile_cubin(SOURCE.replace("*=", "+="), arch="sm_80")
        broken = cache_entry_path(other.cache_key).read_bytes()
    path.write_bytes(broken)
    compiler.clear_memory_cache()
    calls_before = len(nvrtc_calls)
    with pytest.warns(KernelCacheWarning, match="damaged"):
        again = compile_cubin(SOURCE, arch="sm_80")
    assert len(nvrtc_calls) == calls_before + 1
    assert again.cubin == good.cubin
    assert _entry_cubin(path, good) == good.cubin  # rewritten whole
    compiler.clear_memory_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compile_cubin(SOURCE, arch="sm_80")  # and read back without complaint
    assert len(nvrtc_calls) == calls_before + 1


@pytest.mark.parametrize("code", [errno.EROFS, errno.ENOSPC, errno.EACCES])
def test_unwritable_cache_warns_once_and_keeps_results_in_memory(cache, nvrtc_calls, monkeypatch, code):
    # Tests run as root, so chmod cannot make a directory read-only: make the write fail instead.
    def failing_replace(src, dst):
        raise OSError(code, os.strerror(code), str(dst))

    monkeypatch.setattr(compiler.os, "replace", failing_replace)
    with pytest.warns(KernelCacheWarning, match="not writable") as record:
        first = compile_cubin(SOURCE, arch="sm_80")
    assert len([w for w in record if issubclass(w.category, KernelCacheWarning)]) == 1
    assert first.cubin[:4] == b"\x7fELF"
    assert list(cache.iterdir()) == []  # the temp file was removed, no entry appeared
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once: a second kernel and a repeat stay quiet
        assert compile_cubin(SOURCE, arch="sm_80") is first
        compile_cubin(SOURCE, arch="sm_90")
    assert len(nvrtc_calls) == 2


def test_full_disk_during_write_leaves_no_temp_file(cache, nvrtc_calls, monkeypatch):
    def full_disk(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(compiler.os, "fsync", full_disk)
    with pytest.warns(KernelCacheWarning, match="No space left"):
        result = compile_cubin(SOURCE, arch="sm_80")
    assert result.cubin[:4] == b"\x7fELF"
    assert list(cache.iterdir()) == []


def test_unusable_cache_directory_path(tmp_path, monkeypatch, nvrtc_calls):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("CGFORGE_CACHE_DIR", str(blocker / "kernels"))
    compiler.clear_memory_cache()
    with pytest.warns(KernelCacheWarning, match="not usable") as record:
        result = compile_cubin(SOURCE, arch="sm_80")
    assert len(record) == 1  # reading and writing failed; one warning says so
    assert result.cubin[:4] == b"\x7fELF" and len(nvrtc_calls) == 1
    compiler.clear_memory_cache()


def test_process_killed_mid_write_does_not_break_later_compiles(cache, nvrtc_calls):
    key = cache_key(SOURCE, arch="sm_80")
    good = compile_cubin(SOURCE, arch="sm_80")
    data = cache_entry_path(key).read_bytes()
    compiler.clear_memory_cache()
    # What a killed writer can leave: its temp file (young and old ones), and, on a filesystem that
    # lost the rename's ordering, a partially written entry.
    young = cache / f".{key[:16]}.crashed1.tmp"
    old = cache / f".{key[:16]}.crashed2.tmp"
    young.write_bytes(data[:100])
    old.write_bytes(data[:100])
    two_hours_ago = time.time() - 7200
    os.utime(old, (two_hours_ago, two_hours_ago))
    cache_entry_path(key).write_bytes(data[:-1])
    with pytest.warns(KernelCacheWarning, match="truncated"):
        again = compile_cubin(SOURCE, arch="sm_80")
    assert again.cubin == good.cubin and len(nvrtc_calls) == 2
    assert _entry_cubin(cache_entry_path(key), good) == good.cubin
    assert young.exists()  # might belong to a live writer: left alone
    assert not old.exists()  # abandoned long ago: swept


# Loads compiler.py by path rather than through the cgforge package, whose import pulls in torch and
# e3nn (seconds per process on a busy 2-core CI machine); the compiler module stands alone.
_CHILD = r"""
import importlib.util, os, sys, time
from pathlib import Path
spec = importlib.util.spec_from_file_location("child_compiler", sys.argv[1])
compiler = sys.modules["child_compiler"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compiler)
compiler.nvrtc_version()  # load the library before the race starts
Path(sys.argv[3] + ".ready").touch()
deadline = time.time() + 60
while not os.path.exists(sys.argv[4]) and time.time() < deadline:
    time.sleep(0.001)
result = compiler.compile_cubin(Path(sys.argv[2]).read_text(), arch="sm_80")
Path(sys.argv[3]).write_bytes(result.cubin)
"""


def test_concurrent_processes_compile_the_same_kernel(cache, tmp_path):
    source = _unrolled_source(150)
    (tmp_path / "kernel.cu").write_text(source)
    go = tmp_path / "go"
    outs = [tmp_path / f"out{i}.bin" for i in range(2)]
    env = {**os.environ, "CGFORGE_CACHE_DIR": str(cache)}
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD, compiler.__file__, str(tmp_path / "kernel.cu"),
                               str(out), str(go)], env=env) for out in outs]
    deadline = time.time() + 60
    while not all(Path(f"{out}.ready").exists() for out in outs) and time.time() < deadline:
        if any(p.poll() is not None for p in procs):
            break  # a child died early: its exit code fails the test below
        time.sleep(0.005)
    go.touch()  # both start compiling now
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    blobs = [out.read_bytes() for out in outs]
    assert blobs[0] == blobs[1] and blobs[0][:4] == b"\x7fELF"
    assert [p.name for p in cache.iterdir()] == [cache_entry_path(cache_key(source, arch="sm_80")).name]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compile_cubin(source, arch="sm_80").cubin == blobs[0]  # the surviving entry is whole
