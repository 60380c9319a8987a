"""The command line: ``cgforge patch | unpatch | md | lammps-model | doctor`` (``commands``), the options of
``cgforge md`` (``md``) and the environment check (``doctor``)."""

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
