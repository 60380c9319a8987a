"""``python -m cgforge.plugin.cli``: the same command line as ``cgforge``."""

import sys

from cgforge.plugin.cli import main

sys.exit(main())
