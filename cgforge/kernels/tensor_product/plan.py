"""A registered tensor-product problem: its tuning, schedules per dtype and row kind, kernels per layout."""

from __future__ import annotations

import torch

from ..core.registry import KernelCache, Registry, itemsize, scalar_name
from ..core.tuning import TPTuning
from .codegen import render
from .layout import Layout
from .problem import TPProblem
from .schedule import Schedule, build_schedule


class Plan:
    def __init__(self, problem: TPProblem, tuning: TPTuning):
        self.problem = problem
        self.tuning = tuning
        self._schedules: dict[tuple[int, bool], Schedule] = {}
        self._kernels = KernelCache()

    def schedule(self, dtype: torch.dtype, rows_are_nodes: bool = False) -> Schedule:
        """The schedule for kernels whose rows are nodes (CSR convolution) or edges / batch rows."""
        key = (itemsize(dtype), rows_are_nodes)
        if key not in self._schedules:
            self._schedules[key] = build_schedule(self.problem, itemsize=key[0], tuning=self.tuning,
                                                  rows_are_nodes=rows_are_nodes)
        return self._schedules[key]

    def source(self, dtype: torch.dtype, layout: Layout, backward: bool) -> tuple[str, str]:
        """CUDA source of the forward or backward kernel of this layout, and its function name."""
        source, name = render(self.schedule(dtype, layout.csr), scalar_name(dtype), layout,
                              forward=not backward, backward=backward)
        return source, f"{name}_{'backward' if backward else 'forward'}"

    def kernel(self, dtype: torch.dtype, layout: Layout, backward: bool, device: torch.device):
        """The launchable forward or backward kernel of this layout, compiled on first use."""
        return self._kernels.get((layout, backward), dtype, device, lambda: self.source(dtype, layout, backward))


PLANS: Registry[Plan] = Registry("tp", "TensorProduct/Convolution")


def register(problem: TPProblem, tuning: TPTuning | None = None) -> str:
    """The key of (problem, tuning); no tuning: ``TPTuning.from_env()`` (the sweep variables), read now."""
    tuning = tuning if tuning is not None else TPTuning.from_env()
    text = problem.key() if tuning == TPTuning() else f"{problem.key()}|{tuning.key()}"  # default keys as before
    return PLANS.register(text, lambda: Plan(problem, tuning))


def get(key: str) -> Plan:
    return PLANS.get(key)
