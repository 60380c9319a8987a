"""The symmetric contraction (a product basis): problem -> schedule (a reduced basis) -> program (core statements)
-> codegen -> ops (plan, custom ops) -> module (``SymmetricContractionBase``); reference.py: the definition and a
torch interpreter. MACE's U tensors and layout: ``cgforge.patches.mace.SymmetricContraction``.
"""

from .module import SymmetricContractionBase
from .problem import SCProblem

__all__ = ["SCProblem", "SymmetricContractionBase"]
