"""The kernel generator: problem -> sparse CG -> schedule -> program -> CUDA source -> NVRTC -> launch.

core/ is shared by every op (registry -> compiler -> runtime: the one compile path of every kernel, also the
fixed sources of segment_sum, radial_table and noise); tensor_product/ and symmetric_contraction/ each supply
problem -> schedule -> program; convolution/ runs the tensor product's problem, schedule and program over a
graph's edges (its own: the graph, the layouts' ops and the row-chunked table path). Every knob is a typed value
(``TPTuning``, ``SCTuning``) passed as ``tuning=``. ``python -m cgforge.kernels.explain`` prints the stages for
one problem. kernels/ knows no model and imports nothing above it: MACE's symmetric contraction (its U tensors
and state-dict layout over ``SymmetricContractionBase``) is ``cgforge.patches.mace.SymmetricContraction``.
"""

from .convolution import ConvGraph, Convolution, streaming_convolution, streaming_edge_convolution
from .core.errors import KernelError, SharedMemoryError, UnknownKernelKeyError, UnsupportedProblemError
from .core.tuning import KernelTuning, RowPolicy, SCTuning, TPTuning
from .symmetric_contraction import SCProblem, SymmetricContractionBase
from .tensor_product import Instruction, TensorProduct, TPProblem

__all__ = ["ConvGraph", "Convolution", "Instruction", "KernelError", "KernelTuning", "RowPolicy", "SCProblem",
           "SCTuning",
           "SharedMemoryError", "SymmetricContractionBase", "TPProblem", "TPTuning", "TensorProduct",
           "UnknownKernelKeyError", "UnsupportedProblemError", "streaming_convolution", "streaming_edge_convolution"]
