"""The fused convolution: the tensor product's problem, schedule and program run over a graph's edges.

No problem, schedule or program of its own: a ``Convolution`` registers a ``TPProblem`` (the same plan as a
``TensorProduct``) and its ops launch the tensor product's generated kernels in the graph layouts
(``tensor_product.layout``: CSR rows over receivers or senders, atomics over edges) through
``tensor_product.launch``. What it adds: the graph (graph.py: ``ConvGraph``, ``GraphTensors``), the custom ops
over it (ops.py; table_ops.py with the weights read from a radial table; table_rows.py with the output and the
row map after it made by ranges of receivers) and the edge-chunked streaming path (streaming.py).
"""

from .graph import ConvGraph, GraphTensors
from .module import Convolution
from .streaming import chunk_ranges, streaming_convolution, streaming_edge_convolution

__all__ = ["ConvGraph", "Convolution", "GraphTensors", "chunk_ranges", "streaming_convolution",
           "streaming_edge_convolution"]
