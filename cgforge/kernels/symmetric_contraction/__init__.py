"""MACE's symmetric contraction: problem -> schedule (a reduced basis) -> program (core statements).

problem.py (SCProblem, MACE's U tensors) -> schedule.py (basis chains, weight transform) -> program.py
(statements) -> codegen.py -> ops.py (plan, custom ops) -> module.py (SymmetricContraction, MACE's
state-dict layout). reference.py: the definition and a torch interpreter of the schedule.
"""

# _Contraction and _rebuild_after_load: pickles of patched models name them at this path.
from .module import SymmetricContraction, _Contraction, _rebuild_after_load

__all__ = ["SymmetricContraction", "_Contraction", "_rebuild_after_load"]
