"""The symmetric contraction (a product basis): problem -> schedule (a reduced basis) -> program (core statements).

problem.py (SCProblem: irreps, correlation, species count and the U tensors as values) -> schedule.py
(basis chains, weight transform) -> program.py (statements) -> codegen.py -> ops.py (plan, custom ops)
-> module.py (SymmetricContractionBase: a module over weights a subclass lays out). reference.py: the
definition and a torch interpreter of the schedule. Model knowledge (MACE's U tensors and state-dict
layout) lives in cgforge/patches/mace/symmetric_contraction.py.
"""

from .module import MOVED, SymmetricContractionBase, moved_names
from .problem import SCProblem

# SymmetricContraction, _Contraction and _rebuild_after_load: pickles of patched models name them at this
# path; they moved to cgforge.patches.mace.symmetric_contraction and resolve from here on first use.
__getattr__ = moved_names(__name__, tuple(MOVED))

__all__ = ["SCProblem", "SymmetricContractionBase"]
