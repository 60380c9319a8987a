"""Old import paths of modules and names that moved, kept working with a ``DeprecationWarning`` naming the new
place. One table, one import hook: nothing else in the package keeps an alias.

``import cgforge.plugin.engine`` imports ``cgforge.plugin.md.engine`` and registers it under the old name too,
so ``from cgforge.plugin.engine import Engine`` and pickles that name the old module both keep working.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType
from typing import Any

# old module path -> new module path (moved in 0.2, when the plugin was split by job)
MOVED_MODULES: dict[str, str] = {
    "cgforge.plugin.inputs": "cgforge.plugin.runtime.adapters",
    "cgforge.plugin.neighbours": "cgforge.plugin.runtime.neighbours",
    "cgforge.plugin.edge_layout": "cgforge.plugin.runtime.edge_layout",
    "cgforge.plugin.edge_vectors": "cgforge.plugin.runtime.edge_vectors",
    "cgforge.plugin.step_graph": "cgforge.plugin.runtime.step_graph",
    "cgforge.plugin.compiled": "cgforge.plugin.runtime.compiled",
    "cgforge.plugin.memory_plan": "cgforge.plugin.runtime.memory_plan",
    "cgforge.plugin.atom_order": "cgforge.plugin.runtime.atom_order",
    "cgforge.plugin.bundled": "cgforge.plugin.runtime.bundled",
    "cgforge.plugin.engine": "cgforge.plugin.md.engine",
    "cgforge.plugin.engine_forces": "cgforge.plugin.md.forces",
    "cgforge.plugin.engine_rng": "cgforge.plugin.md.noise",
    "cgforge.plugin.integrators": "cgforge.plugin.md.integrators",
    "cgforge.plugin.md_dynamics": "cgforge.plugin.md.dynamics",
    "cgforge.plugin.md_options": "cgforge.plugin.md.options",
    "cgforge.plugin.md_files": "cgforge.plugin.md.files",
    "cgforge.plugin.md_checks": "cgforge.plugin.md.checks",
    "cgforge.plugin.md_plot": "cgforge.plugin.md.plot",
    "cgforge.plugin.md_cli": "cgforge.cli.md",
    "cgforge.doctor": "cgforge.cli.doctor",
}

# (package, name) -> module that now defines the name: names a package re-exported from a module that moved away
MOVED_NAMES: dict[tuple[str, str], str] = {
    ("cgforge.plugin.md", name): "cgforge.cli.md"
    for name in ("add_md_arguments", "prepare_md", "run_from_args", "relax_structure", "model_banner")
}


def _warn(old: str, new: str) -> None:
    warnings.warn(f"{old} moved to {new}; the old name will be removed in a later release",
                  DeprecationWarning, stacklevel=4)


def moved_attribute(package: str, name: str) -> Any:
    """The value of ``package.name`` for a name that moved (with a warning), or AttributeError."""
    new = MOVED_NAMES.get((package, name))
    if new is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    _warn(f"{package}.{name}", f"{new}.{name}")
    return getattr(importlib.import_module(new), name)


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        _warn(spec.name, self.new)
        return importlib.import_module(self.new)

    def exec_module(self, module: ModuleType) -> None:
        pass  # the new module ran when it was imported


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        new = MOVED_MODULES.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(new))


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (``import cgforge`` does this)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
