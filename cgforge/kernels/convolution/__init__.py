"""The fused convolution: the tensor product's problem, schedule and program run over a graph's edges.

A ``Convolution`` registers a ``TPProblem`` and launches the tensor product's kernels in the graph layouts
(``tensor_product.layout``). Here: the graph (graph.py), its custom ops (ops.py; table_ops.py, weights from a
radial table; table_rows.py, by ranges of receivers) and the edge-chunked streaming path (streaming.py).
"""

from .graph import ConvGraph, GraphTensors
from .module import Convolution
from .streaming import chunk_ranges, streaming_convolution, streaming_edge_convolution

__all__ = ["ConvGraph", "Convolution", "GraphTensors", "chunk_ranges", "streaming_convolution",
           "streaming_edge_convolution"]
