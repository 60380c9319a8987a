"""The symmetric contraction (a product basis): problem -> schedule (a reduced basis) -> program (core statements).

problem.py (SCProblem: irreps, correlation, species count and the U tensors as values) -> schedule.py
(basis chains, weight transform) -> program.py (statements) -> codegen.py -> ops.py (plan, custom ops)
-> module.py (SymmetricContractionBase: a module over weights a subclass lays out). reference.py: the
definition and a torch interpreter of the schedule. Model knowledge (MACE's U tensors and state-dict
layout) lives in cgforge/patches/mace/symmetric_contraction.py (``cgforge.patches.mace.SymmetricContraction``).
"""

from .module import SymmetricContractionBase
from .problem import SCProblem

__all__ = ["SCProblem", "SymmetricContractionBase"]
