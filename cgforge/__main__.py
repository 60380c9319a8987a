"""``python -m cgforge``: the same command line as ``cgforge``."""

import sys

from cgforge.plugin.cli import main

sys.exit(main())
