"""The kernel generator: problem -> sparse CG -> schedule -> program -> CUDA source -> NVRTC -> launch.

core/ is shared by every op; tensor_product/, convolution/ and symmetric_contraction/ each supply only
problem -> schedule -> program. ``python -m cgforge.kernels.explain`` prints the stages for one problem.
kernels/ knows no model: ``SymmetricContraction`` (MACE's layout over the symmetric-contraction kernels)
lives in cgforge.patches.mace and is reachable here, imported on first use, under its old public name.
"""

from .convolution import ConvGraph, Convolution, streaming_convolution, streaming_edge_convolution
from .core.errors import KernelError, SharedMemoryError, UnknownKernelKeyError, UnsupportedProblemError
from .core.tuning import SCTuning, TPTuning
from .symmetric_contraction import SCProblem, SymmetricContractionBase, moved_names
from .tensor_product import Instruction, TensorProduct, TPProblem

# cgforge.kernels.SymmetricContraction: the public name of cgforge.patches.mace.SymmetricContraction
__getattr__ = moved_names(__name__, ("SymmetricContraction",))

__all__ = ["ConvGraph", "Convolution", "Instruction", "KernelError", "SCProblem", "SCTuning", "SharedMemoryError",
           "SymmetricContraction", "SymmetricContractionBase", "TPProblem", "TPTuning", "TensorProduct",
           "UnknownKernelKeyError", "UnsupportedProblemError", "streaming_convolution", "streaming_edge_convolution"]
