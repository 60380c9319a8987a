"""Molecular dynamics: :func:`run_md` (the engine on the device, or ASE's dynamics), the engine and its
integrators, trajectories and restarts, progress and plots.

    from cgforge.plugin.md import run_md, Engine
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "run_md": "run",
    "MDSummary": "run",
    "MDInterrupted": "run",
    "MDInstabilityError": "checks",
    "Restart": "files",
    "read_restart": "files",
    "read_structure": "files",
    "Engine": "engine",
    "MDBlowUp": "engine",
    "EngineOptions": "options",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
