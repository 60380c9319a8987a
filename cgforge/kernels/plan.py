"""A registered problem and its compiled kernels: schedule per dtype, kernels per layout and device.

Ops receive a problem by key (a short string), so they stay plain `torch.library` ops that
torch.compile and CUDA graphs can handle; the key resolves here.
"""

from __future__ import annotations

import hashlib
import os
import threading

import torch

from .codegen import Layout, render
from .problem import TPProblem
from .schedule import BACKWARD_CHUNK, FORWARD_CHUNK, Schedule, build_schedule

_PLANS: dict[str, Plan] = {}
_LOCK = threading.Lock()

_SCALAR = {torch.float32: "float", torch.float64: "double"}


class Plan:
    def __init__(self, problem: TPProblem):
        self.problem = problem
        self._schedules: dict[int, Schedule] = {}
        self._kernels: dict[tuple, object] = {}

    def schedule(self, dtype: torch.dtype) -> Schedule:
        size = torch.empty((), dtype=dtype).element_size()
        if size not in self._schedules:
            # Tuning knobs for sweeps (channels per segment); the defaults live in schedule.py.
            fwd, bwd = os.environ.get("CGFORGE_FORWARD_CHUNK"), os.environ.get("CGFORGE_BACKWARD_CHUNK")
            self._schedules[size] = build_schedule(
                self.problem, itemsize=size, max_chunk=int(fwd) if fwd else FORWARD_CHUNK,
                max_chunk_backward=int(bwd) if bwd else BACKWARD_CHUNK)
        return self._schedules[size]

    def kernel(self, dtype: torch.dtype, layout: Layout, backward: bool, device: torch.device):
        """The launchable forward or backward kernel of this layout, compiled on first use."""
        key = (dtype, layout, backward, device.index)
        handle = self._kernels.get(key)
        if handle is None:
            from .compiler import compile_cubin
            from .runtime import device_arch, load_kernels

            source, name = render(self.schedule(dtype), _SCALAR[dtype], layout,
                                  forward=not backward, backward=backward)
            fn = f"{name}_{'backward' if backward else 'forward'}"
            result = compile_cubin(source, arch=device_arch(device), name=f"{fn}.cu")
            handle = load_kernels(result.cubin, [fn])[fn]
            self._kernels[key] = handle
        return handle


def register(problem: TPProblem) -> str:
    key = "tp_" + hashlib.sha1(problem.key().encode()).hexdigest()[:16]
    with _LOCK:
        if key not in _PLANS:
            _PLANS[key] = Plan(problem)
    return key


def get(key: str) -> Plan:
    try:
        return _PLANS[key]
    except KeyError:
        raise KeyError(f"unknown cgforge problem key {key!r}: build the TensorProduct/Convolution module "
                       "in this process first") from None
