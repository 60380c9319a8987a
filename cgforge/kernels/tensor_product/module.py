"""`TensorProduct`: a drop-in for `e3nn.o3.TensorProduct(..., internal_weights=False)`."""

from __future__ import annotations

from typing import Any

import torch

from ..core.checks import check_features, check_same, check_weights
from ..core.tuning import TPTuning
from . import ops
from . import plan as plans
from .layout import TP_LAYOUT
from .problem import TPProblem

# The kernels index inside one row (channel and weight offsets, staged counts) with 32-bit ints; rows
# themselves are counted with 64-bit ints.
MAX_ROW_ELEMENTS = 2**31 - 1


def check_row_sizes(problem: TPProblem) -> None:
    """Refuse a problem whose rows (in1, in2, out or per-row weights) overflow a 32-bit index."""
    for name, size in (("irreps_in1", problem.irreps_in1.dim), ("irreps_in2", problem.irreps_in2.dim),
                       ("irreps_out", problem.irreps_out.dim), ("weight_numel", problem.weight_numel)):
        if size > MAX_ROW_ELEMENTS:
            raise ValueError(f"{name} has {size} elements per row; the kernels index inside a row with 32-bit "
                             f"ints, so at most {MAX_ROW_ELEMENTS} are supported")


class TensorProduct(torch.nn.Module):
    """out = TP(x, y, weight) with e3nn's layout, weight order and normalisation: the generated kernels on CUDA, the
    torch reference on a CPU. ``tuning``: the kernels' ``TPTuning`` (None: the defaults)."""

    tuning: TPTuning | None = None  # a class default: modules pickled before tuning existed have none

    def __init__(self, irreps_in1: Any, irreps_in2: Any, irreps_out: Any, instructions: list,
                 shared_weights: bool = False, irrep_normalization: str = "component",
                 path_normalization: str = "element", *, problem: TPProblem | None = None,
                 tuning: TPTuning | None = None):
        super().__init__()
        self.tuning = tuning
        if problem is None:
            problem = TPProblem.build(irreps_in1, irreps_in2, irreps_out, instructions, shared_weights,
                                      irrep_normalization, path_normalization)
        check_row_sizes(problem)
        self.problem = problem
        self.key = plans.register(problem, tuning)
        # plain ints for the checks, so torch.compile guards on nothing but these
        self._dims = (problem.irreps_in1.dim, problem.irreps_in2.dim, problem.weight_numel, problem.shared_weights)

    @classmethod
    def from_e3nn(cls, tp: Any, tuning: TPTuning | None = None) -> TensorProduct:
        if getattr(tp, "internal_weights", False):
            raise ValueError("from_e3nn needs a TensorProduct with internal_weights=False "
                             "(pass the weights to forward)")
        return cls(None, None, None, [], problem=TPProblem.from_e3nn(tp), tuning=tuning)

    irreps_in1 = property(lambda self: self.problem.irreps_in1)
    irreps_in2 = property(lambda self: self.problem.irreps_in2)
    irreps_out = property(lambda self: self.problem.irreps_out)
    weight_numel = property(lambda self: self.problem.weight_numel)
    shared_weights = property(lambda self: self.problem.shared_weights)

    def __setstate__(self, state: dict) -> None:  # unpickled in a new process: register again
        super().__setstate__(state)
        self.key = plans.register(self.problem, self.tuning)

    def forward(self, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        in1, in2, numel, shared = self._dims
        check_features("x", x, in1)
        check_features("y", y, in2, rows=x.shape[0])
        check_weights(weight, numel, shared, x.shape[0])
        check_same({"x": x, "y": y, "weight": weight})
        return ops.tp_forward(x, y, weight, self.key)

    def compile_kernels(self, device: torch.device | str, dtype: torch.dtype) -> None:
        """Compile (or load from cache) the CUDA kernels now rather than at the first call."""
        device = torch.device(device)
        if device.type == "cuda":
            plan = plans.get(self.key)
            for backward in (False, True):
                plan.kernel(dtype, TP_LAYOUT, backward, device)

    def extra_repr(self) -> str:
        p = self.problem
        return (f"{p.irreps_in1} x {p.irreps_in2} -> {p.irreps_out}, {len(p.instructions)} paths, "
                f"weight_numel={p.weight_numel}, shared_weights={p.shared_weights}")
