"""The kernel generator: problem -> sparse CG -> schedule -> program -> CUDA source -> NVRTC -> launch.

core/ is shared by every op; tensor_product/, convolution/ and symmetric_contraction/ each supply only
problem -> schedule -> program. ``python -m cgforge.kernels.explain`` prints the stages for one problem.
"""

from .convolution import ConvGraph, Convolution, streaming_convolution
from .core.errors import KernelError, SharedMemoryError, UnknownKernelKeyError, UnsupportedProblemError
from .core.tuning import SCTuning, TPTuning
from .symmetric_contraction import SymmetricContraction
from .tensor_product import Instruction, TensorProduct, TPProblem

__all__ = ["ConvGraph", "Convolution", "Instruction", "KernelError", "SCTuning", "SharedMemoryError",
           "SymmetricContraction", "TPProblem", "TPTuning", "TensorProduct", "UnknownKernelKeyError",
           "UnsupportedProblemError", "streaming_convolution"]
