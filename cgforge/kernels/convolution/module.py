"""`Convolution`: out[i] = sum over edges e with receiver i of TP(x[sender e], y_e, W_e), fused.

No per-edge output tensor is materialised, forward or backward.
"""

from __future__ import annotations

import torch

from ..core.checks import check_features, check_same, check_weights
from ..radial_table.ops import check_table
from ..tensor_product import plan as plans
from ..tensor_product.layout import CONV_BACKWARD, CONV_FORWARD, CONV_FORWARD_SORTED
from ..tensor_product.module import TensorProduct
from . import ops, table_ops, table_rows
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

    def forward_table(self, x: torch.Tensor, y: torch.Tensor, lengths: torch.Tensor, coeffs: torch.Tensor,
                      r_max: float, graph: ConvGraph) -> torch.Tensor:
        """``forward(x, y, radial_table(lengths, coeffs, r_max), graph)`` with the table read inside the kernels:
        no [E, weight_numel] weights, forward or backward (``table_ops``). lengths [E] or [E, 1]; coeffs
        [intervals, weight_numel, 4], constants. Differentiable in x, y and the lengths."""
        self._check_table_call(x, y, lengths, coeffs, r_max, graph)
        lengths = lengths.squeeze(1) if lengths.dim() == 2 else lengths
        return table_ops.conv_table_forward(x, y, lengths, coeffs, *graph.tensors(), float(r_max), self.key,
                                            graph.deterministic)

    def _check_table_call(self, x: torch.Tensor, y: torch.Tensor, lengths: torch.Tensor, coeffs: torch.Tensor,
                          r_max: float, graph: ConvGraph) -> None:
        if not isinstance(graph, ConvGraph):
            raise TypeError(f"graph must be a cgforge ConvGraph, got {type(graph).__name__}")
        in1, in2, numel, shared = self._dims
        if shared:
            raise ValueError("forward_table: a radial table gives per-edge weights; this convolution shares them")
        check_features("x", x, in1, rows=graph.num_nodes)
        check_features("y", y, in2, rows=graph.num_edges)
        if lengths.dim() == 2 and lengths.shape[1] == 1:
            lengths = lengths.squeeze(1)
        if lengths.shape != (graph.num_edges,):
            raise ValueError(f"lengths: expected [{graph.num_edges}] or [{graph.num_edges}, 1], got "
                             f"{list(lengths.shape)}")
        check_table(coeffs, r_max, columns=numel)
        check_same({"x": x, "y": y, "lengths": lengths, "coeffs": coeffs})
        if graph.device != x.device:
            raise ValueError(f"graph is on {graph.device} but x is on {x.device}")

    def forward_table_rows(self, x: torch.Tensor, y: torch.Tensor, lengths: torch.Tensor, coeffs: torch.Tensor,
                           r_max: float, graph: ConvGraph, out_fn: table_rows.RowMap, chunk_rows: int) -> torch.Tensor:
        """``out_fn(forward_table(x, y, lengths, coeffs, r_max, graph))`` made ``chunk_rows`` receiver rows at a time
        (``table_rows``); ``out_fn``: an affine row map with constant parameters; a deterministic graph."""
        if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
            raise ValueError(f"chunk_rows must be a positive int, got {chunk_rows!r}")
        if not callable(out_fn):
            raise TypeError(f"out_fn must be a callable row map, got {type(out_fn).__name__}")
        self._check_table_call(x, y, lengths, coeffs, r_max, graph)
        if not graph.deterministic:
            raise ValueError("forward_table_rows needs a deterministic ConvGraph (CSR rows)")
        lengths = lengths.squeeze(1) if lengths.dim() == 2 else lengths
        return table_rows.conv_table_rows(x, y, lengths, coeffs, tuple(graph.tensors()), float(r_max), self.key,
                                          self.irreps_out.dim, out_fn, chunk_rows)

    def compile_kernels(self, device: torch.device | str, dtype: torch.dtype, table: bool = False) -> None:
        """Compile the kernels now (``table``: those of ``forward_table`` too)."""
        device = torch.device(device)
        if device.type != "cuda":
            return
        plan = plans.get(self.key)
        for layout, backward in ((CONV_FORWARD, False), (CONV_FORWARD_SORTED, False), (CONV_BACKWARD, True)):
            plan.kernel(dtype, layout, backward, device)
            if table:
                plan.kernel(dtype, layout.with_table(), backward, device)
