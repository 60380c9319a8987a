"""The tensor product: problem -> schedule -> program -> codegen -> plan -> launch -> ops -> module
(``TensorProduct``); evaluate.py runs a program on a CPU, reference.py is the torch reference.
"""

from .module import TensorProduct
from .problem import Instruction, TPProblem

__all__ = ["Instruction", "TPProblem", "TensorProduct"]
