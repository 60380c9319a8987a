"""No test overwrites an UPPER_CASE attribute of a cgforge module (``monkeypatch.setattr(mod, "NAME", ...)``,
``setattr(mod, "NAME", ...)``, ``mod.NAME = ...``): a setting a test needs is a field of a typed value
(``RuntimeOptions``, ``KernelTuning``, ``EngineOptions``) or a keyword, passed down. The few left are facts of the
installation or of LAMMPS, or a process-wide registry, each said below (the AST of tests/**/*.py, no import)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
UPPER = re.compile(r"_?[A-Z][A-Z0-9_]*")
ASSIGNED = re.compile(r"\._?[A-Z][A-Z0-9_]*(\s*:[^=\n]*)?\s*[-+*/|&]?=[^=]")

# (test file, attribute): why the test may overwrite it
ALLOWED = {
    ("plugin/test_calculator.py", "MODELS_DIR"): "where the package's model files lie: the test is an installation "
                                                 "that lost them",
    ("patches/test_bundled_models.py", "MODELS_DIR"): "likewise",
    ("lammps/test_lammps.py", "HOST_FORWARD_WIDTH"): "LAMMPS's size_border, a fact of LAMMPS: widened, the stand-in "
                                                     "must refuse what LAMMPS would write past its buffers",
    ("patches/test_harmonics_patch.py", "_REGISTERED"): "the process's custom-op registry: emptied, it is another "
                                                        "process loading a saved model",
}


def _cgforge_names(tree: ast.AST) -> set[str]:
    """Names bound to something imported from cgforge (a module, a class or a function) anywhere in the file."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update((a.asname or a.name).split(".")[0] for a in node.names
                         if a.name.split(".")[0] == "cgforge")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "cgforge":
            names.update(a.asname or a.name for a in node.names)
    return names


def _root(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def overwritten(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, attribute) of every UPPER_CASE attribute of a cgforge object the file sets."""
    ours, found = _cgforge_names(tree), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func, args = node.func, node.args
            is_setattr = (isinstance(func, ast.Attribute) and func.attr == "setattr") or (
                isinstance(func, ast.Name) and func.id == "setattr")
            if not is_setattr or not args:
                continue
            if isinstance(args[0], ast.Constant) and isinstance(args[0].value, str):  # setattr("cgforge.m.NAME", v)
                path = args[0].value
                if path.startswith("cgforge.") and UPPER.fullmatch(path.rsplit(".", 1)[-1]):
                    found.append((node.lineno, path.rsplit(".", 1)[-1]))
            elif (len(args) >= 2 and _root(args[0]) in ours and isinstance(args[1], ast.Constant)
                  and isinstance(args[1].value, str) and UPPER.fullmatch(args[1].value)):
                found.append((node.lineno, args[1].value))
        elif isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if isinstance(t, ast.Attribute) and UPPER.fullmatch(t.attr) and _root(t.value) in ours:
                        found.append((node.lineno, t.attr))
    return sorted(found)


def test_the_rule_finds_each_form() -> None:
    source = """
import cgforge.cli.md as md_cli
from cgforge.patches import e3nn_layers as layers
from cgforge.plugin.runtime import options
def test(monkeypatch, calc):
    monkeypatch.setattr(md_cli, "CPU_HINT_ATOMS", 10)
    monkeypatch.setattr("cgforge.patches.e3nn_layers.CHUNK_BYTES", 1)
    layers.CHUNK_BYTES = 3
    setattr(options, "_LIMIT", 2)
    monkeypatch.setattr(md_cli, "size_hint", None)
    calc.options = None
    other.LIMIT = 1
"""
    assert overwritten(ast.parse(source)) == [(6, "CPU_HINT_ATOMS"), (7, "CHUNK_BYTES"), (8, "CHUNK_BYTES"),
                                              (9, "_LIMIT")]


def test_no_test_overwrites_a_module_constant() -> None:
    seen, bad = set(), []
    for path in sorted(TESTS.rglob("*.py")):
        rel, text = path.relative_to(TESTS).as_posix(), path.read_text()
        if "setattr" not in text and not ASSIGNED.search(text):  # nothing to look at: not parsed
            continue
        for line, name in overwritten(ast.parse(text)):
            if (rel, name) in ALLOWED:
                seen.add((rel, name))
            else:
                bad.append(f"{rel}:{line}: {name}")
    assert not bad, ("tests overwrite module constants; pass a typed value (RuntimeOptions, KernelTuning, "
                     "EngineOptions) or a keyword instead: " + ", ".join(bad))
    assert seen == set(ALLOWED), f"allowed but no longer done (drop from ALLOWED): {sorted(set(ALLOWED) - seen)}"
