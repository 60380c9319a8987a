"""The ``cgforge`` command line (``commands``; a module per larger subcommand: ``md``, ``relax``, ``doctor``...)."""

from .commands import (
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_TERMINATED,
    EXIT_UNSTABLE,
    EXIT_USAGE,
    build_parser,
    main,
    run_guarded,
)

__all__ = ["main", "build_parser", "run_guarded", "EXIT_OK", "EXIT_ERROR", "EXIT_USAGE", "EXIT_UNSTABLE",
           "EXIT_INTERRUPTED", "EXIT_TERMINATED"]
