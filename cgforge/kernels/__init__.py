"""The kernel generator: problem -> sparse CG -> schedule -> program -> CUDA source -> NVRTC -> launch.

core/ is shared by every op; tensor_product/ and symmetric_contraction/ supply problem -> schedule -> program;
convolution/ runs the tensor product over a graph's edges. Knobs are typed values (``TPTuning``, ``SCTuning``)
passed as ``tuning=``. kernels/ knows no model (MACE's contraction is ``cgforge.patches.mace``).
"""

from .convolution import ConvGraph, Convolution, streaming_convolution, streaming_edge_convolution
from .core.errors import KernelError, SharedMemoryError, UnknownKernelKeyError, UnsupportedProblemError
from .core.tuning import KernelTuning, RowPolicy, SCTuning, TPTuning
from .symmetric_contraction import SCProblem, SymmetricContractionBase
from .tensor_product import Instruction, TensorProduct, TPProblem

__all__ = ["ConvGraph", "Convolution", "Instruction", "KernelError", "KernelTuning", "RowPolicy", "SCProblem",
           "SCTuning", "SharedMemoryError", "SymmetricContractionBase", "TPProblem", "TPTuning", "TensorProduct",
           "UnknownKernelKeyError", "UnsupportedProblemError", "streaming_convolution", "streaming_edge_convolution"]
