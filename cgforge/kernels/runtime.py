"""Old import path of `cgforge.kernels.core.runtime`: the same module object."""

import sys

from .core import runtime

sys.modules[__name__] = runtime
