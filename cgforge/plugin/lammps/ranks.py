"""How many MPI ranks run this LAMMPS process's job, as its launcher's environment variables say.

One-rank exchange mode skips the exchanges inside the model, which every rank must do or none (they are collective),
and ML-IAP's data object does not give the rank count. A process no launcher started is one rank; Slurm's
``SLURM_NTASKS`` may count more than run, which errs to the safe side (the shortcut off).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["RANK_VARIABLES", "SIZE_VARIABLES", "launcher_rank", "launcher_ranks"]

SIZE_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MV2_COMM_WORLD_SIZE", "SLURM_NTASKS")
RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK", "SLURM_PROCID")


def launcher_ranks(environ: Mapping[str, str] | None = None) -> int:
    """The largest rank count the launcher variables in ``environ`` (default: this process's) give, 1 when none is
    set; a variable that is not a positive integer is skipped."""
    values = [(os.environ if environ is None else environ).get(name, "").strip() for name in SIZE_VARIABLES]
    return max((int(v) for v in values if v.isdigit() and int(v) > 0), default=1)


def launcher_rank(environ: Mapping[str, str] | None = None) -> int:
    """This process's rank as the first launcher variable of ``environ`` that is a number says, 0 when none is set
    (a label only: the timers' table written at exit, when LAMMPS can no longer be asked)."""
    values = [(os.environ if environ is None else environ).get(name, "").strip() for name in RANK_VARIABLES]
    return next((int(v) for v in values if v.isdigit()), 0)
