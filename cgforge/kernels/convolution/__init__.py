"""The fused convolution: the tensor product's program over a graph's edges (graph.py: ConvGraph)."""

from .graph import ConvGraph, GraphTensors
from .module import Convolution
from .streaming import chunk_ranges, streaming_convolution, streaming_edge_convolution

__all__ = ["ConvGraph", "Convolution", "GraphTensors", "chunk_ranges", "streaming_convolution",
           "streaming_edge_convolution"]
