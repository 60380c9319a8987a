"""``python -m cgforge.cli``: the same command line as ``cgforge``."""

import sys

from cgforge.cli import main

sys.exit(main())
