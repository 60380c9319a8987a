"""Loading cubins and launching their kernels on torch's current CUDA stream (``registry`` -> ``compiler`` -> here).

CuPy (imported on first use) makes the driver calls; torch owns memory and stream. A launch allocates nothing
and never synchronises, so it can be captured in a CUDA graph. An argument says its C type: a tensor (its data
pointer), None (null), I32/I64/F32/F64 or a NumPy scalar; a bare int or float is refused (its width is unknown
and a wrong width corrupts every later argument).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import threading
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import torch

_STATIC_SMEM_LIMIT = 48 * 1024  # above this, dynamic shared memory needs an explicit opt-in per function
_MAX_GRID_X = 2**31 - 1
_MAX_GRID_YZ = 65535
_MAX_BLOCK = (1024, 1024, 64)
_MAX_THREADS_PER_BLOCK = 1024


@dataclasses.dataclass(frozen=True)
class _Scalar:
    """A kernel argument of a stated C type; integers are range-checked (no silent wrap-around)."""

    value: int | float
    _CTYPE: ClassVar[type] = ctypes.c_double
    _BITS: ClassVar[int] = 0  # integer width, 0 for floating point

    def ctype(self) -> ctypes._SimpleCData:
        if self._BITS and not -(2 ** (self._BITS - 1)) <= self.value < 2 ** (self._BITS - 1):
            raise OverflowError(f"{type(self).__name__} value {self.value} does not fit in int{self._BITS}")
        return self._CTYPE(self.value)


class I32(_Scalar):
    _CTYPE, _BITS = ctypes.c_int32, 32


class I64(_Scalar):
    _CTYPE, _BITS = ctypes.c_int64, 64


class F32(_Scalar):
    _CTYPE = ctypes.c_float


class F64(_Scalar):
    _CTYPE = ctypes.c_double


_NUMPY_CTYPES: dict[type, type] = {np.int32: ctypes.c_int32, np.int64: ctypes.c_int64, np.uint32: ctypes.c_uint32,
                                   np.uint64: ctypes.c_uint64, np.float32: ctypes.c_float, np.float64: ctypes.c_double}


def device_arch(device: torch.device | int | str | None = None) -> str:
    """The cubin architecture of a CUDA device, e.g. 'sm_90' for compute capability 9.0 (None: torch's current one)."""
    if not torch.cuda.is_available():
        raise RuntimeError("device_arch needs a CUDA device, and torch sees none")
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


@dataclasses.dataclass
class _Loaded:
    """One cubin loaded on one device. The CuPy Module unloads the cubin when garbage collected."""

    module: Any
    context: int  # the driver context the module lives in (the device's primary context)


_modules: dict[tuple[str, int], _Loaded] = {}
_modules_lock = threading.Lock()


def _load_module(cubin: bytes, digest: str, device: int) -> _Loaded:
    key = (digest, device)
    with _modules_lock:
        loaded = _modules.get(key)
        if loaded is not None:
            return loaded
        import cupy
        from cupy.cuda import driver

        with cupy.cuda.Device(device):
            module = cupy.cuda.function.Module()
            try:
                module.load(cubin)
            except cupy.cuda.driver.CUDADriverError as e:
                arch = device_arch(device)
                raise RuntimeError(f"could not load the cubin on cuda:{device} ({arch}): {e}. A cubin runs "
                                   f"only on the architecture it was compiled for: compile with arch={arch!r}"
                                   ) from e
            loaded = _Loaded(module=module, context=driver.ctxGetCurrent())
        _modules[key] = loaded
        return loaded


@dataclasses.dataclass
class _DeviceFunction:
    ptr: int
    context: int
    dynamic_smem_limit: int = _STATIC_SMEM_LIMIT  # what the function accepts without a new attribute


class KernelHandle:
    """One kernel of a cubin; launches on whichever device torch has current (loading there on first use)."""

    def __init__(self, cubin: bytes, digest: str, name: str):
        self.name = name
        self._cubin = cubin
        self._digest = digest
        self._per_device: dict[int, _DeviceFunction] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"KernelHandle({self.name!r}, cubin sha256 {self._digest[:12]})"

    def __reduce__(self):
        # Copies and pickles (deepcopy of a model holding handles) rebuild an unloaded handle: the loaded
        # function pointers and the lock are per process.
        return (KernelHandle, (self._cubin, self._digest, self.name))

    def _function(self, device: int) -> _DeviceFunction:
        fn = self._per_device.get(device)
        if fn is not None:
            return fn
        with self._lock:
            fn = self._per_device.get(device)
            if fn is None:
                from cupy.cuda import driver

                loaded = _load_module(self._cubin, self._digest, device)
                try:
                    ptr = driver.moduleGetFunction(loaded.module.ptr, self.name)
                except driver.CUDADriverError as e:
                    raise ValueError(
                        f"kernel {self.name!r} is not in the cubin: give an extern \"C\" name or a lowered "
                        f"name from CompileResult.lowered_names ({e})") from e
                fn = _DeviceFunction(ptr=ptr, context=loaded.context)
                self._per_device[device] = fn
        return fn

    def prepare(self, device: int | None = None) -> None:
        """Load the cubin on `device` (default: torch's current one) now rather than at the first launch."""
        self._function(torch.cuda.current_device() if device is None else device)

    def attribute(self, attribute: int, device: int | None = None) -> int:
        """A CUfunction_attribute (cupy.cuda.driver.CU_FUNC_ATTRIBUTE_*), e.g. NUM_REGS."""
        from cupy.cuda import driver

        fn = self._function(torch.cuda.current_device() if device is None else device)
        return driver.funcGetAttribute(attribute, fn.ptr)

    def launch(self, grid: Sequence[int], block: Sequence[int], args: Sequence[Any], shared_mem: int = 0) -> None:
        """Enqueue the kernel on torch's current stream of torch's current device."""
        gx, gy, gz = _dims("grid", grid)
        bx, by, bz = _dims("block", block)
        if gx > _MAX_GRID_X or gy > _MAX_GRID_YZ or gz > _MAX_GRID_YZ:
            raise ValueError(f"grid {tuple(grid)} exceeds the CUDA limits (x < 2**31, y and z <= 65535)")
        too_big = bx > _MAX_BLOCK[0] or by > _MAX_BLOCK[1] or bz > _MAX_BLOCK[2]
        if too_big or bx * by * bz > _MAX_THREADS_PER_BLOCK:
            raise ValueError(f"block {tuple(block)} exceeds the CUDA limits (x, y <= 1024, z <= 64, "
                             f"at most 1024 threads)")
        if not isinstance(shared_mem, (int, np.integer)) or isinstance(shared_mem, bool) or shared_mem < 0:
            raise ValueError(f"shared_mem must be a non-negative int (bytes), got {shared_mem!r}")
        shared_mem = int(shared_mem)
        device = _current_device()
        fn = self._function(device)
        driver = _driver()
        if shared_mem > fn.dynamic_smem_limit:
            # Opt in to more than 48 KiB of dynamic shared memory; the driver rejects sizes over the device's.
            attr = driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            driver.funcSetAttribute(fn.ptr, attr, shared_mem)
            fn.dynamic_smem_limit = shared_mem
        values = [_c_value(i, a, device) for i, a in enumerate(args)]
        params = (ctypes.c_void_p * max(1, len(values)))(*[ctypes.addressof(v) for v in values])
        stream = _current_raw_stream(device)
        if driver.ctxGetCurrent() != fn.context:
            # A thread torch never made a CUDA call on (e.g. some autograd worker) has no current context.
            driver.ctxSetCurrent(fn.context)
        # cuLaunchKernel copies the parameter values before it returns, so `values` may die afterwards.
        driver.launchKernel(fn.ptr, gx, gy, gz, bx, by, bz, shared_mem, stream,
                            ctypes.addressof(params) if values else 0, 0)


@functools.cache
def _driver():
    from cupy.cuda import driver

    return driver


# torch's own fast paths (what torch.cuda.current_device/current_stream call after their checks), else the public API
_raw_get_device = getattr(torch._C, "_cuda_getDevice", None)
_raw_get_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _current_device() -> int:
    if _raw_get_device is not None and torch.cuda.is_initialized():
        return _raw_get_device()
    return torch.cuda.current_device()


def _current_raw_stream(device: int) -> int:
    if _raw_get_stream is not None:
        return _raw_get_stream(device)
    return torch.cuda.current_stream(device).cuda_stream


def _dims(label: str, dims: Sequence[int]) -> tuple[int, int, int]:
    if type(dims) is tuple and len(dims) == 3 and all(type(d) is int and d >= 1 for d in dims):
        return dims  # the common case, checked cheaply
    if isinstance(dims, (int, np.integer)):
        dims = (int(dims),)
    if not isinstance(dims, (tuple, list)) or not 1 <= len(dims) <= 3:
        raise ValueError(f"{label} must be a tuple of 1 to 3 ints, got {dims!r}")
    out = []
    for d in dims:
        if not isinstance(d, (int, np.integer)) or isinstance(d, bool) or d < 1:
            raise ValueError(f"{label} dimensions must be positive ints, got {dims!r}")
        out.append(int(d))
    out += [1] * (3 - len(out))
    return out[0], out[1], out[2]


def _c_value(index: int, arg: Any, device: int) -> ctypes._SimpleCData:
    if isinstance(arg, torch.Tensor):
        if not arg.is_cuda or arg.device.index != device:
            raise ValueError(f"kernel argument {index}: tensor is on {arg.device}, expected cuda:{device} "
                             f"(torch's current device)")
        return ctypes.c_uint64(arg.data_ptr())
    if arg is None:
        return ctypes.c_uint64(0)
    if isinstance(arg, _Scalar):
        return arg.ctype()
    ctype = _NUMPY_CTYPES.get(type(arg))
    if ctype is not None:
        return ctype(arg.item())
    if isinstance(arg, (bool, int, float)):
        raise TypeError(f"kernel argument {index}: a Python {type(arg).__name__} has no C width; "
                        f"wrap it as I32/I64/F32/F64 or a NumPy scalar (np.int32(...), ...)")
    raise TypeError(f"kernel argument {index}: unsupported type {type(arg).__name__} (expected a CUDA "
                    f"tensor, None, I32/I64/F32/F64 or a NumPy scalar)")


def device_index(device: torch.device | int | str | None = None) -> int:
    """The CUDA device index of `device` (torch's current device for None or a bare 'cuda')."""
    if isinstance(device, int):
        return device
    index = None if device is None else torch.device(device).index
    return torch.cuda.current_device() if index is None else index


def load_kernels(cubin: bytes, names: Sequence[str], device: torch.device | int | None = None
                 ) -> dict[str, KernelHandle]:
    """Handles for kernels `names` of `cubin`, loaded on `device` (torch's current one if None; others load on first
    use); a module is loaded once per (cubin, device) for the life of the process."""
    if not isinstance(cubin, (bytes, bytearray)) or not cubin:
        raise TypeError(f"cubin must be non-empty bytes, got {type(cubin).__name__}")
    if isinstance(names, str) or not all(isinstance(n, str) and n for n in names):
        raise TypeError(f"names must be a sequence of kernel names (str), got {names!r}")
    if not torch.cuda.is_available():
        raise RuntimeError("load_kernels needs a CUDA device, and torch sees none")
    cubin = bytes(cubin)
    digest = hashlib.sha256(cubin).hexdigest()
    handles = {name: KernelHandle(cubin, digest, name) for name in names}
    index = device_index(device)
    for handle in handles.values():
        handle.prepare(index)
    return handles
