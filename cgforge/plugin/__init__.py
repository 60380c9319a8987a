"""The ASE side of cgforge: the calculator, the GPU neighbour list, water boxes and MD.

    from cgforge.plugin import Calculator, run_md, water_box

Names are imported on first use, so ``import cgforge.plugin.neighbours`` stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Calculator": "calculator",
    "NonFiniteOutputError": "calculator",
    "run_md": "md",
    "water_box": "water",
    "Engine": "engine",
    "MDBlowUp": "engine",
    "VerletNeighbourList": "neighbours",
    "neighbour_list": "neighbours",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
