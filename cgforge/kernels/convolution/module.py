"""`Convolution`: out[i] = sum over edges e with receiver i of TP(x[sender e], y_e, W_e), fused.

No per-edge output tensor is materialised, forward or backward.
"""

from __future__ import annotations

import torch

from ..core.checks import check_features, check_same, check_weights
from ..tensor_product import plan as plans
from ..tensor_product.layout import CONV_BACKWARD, CONV_FORWARD, CONV_FORWARD_SORTED
from ..tensor_product.module import TensorProduct
from . import ops
from .graph import ConvGraph


class Convolution(TensorProduct):
    """Same constructor as `TensorProduct` (and `from_e3nn`); called with a `ConvGraph`."""

    def forward(self, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,  # type: ignore[override]
                graph: ConvGraph) -> torch.Tensor:
        if not isinstance(graph, ConvGraph):
            raise TypeError(f"graph must be a cgforge ConvGraph, got {type(graph).__name__}")
        in1, in2, numel, shared = self._dims
        check_features("x", x, in1, rows=graph.num_nodes)
        check_features("y", y, in2, rows=graph.num_edges)
        check_weights(weight, numel, shared, graph.num_edges)
        check_same({"x": x, "y": y, "weight": weight})
        if graph.device != x.device:
            raise ValueError(f"graph is on {graph.device} but x is on {x.device}")
        return ops.conv_forward(x, y, weight, *graph.tensors(), self.key, graph.deterministic)

    def compile_kernels(self, device: torch.device | str, dtype: torch.dtype) -> None:
        device = torch.device(device)
        if device.type != "cuda":
            return
        plan = plans.get(self.key)
        for layout, backward in ((CONV_FORWARD, False), (CONV_FORWARD_SORTED, False), (CONV_BACKWARD, True)):
            plan.kernel(dtype, layout, backward, device)
