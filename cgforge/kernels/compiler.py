"""Old import path of `cgforge.kernels.core.compiler`: the same module object (patching one patches both)."""

import sys

from .core import compiler

sys.modules[__name__] = compiler
