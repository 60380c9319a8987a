"""The patches layer's package layout: old class paths named by saved patched models still load,
and no module imports a private name of another cgforge package."""

from __future__ import annotations

import ast
import importlib
import pickle
from pathlib import Path

import pytest
import torch
from mace_helpers import assert_same_outputs, build_model, evaluate, water_dimer

from cgforge.patches import mace as pm

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("path,name", [("cgforge.patches.mace", "FusedConvTP"),
                                       ("cgforge.patches.mace", "FusedSymmetricContraction"),
                                       ("cgforge.patches.mace", "GraphCache"),
                                       ("cgforge.patches.mace_legacy", "load_pickle"),
                                       ("cgforge.patches.mace_legacy", "LegacyCheckpointError")])
def test_paths_named_by_old_pickles_resolve(path: str, name: str) -> None:
    assert getattr(importlib.import_module(path), name) is not None


def test_old_nequip_class_path_resolves() -> None:
    pytest.importorskip("nequip")
    from cgforge.patches import nequip
    from cgforge.patches.nequip.conv import CgforgeTensorProductScatter

    # packages written before the split name this path (cgforge is an extern module of the package)
    assert nequip.CgforgeTensorProductScatter is CgforgeTensorProductScatter


def test_old_legacy_path_is_the_same_module() -> None:
    from cgforge.patches import mace_legacy
    from cgforge.patches.mace import legacy

    assert mace_legacy is legacy


def test_a_model_pickled_under_the_old_class_paths_loads() -> None:
    torch.set_default_dtype(torch.float64)
    plain = build_model()
    ref = evaluate(plain, water_dimer())
    patched = pm.patch(plain)
    data = pickle.dumps(patched, protocol=2)  # torch.save's protocol: GLOBAL opcodes "module\nname\n"
    new, old = b"ccgforge.patches.mace.patch\n", b"ccgforge.patches.mace\n"  # opcode c, module
    assert new in data
    data = data.replace(new, old)  # as a patched model saved before cgforge/patches/mace/ existed
    assert new not in data and old + b"FusedConvTP\n" in data
    loaded = pickle.loads(data)
    assert pm.is_patched(loaded)
    assert_same_outputs(evaluate(loaded, water_dimer()), ref, tol=1e-10)


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
