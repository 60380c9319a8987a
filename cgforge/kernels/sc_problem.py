"""Old import path of the symmetric-contraction problem, kept: pickles of patched models name it."""

from .symmetric_contraction.problem import SCProblem

__all__ = ["SCProblem"]
