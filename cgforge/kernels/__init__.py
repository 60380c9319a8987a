"""The kernel generator: problem -> sparse CG -> schedule -> CUDA source -> NVRTC -> launch."""

from .convolution import Convolution
from .graph import ConvGraph
from .problem import Instruction, TPProblem
from .symmetric_contraction import SymmetricContraction
from .tensor_product import TensorProduct

__all__ = ["ConvGraph", "Convolution", "Instruction", "SymmetricContraction", "TPProblem", "TensorProduct"]
