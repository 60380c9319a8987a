"""The patches layer's package layout: no module imports a private name of another cgforge package, and no alias
module of a never-released layout is left (the class paths saved patched models name are
``cgforge._moved.PICKLED_CLASSES``, tested in tests/test_pickle_contract.py)."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _imported_from(path: Path) -> list[tuple[str, str]]:
    """(absolute module, name) of every ``from ... import name`` in the file, relative imports resolved."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    package = parts if parts[-1] == "__init__" else parts[:-1]
    package = [p for p in package if p != "__init__"]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found += [(module, alias.name) for alias in node.names]
    return found


def test_no_alias_modules_of_unreleased_layouts() -> None:
    assert not (ROOT / "cgforge" / "patches" / "mace_legacy.py").exists()
    assert importlib.util.find_spec("cgforge.patches.mace_legacy") is None
    from cgforge.patches import nequip

    assert not hasattr(nequip, "_check_dtype")


def test_no_module_imports_a_private_name_of_another_package() -> None:
    offenders = []
    for path in (ROOT / "cgforge").rglob("*.py"):
        own = path.relative_to(ROOT).parts[1]  # kernels, patches, plugin (or a top-level module)
        for module, name in _imported_from(path):
            parts = module.split(".")
            if parts[0] == "cgforge" and len(parts) > 1 and parts[1] != own and name.startswith("_") \
                    and not name.startswith("__"):
                offenders.append(f"{path.relative_to(ROOT)}: {name} from {module}")
    assert not offenders, offenders
