"""Problems by key, and compile-and-load of their kernels: one implementation for every op.

Ops receive a problem by key (a short string), so they stay plain `torch.library` ops that torch.compile
and CUDA graphs can handle; the key resolves here to the op's plan. A plan caches its compiled kernels
per variant (direction, layout), dtype and device (`KernelCache`); `compile_source` is the one path from
CUDA source to a ptxas-checked cubin (used by the plans, `cgforge doctor` and `explain`).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

import torch

from . import compiler
from .errors import UnknownKernelKeyError

_SCALAR = {torch.float32: "float", torch.float64: "double"}

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


def compile_source(source: str, function: str, arch: str) -> compiler.CompileResult:
    """NVRTC (through the disk cache) for one kernel function; looked up at call time (tests patch it)."""
    return compiler.compile_cubin(source, arch=arch, name=f"{function}.cu")


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
            handle = runtime.load_kernels(result.cubin, [function])[function]
            self._handles[key] = handle
        return handle
