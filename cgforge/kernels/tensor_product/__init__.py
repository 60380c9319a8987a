"""The tensor product: problem -> schedule -> program (the rest is the kernel core).

problem.py (TPProblem: e3nn's conventions) -> schedule.py (segments, chunks, shared memory, tuning)
-> program.py (the CG statements) -> codegen.py (template + program = CUDA) -> plan.py (compile, cache)
-> launch.py (grid, window, launches over any layout: also the convolution's) -> ops.py (custom ops)
-> module.py (TensorProduct). evaluate.py runs a program on CPU; reference.py is
the torch reference (the CPU path and the oracle).
"""

from .module import TensorProduct
from .problem import Instruction, TPProblem

__all__ = ["Instruction", "TPProblem", "TensorProduct"]
