"""The ASE side of cgforge: the runtime, the ASE calculator, MD, water boxes, the ``cgforge`` command line and
LAMMPS (docs/architecture.md's package table).

    from cgforge.plugin import Calculator, run_md, water_box

Names are imported on first use, so ``import cgforge.plugin.runtime.neighbours`` stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Calculator": "calculator",
    "evaluate_batch": "batch",
    "BatchStructureError": "batch",
    "relax_batch": "relax",
    "run_md_batch": "batch_md",
    "torchsim_model": "torchsim",
    "FireParameters": "relax",
    "NonFiniteOutputError": "calculator",
    "run_md": "md.run",
    "water_box": "water",
    "Engine": "md.engine",
    "MDBlowUp": "md.engine",
    "EngineOptions": "md.options",
    "VerletNeighbourList": "runtime.neighbours",
    "neighbour_list": "runtime.neighbours",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
