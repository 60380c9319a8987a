"""The problem set now lives in the package: ``cgforge.kernels.problem_set``. This name stays for scripts that put
benchmarks/ on sys.path and ``import problems`` (examples/tensor_product.py); new code imports the package module."""

from cgforge.kernels.problem_set import MODEL_LAYERS, PROBLEMS, channelwise, fully_connected

__all__ = ["MODEL_LAYERS", "PROBLEMS", "channelwise", "fully_connected"]
