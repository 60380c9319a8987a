"""A registered tensor-product problem: its tuning, schedules per dtype and row kind, kernels per layout (and
the CSR backward's launch bound per architecture, chosen from its compile report)."""

from __future__ import annotations

import torch

from ..core import occupancy
from ..core.registry import KernelCache, Registry, compile_source, itemsize, scalar_name
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
        self._min_blocks: dict[tuple, int | None] = {}

    def schedule(self, dtype: torch.dtype, rows_are_nodes: bool = False) -> Schedule:
        """The schedule for kernels whose rows are nodes (CSR convolution) or edges / batch rows."""
        key = (itemsize(dtype), rows_are_nodes)
        if key not in self._schedules:
            self._schedules[key] = build_schedule(self.problem, itemsize=key[0], tuning=self.tuning,
                                                  rows_are_nodes=rows_are_nodes)
        return self._schedules[key]

    def source(self, dtype: torch.dtype, layout: Layout, backward: bool,
               min_blocks: int | None = None) -> tuple[str, str]:
        """CUDA source of the forward or backward kernel of this layout, and its function name; `min_blocks`:
        the backward's launch bound (``backward_min_blocks``)."""
        source, name = render(self.schedule(dtype, layout.csr), scalar_name(dtype), layout,
                              forward=not backward, backward=backward, backward_min_blocks=min_blocks)
        return source, f"{name}_{'backward' if backward else 'forward'}"

    def backward_min_blocks(self, dtype: torch.dtype, layout: Layout, arch: str) -> int | None:
        """The launch bound of this layout's backward on `arch`: the tuning's, or for ``auto`` on a CSR
        backward (the convolution's) the occupancy rule of ``core.occupancy`` (compiles with NVRTC; no GPU)."""
        setting = self.tuning.backward_min_blocks
        if setting != "auto":
            return setting or None
        if not layout.csr:
            return None  # measured on the convolution's backward only
        key = (dtype, layout, arch)
        if key not in self._min_blocks:
            launch = self.schedule(dtype, layout.csr).backward_launch
            threads = 32 * launch.warps_per_block
            shared = launch.warps_per_block * launch.smem_per_warp * itemsize(dtype)

            def compile_with(min_blocks: int | None):
                source, function = self.source(dtype, layout, True, min_blocks)
                return compile_source(source, function, arch).resources(function)

            self._min_blocks[key] = occupancy.choose_min_blocks(occupancy.sm_limits(arch), threads, shared,
                                                                compile_with)
        return self._min_blocks[key]

    def kernel(self, dtype: torch.dtype, layout: Layout, backward: bool, device: torch.device):
        """The launchable forward or backward kernel of this layout, compiled on first use."""
        def source() -> tuple[str, str]:
            from ..core.runtime import device_arch

            bound = self.backward_min_blocks(dtype, layout, device_arch(device)) if backward else None
            return self.source(dtype, layout, backward, bound)

        return self._kernels.get((layout, backward), dtype, device, source)


PLANS: Registry[Plan] = Registry("tp", "TensorProduct/Convolution")


def register(problem: TPProblem, tuning: TPTuning | None = None) -> str:
    """The key of (problem, tuning); no tuning: the defaults (``TPTuning()``)."""
    tuning = tuning if tuning is not None else TPTuning()
    text = problem.key() if tuning == TPTuning() else f"{problem.key()}|{tuning.key()}"  # default keys as before
    return PLANS.register(text, lambda: Plan(problem, tuning))


def get(key: str) -> Plan:
    return PLANS.get(key)
