"""The family registry (cgforge.patches.families): which family a module or file is, load, save, the adapter's
options; importing cgforge.patches (and nequip, through cgforge's extension entry point) loads no family's code
and no kernels; mace-torch's cuEquivariance notice is not printed where cgforge imports mace."""

from __future__ import annotations

import importlib
import inspect
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from mace_helpers import assert_same_outputs, build_model, evaluate, water_dimer

from cgforge.patches import families
from cgforge.patches.families import MACE, NEQUIP
from cgforge.plugin.runtime.bundled import model_path

ROOT = Path(__file__).resolve().parents[2]
BUNDLED_MACE = model_path("mace")


def _run(code: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


# ---------------------------------------------------------------------------------------------
# Recognising modules and files


def test_family_of_a_module() -> None:
    model = build_model()
    assert families.family_of(model) is MACE and MACE.owns(model) and not NEQUIP.owns(model)
    with pytest.raises(TypeError, match=r"expected a MACE or NequIP model, got torch\.nn\.modules\.linear\.Linear"):
        families.family_of(torch.nn.Linear(2, 2))
    assert families.FAMILIES == (MACE, NEQUIP) and {f.name for f in families.FAMILIES} == {"mace", "nequip"}


@pytest.mark.parametrize("name, family", [("a.model", MACE), ("A.PT", MACE), ("a.pth", MACE), ("run.ckpt", NEQUIP),
                                          ("m.nequip.zip", NEQUIP)])
def test_family_for_file_by_suffix(tmp_path: Path, name: str, family: families.Family) -> None:
    assert families.family_for_file(tmp_path / name) is family  # the file need not exist to be named
    assert family.owns_name(tmp_path / name)
    assert not any(f.owns_name(tmp_path / name) for f in families.FAMILIES if f is not family)


def test_family_for_file_by_contents(tmp_path: Path) -> None:
    pickled = tmp_path / "model.bin"
    torch.save(torch.nn.Linear(2, 2), pickled)
    assert families.family_for_file(pickled) is MACE
    package = tmp_path / "deployed.zip"
    with zipfile.ZipFile(package, "w") as zf:
        zf.writestr("deployed/model/package_metadata.txt", "x")
        zf.writestr("deployed/.data/version", "6")
    assert families.family_for_file(package) is NEQUIP and NEQUIP.sniffs(package) and not MACE.owns_name(package)
    text = tmp_path / "frames.xyz"
    text.write_text("1\n\nH 0 0 0\n")
    with pytest.raises(ValueError, match=r"cannot tell the checkpoint type \(found a text file.*expected a MACE"):
        families.family_for_file(text)
    with pytest.raises(FileNotFoundError):
        families.family_for_file(tmp_path / "missing.bin")
    for compiled in ("m.nequip.pth", "m.nequip.pt2", "m.pt2"):
        with pytest.raises(ValueError, match="compiled"):
            families.family_for_file(tmp_path / compiled)


def test_output_names_are_checked_per_family() -> None:
    MACE.check_output("x.model")
    NEQUIP.check_output("x.nequip.zip")
    for name in ("x.nequip.zip", "x.ckpt", "x.nequip.pth", "x"):
        with pytest.raises(ValueError, match=r"OUT: .* must end with \.model, \.pt, \.pth"):
            MACE.check_output(name, what="OUT")
    with pytest.raises(ValueError, match=r"must end with \.nequip\.zip"):
        NEQUIP.check_output("x.model")
    with pytest.raises(ValueError, match="plain MACE .model files only"):
        NEQUIP.check_output("x.nequip.zip", patched=False)


# ---------------------------------------------------------------------------------------------
# Loading, saving, the adapter


@pytest.mark.slow
def test_load_a_module_and_a_file(tmp_path: Path) -> None:
    torch.set_default_dtype(torch.float64)
    model = build_model()
    ref = evaluate(model, water_dimer())
    path = tmp_path / "plain.model"
    torch.save(model, path)
    plain = families.load(path, patch=False)
    assert not MACE.is_patched(plain)
    assert families.load(plain, dtype="float32") is plain and MACE.is_patched(plain)
    assert next(plain.parameters()).dtype == torch.float32
    out = MACE.save(path, tmp_path / "patched.model")
    assert MACE.is_patched(torch.load(out, weights_only=False))
    unpatched = MACE.save(out, tmp_path / "again.model", patched=False)
    again = torch.load(unpatched, weights_only=False)
    assert not MACE.is_patched(again)
    assert_same_outputs(evaluate(again, water_dimer()), ref, tol=1e-12)
    with pytest.raises(TypeError, match="checkpoint path or a MACE/NequIP torch module, got int"):
        families.load(3)


def test_a_damaged_file_is_a_value_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "cut.model"
    path.write_bytes(BUNDLED_MACE.read_bytes()[:5000])
    with pytest.raises(ValueError, match="cut.model"):
        families.load(path)


def test_adapter_takes_each_familys_own_options() -> None:
    model = families.load(BUNDLED_MACE)
    adapter = MACE.adapter(model, torch.device("cpu"), head=None, type_map=None)
    assert adapter.kind == "mace" and adapter.model is model
    with pytest.raises(ValueError, match="type_map: only for NequIP models"):
        MACE.adapter(model, torch.device("cpu"), type_map={"H": "H"})
    with pytest.raises(ValueError, match="head: only for MACE models"):
        NEQUIP.adapter(model, torch.device("cpu"), head="Default")
    with pytest.raises(TypeError, match="unknown option"):
        MACE.adapter(model, torch.device("cpu"), heads="Default")


# ---------------------------------------------------------------------------------------------
# What importing costs, what it prints


def test_importing_patches_loads_no_family_code_and_no_kernels() -> None:
    done = _run("import sys, cgforge.patches\n"
                "print(sorted(m for m in sys.modules if m.startswith(('cgforge.kernels', 'cgforge.patches.mace', "
                "'cgforge.patches.nequip', 'nequip', 'mace'))))")
    assert done.stdout.strip() == "[]"


@pytest.mark.slow
def test_import_nequip_loads_no_kernels_until_a_model_is_patched() -> None:
    pytest.importorskip("nequip")
    done = _run("import sys, nequip\n"
                "from nequip.nn._tp_scatter_base import TensorProductScatter\n"
                "assert hasattr(TensorProductScatter, 'enable_cgforge'), 'the modifier is registered'\n"
                "print(sorted(m for m in sys.modules if m.startswith(('cgforge.kernels', 'cgforge.patches.'))))")
    assert done.stdout.strip() == "['cgforge.patches.common', 'cgforge.patches.families', " \
                                  "'cgforge.patches.nequip_modifier', 'cgforge.patches.recognise']"


@pytest.mark.slow
def test_loading_a_mace_model_does_not_print_the_cuequivariance_notice() -> None:
    pytest.importorskip("mace")
    done = _run("from cgforge.patches import families\n"
                f"families.load({str(BUNDLED_MACE)!r}, patch=False)\n"
                "import sys; assert 'mace.tools.cg' in sys.modules\n"
                "print('done')")
    assert done.stdout.strip() == "done" and "cuequivariance" not in done.stderr


def test_quiet_mace_import_passes_other_output_on(monkeypatch, capsys) -> None:
    import types

    def noisy_import(name, *args, **kwargs):
        if name == "mace.tools.cg":
            print("cuequivariance or cuequivariance_torch is not available. Cuequivariance acceleration ...")
            print("something else")
            return types.ModuleType(name)
        return real_import(name, *args, **kwargs)

    real_import = __builtins__["__import__"] if isinstance(__builtins__, dict) else __builtins__.__import__
    monkeypatch.delitem(sys.modules, "mace.tools.cg", raising=False)
    monkeypatch.setattr("builtins.__import__", noisy_import)
    families.quiet_mace_import()
    assert capsys.readouterr().out == "something else\n"


# ---------------------------------------------------------------------------------------------
# The family decision is made here only

# A model's or file's family asked anywhere but the registry: calls of the old per-family checks, comparisons with
# a family's name, membership tests of both names.
DECISION = re.compile(r"\bis_mace_model\b|\bis_nequip_model\b|\bcheckpoint_kind\(|[=!]= \"(mace|nequip)\"|"
                      r"in \(\"mace\", \"nequip\"\)")
OWN = ("cgforge/patches/families.py", "cgforge/patches/recognise.py", "cgforge/patches/mace/",
       "cgforge/patches/nequip/")
# Files being moved onto the registry by other work of issue 36 (each entry goes when its file asks the registry:
# `families.family_of(model).is_patched(model)`, `adapter.kind` replaced by the family, `bundled.kinds()`)
PENDING = {
    "cgforge/plugin/runtime/potential.py": "the runtime's _is_patched",
    "cgforge/plugin/lammps/exchange.py": "the exchange's per-family energy model",
    "cgforge/plugin/lammps/unified.py": "the LAMMPS model's bundled names and per-family path",
    "cgforge/plugin/cli/md.py": "cgforge md's bundled names",
}


def test_the_family_decision_is_made_only_by_the_registry() -> None:
    offenders = set()
    for path in sorted((ROOT / "cgforge").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(OWN):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if DECISION.search(line) and not line.lstrip().startswith(("def ", "#")):
                offenders.add(rel)
                print(f"{rel}:{number}: {line.strip()}")
    assert offenders <= set(PENDING), sorted(offenders - set(PENDING))


def test_the_how_to_add_a_family_page_names_what_the_code_has() -> None:
    """docs/development.md, "How to add a model family": every Family method and attribute it names exists on
    each family, and each family's adapter class has every member of the runtime's ModelAdapter protocol, which
    the page lists in full."""
    from cgforge.plugin.runtime.adapters import ModelAdapter

    text = (ROOT / "docs" / "development.md").read_text()
    section = text[text.index("## How to add a model family"):text.index("## Package layout")]
    protocol = {n for n in vars(ModelAdapter) if not n.startswith("_")} | set(ModelAdapter.__annotations__)
    step_1, step_2 = section.split("\n1. ")[1].split("\n2. ")
    named_members = set(re.findall(r"`(\w+)`", step_1.split("protocol")[1]))
    assert protocol <= named_members, f"ModelAdapter members the page does not list: {protocol - named_members}"
    for family in families.FAMILIES:
        for name in re.findall(r"`(\w+)`", step_2.split("\n3. ")[0]):
            if name not in ("Family", "FAMILIES"):
                assert hasattr(family, name), f"{family.title}: no {name} (named on the page)"
        adapter = importlib.import_module(f"{family.package}.adapter")
        (cls,) = [c for n, c in vars(adapter).items() if n.endswith("Adapter") and isinstance(c, type)
                  and c.__module__ == adapter.__name__]
        missing = {m for m in protocol if not hasattr(cls, m) and m not in getattr(cls, "__annotations__", {})}
        source = inspect.getsource(cls)  # instance attributes are set in __init__, not on the class
        missing = {m for m in missing if f"self.{m} =" not in source and f"self.{m}:" not in source}
        assert not missing, f"{cls.__name__} lacks ModelAdapter members {missing}"
