"""Exception classes of the kernel generator (each also derives from the builtin it replaced): callers catch a
class, never parse a message.
"""

from __future__ import annotations

from .compiler import KernelError


class UnsupportedProblemError(KernelError, ValueError):
    """The kernels cannot do this problem (an irrep above the supported l, a mode, a selection rule)."""


class SharedMemoryError(UnsupportedProblemError):
    """No channel chunk fits one warp's operands into the block's shared memory."""


class UnknownKernelKeyError(KernelError, KeyError):
    """A problem key that was not registered in this process (build the module first)."""

    def __str__(self) -> str:  # KeyError quotes its argument; this one is a sentence
        return str(self.args[0]) if self.args else ""
