"""Old import path of the tensor-product problem, kept: pickles of patched models name it."""

from .tensor_product.problem import Instruction, TPProblem

__all__ = ["Instruction", "TPProblem"]
