"""Old import path of `cgforge.patches.mace.legacy`: the same module object (patching one patches both)."""

import sys

from .mace import legacy

sys.modules[__name__] = legacy
