"""Problems by key, and compile-and-load of their kernels: registry -> compiler (NVRTC, disk cache) -> runtime.

Ops take a problem by key (a short string), so they stay plain ``torch.library`` ops for torch.compile and CUDA
graphs. A plan caches its kernels per variant, dtype and device (``KernelCache``); a fixed source's kernels are
``SourceKernels``. ``compile_source``: CUDA source -> ptxas-checked cubin; ``load_source`` also loads it.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Generic, TypeVar

import torch

from . import compiler
from .errors import UnknownKernelKeyError

_SCALAR = {torch.float32: "float", torch.float64: "double"}
DTYPE_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}  # the fixed sources' kernel names per dtype

P = TypeVar("P")


def scalar_name(dtype: torch.dtype) -> str:
    """The C type of a kernel for `dtype` ('float' or 'double')."""
    try:
        return _SCALAR[dtype]
    except KeyError:
        raise TypeError(f"the kernels run float32 or float64, got {dtype}") from None


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class Registry(Generic[P]):
    """Plans of one op by key: `register` is idempotent, `get` names what to do on a miss."""

    def __init__(self, prefix: str, module_name: str):
        self.prefix = prefix
        self.module_name = module_name
        self._plans: dict[str, P] = {}
        self._lock = threading.Lock()

    def register(self, text_key: str, make: Callable[[], P]) -> str:
        key = f"{self.prefix}_" + hashlib.sha1(text_key.encode()).hexdigest()[:16]
        with self._lock:
            if key not in self._plans:
                self._plans[key] = make()
        return key

    def get(self, key: str) -> P:
        try:
            return self._plans[key]
        except KeyError:
            raise UnknownKernelKeyError(f"unknown cgforge problem key {key!r}: build the {self.module_name} "
                                        "module in this process first") from None

    def clear(self) -> None:
        """Forget every plan (and so its compiled kernels); modules built before must be rebuilt."""
        with self._lock:
            self._plans.clear()


def compile_source(source: str, function: str, arch: str, *, name_expressions: Sequence[str] = (),
                   options: Sequence[str] = ()) -> compiler.CompileResult:
    """NVRTC (through the disk cache) for `source`, named `<function>.cu` (a kernel function, or a file's stem
    when it holds several); `name_expressions`: C++ names to lower (``CompileResult.lowered_names``). Looked up
    at call time (tests patch it)."""
    return compiler.compile_cubin(source, arch=arch, options=options, name=f"{function}.cu",
                                  name_expressions=name_expressions)


def load_source(source: str, names: Sequence[str], *, stem: str = "kernel", options: Sequence[str] = (),
                device: torch.device | int | None = None) -> dict[str, Any]:
    """Compile `source` for a device's architecture (None: torch's current; cached) and load kernels `names` (extern
    "C" names or C++ name expressions such as 'tp_fwd<float, 32>'); they launch on the current device."""
    from . import runtime

    names = list(names)
    result = compile_source(source, stem, runtime.device_arch(device), name_expressions=names, options=options)
    lowered = [result.lowered_names.get(n, n) for n in names]
    handles = runtime.load_kernels(result.cubin, lowered, device=device)
    return {n: handles[low] for n, low in zip(names, lowered)}


class KernelCache:
    """A plan's launchable kernels, compiled on first use: (variant, dtype, device) -> handle."""

    def __init__(self) -> None:
        self._handles: dict[tuple, Any] = {}

    def get(self, variant: Hashable, dtype: torch.dtype, device: torch.device,
            render: Callable[[], tuple[str, str]]) -> Any:
        """`render()` gives (source, kernel function name); called only on a miss."""
        key = (variant, dtype, device.index)
        handle = self._handles.get(key)
        if handle is None:
            from . import runtime

            source, function = render()
            result = compile_source(source, function, runtime.device_arch(device))
            handle = runtime.load_kernels(result.cubin, [function], device=device)[function]
            self._handles[key] = handle
        return handle


class SourceKernels:
    """The kernels of one fixed CUDA source (no problem, no variants): compiled on first use per device through
    `load_source`, named `<stem>.cu`."""

    def __init__(self, source: str, names: Sequence[str], stem: str):
        self.source = source
        self.names = tuple(names)
        self.stem = stem
        self._handles: dict[int, dict[str, Any]] = {}
        self._lock = threading.Lock()

    def get(self, name: str, device: torch.device) -> Any:
        """The launchable kernel `name` on `device` (a CUDA device; its index, or torch's current one)."""
        from .runtime import device_index

        index = device_index(device)
        handles = self._handles.get(index)
        if handles is None:
            with self._lock:
                handles = self._handles.get(index)
                if handles is None:
                    handles = load_source(self.source, self.names, stem=self.stem, device=index)
                    self._handles[index] = handles
        return handles[name]
