"""The claims of docs/architecture.md, checked against the code so the page cannot drift.

The page holds a ``layers`` block (each unit and the units it may import) and a ``budget`` block (the longest
module, the modules that may read environment variables). This test reads both and checks every import
statement of the package (lazy ones inside functions too), the import graph, module lengths, environment reads,
name lookups from kernels/ into the layers above it, and that the page names every module that exists.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "cgforge"
DOC = ROOT / "docs" / "architecture.md"


def _block(kind: str) -> dict[str, list[str]]:
    """``unit: a b c`` lines of the fenced block ``` kind ... ``` in the architecture page."""
    found = re.search(rf"```{kind}\n(.*?)```", DOC.read_text(), re.S)
    assert found, f"docs/architecture.md has no ```{kind} block"
    rules = {}
    for line in found.group(1).splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            unit, _, rest = line.partition(":")
            rules[unit.strip()] = rest.split()
    return rules


def _name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def _modules() -> dict[str, Path]:
    return {_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


@cache
def _imports(name: str) -> frozenset[str]:
    """The cgforge modules an import statement of ``name`` loads (relative imports resolved; ``from pkg import
    sub`` counts ``pkg.sub`` and not ``pkg`` itself, which is only the parent package being imported)."""
    path = _modules()[name]
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    named: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            named.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            subs = [f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in _modules()]
            named.update(subs)
            if len(subs) < len(node.names):
                named.add(module)
    found = set()
    for module in named:
        while module and module not in _modules():
            module = module.rpartition(".")[0]
        if module.startswith("cgforge") and module not in (name, "cgforge"):
            found.add(module)
    return frozenset(found)


def _unit(module: str, units: list[str]) -> str:
    matches = [u for u in units if module == f"cgforge.{u}" or module.startswith(f"cgforge.{u}.")]
    return max(matches, key=len) if matches else "cgforge"


def test_every_module_belongs_to_a_unit_of_the_page() -> None:
    units = list(_block("layers"))
    orphans = [m for m in _modules() if _unit(m, units) == "cgforge" and m not in
               ("cgforge", "cgforge._moved", "cgforge.__main__", "cgforge.atomic")]
    assert not orphans, f"modules of no unit in docs/architecture.md's layers block: {orphans}"


def test_imports_follow_the_layers() -> None:
    rules = _block("layers")
    units = list(rules)
    offenders = []
    for module in _modules():
        unit = _unit(module, units)
        if unit == "cgforge":
            continue  # the package root: __init__ (the moved-names hook), __main__ (the command line)
        allowed = {unit, "cgforge", *rules[unit]}  # the root (cgforge._moved) is below everything
        for target in _imports(module):
            to = _unit(target, units)
            if to not in allowed and not any(to.startswith(f"{a}.") for a in allowed):
                offenders.append(f"{module} ({unit}) imports {target} ({to})")
    assert not offenders, "imports the layers block does not allow:\n" + "\n".join(sorted(offenders))


def test_lammps_stands_on_the_runtime_alone() -> None:
    """LAMMPS evaluates through the ``Potential``: its row may name the runtime only (no patches, no kernels), so
    ``test_imports_follow_the_layers`` refuses any import of theirs in plugin/lammps."""
    assert _block("layers")["plugin.lammps"] == ["plugin.runtime"]


def test_no_import_circle() -> None:
    graph = {m: _imports(m) for m in _modules()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


def test_no_module_over_the_budget() -> None:
    limit = int(_block("budget")["max_lines"][0])
    long = {m: n for m, p in _modules().items() if (n := len(p.read_text().splitlines())) > limit}
    assert not long, f"modules over {limit} lines: {long}"


def test_only_the_named_modules_read_the_environment() -> None:
    allowed = set(_block("budget")["reads_environment"])
    readers = set()
    for module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv") and \
                    isinstance(node.value, ast.Name) and node.value.id == "os":
                readers.add(module.removeprefix("cgforge."))
    assert readers <= allowed, f"read the environment but are not named in the budget block: {readers - allowed}"
    assert allowed <= readers, f"named in the budget block but read no environment any more: {allowed - readers}"


def test_kernels_name_nothing_above_them() -> None:
    offenders = []
    for module, path in _modules().items():
        if not module.startswith("cgforge.kernels"):
            continue
        tree = ast.parse(path.read_text())
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef)) and n.body
                      and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings and \
                    re.search(r"cgforge\.(patches|plugin|lammps|cli)\b", node.value):
                offenders.append(f"{module}: {node.value!r}")
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module":
                offenders.append(f"{module}: importlib.import_module (kernels/ looks nothing up by name)")
    assert not offenders, offenders


@pytest.mark.parametrize("kind", ["layers", "budget"])
def test_the_page_has_its_blocks(kind: str) -> None:
    assert _block(kind)


def test_the_page_names_every_module_and_no_other() -> None:
    text = DOC.read_text()
    tree = re.search(r"```text\n(cgforge/.*?)```", text, re.S)
    assert tree, "docs/architecture.md has no ```text block with the package tree"
    named = set(re.findall(r"(?<![/\w])(\w+\.py)", tree.group(1)))
    existing = {p.name for p in PACKAGE.rglob("*.py") if p.name not in ("__init__.py", "__main__.py")}
    assert not existing - named, f"modules the page's tree does not name: {sorted(existing - named)}"
    assert not named - existing, f"the page's tree names modules that do not exist: {sorted(named - existing)}"
