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
from .schedule import Schedule, build_schedule, default_chunks

_PLANS: dict[str, Plan] = {}
_LOCK = threading.Lock()

_SCALAR = {torch.float32: "float", torch.float64: "double"}


class Plan:
    def __init__(self, problem: TPProblem):
        self.problem = problem
        self._schedules: dict[tuple[int, bool], Schedule] = {}
        self._kernels: dict[tuple, object] = {}

    def schedule(self, dtype: torch.dtype, rows_are_nodes: bool = False) -> Schedule:
        """The schedule for kernels whose rows are nodes (CSR convolution) or edges / batch rows."""
        size = torch.empty((), dtype=dtype).element_size()
        key = (size, rows_are_nodes)
        if key not in self._schedules:
            fwd, bwd = default_chunks(self.problem, size, rows_are_nodes)
            # Sweep knobs (benchmarks/sweep_chunks.py) override the defaults.
            fwd = int(os.environ.get("CGFORGE_FORWARD_CHUNK", fwd))
            bwd = int(os.environ.get("CGFORGE_BACKWARD_CHUNK", bwd))
            self._schedules[key] = build_schedule(self.problem, itemsize=size, max_chunk=fwd, max_chunk_backward=bwd)
        return self._schedules[key]

    def kernel(self, dtype: torch.dtype, layout: Layout, backward: bool, device: torch.device):
        """The launchable forward or backward kernel of this layout, compiled on first use."""
        key = (dtype, layout, backward, device.index)
        handle = self._kernels.get(key)
        if handle is None:
            from .compiler import compile_cubin
            from .runtime import device_arch, load_kernels

            source, name = render(self.schedule(dtype, layout.csr), _SCALAR[dtype], layout,
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
