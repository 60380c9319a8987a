"""The class paths pickled patched models name (``cgforge._moved.PICKLED_CLASSES``): each imports, the pickles
cgforge writes name no other cgforge path, a saved patched model loads back, and files written by cgforge before
the contract existed (``tests/data``, commit c54a3be) still load and give the same numbers."""

from __future__ import annotations

import importlib
import io
import pickletools
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from mace_helpers import assert_same_outputs, build_model, evaluate, water_dimer

from cgforge._moved import PICKLED_CLASSES, pickled_paths
from cgforge.patches import families
from cgforge.plugin.runtime import bundled

DATA = Path(__file__).resolve().parent / "data"
OLD_MACE = DATA / "water-mace-patched-c54a3be.model"
OLD_NEQUIP = DATA / "water-nequip-patched-c54a3be.nequip.zip"
BUNDLED = bundled.MODELS_DIR


def pickled_globals(data: bytes) -> set[str]:
    """``module.name`` of every class or function the pickle ``data`` names (GLOBAL and STACK_GLOBAL opcodes)."""
    found, strings = set(), []
    for op, arg, _ in pickletools.genops(data):
        if op.name == "GLOBAL":
            found.add(arg.replace(" ", "."))
        elif "UNICODE" in op.name:
            strings.append(arg)
        elif op.name == "STACK_GLOBAL":
            found.add(f"{strings[-2]}.{strings[-1]}")
    return found


def cgforge_globals(path_or_bytes: Path | bytes) -> set[str]:
    """The cgforge paths named by the pickles inside a torch.save zip or a torch.package archive."""
    source = io.BytesIO(path_or_bytes) if isinstance(path_or_bytes, bytes) else path_or_bytes
    with zipfile.ZipFile(source) as zf:
        names = set().union(*(pickled_globals(zf.read(n)) for n in zf.namelist() if n.endswith(".pkl")))
    return {n for n in names if n.startswith("cgforge")}


def package_externs(path: Path) -> set[str]:
    """The cgforge modules a torch.package archive imports from the installed cgforge (its extern modules)."""
    with zipfile.ZipFile(path) as zf:
        (member,) = [n for n in zf.namelist() if n.endswith(".data/extern_modules")]
        return {m for m in zf.read(member).decode().split() if m.startswith("cgforge")}


def saved_bytes(model: torch.nn.Module) -> bytes:
    buf = io.BytesIO()
    torch.save(model, buf)
    return buf.getvalue()


# ---------------------------------------------------------------------------------------------
# (a) every listed path imports to the object pickle writes under that path


@pytest.mark.parametrize("path", sorted(pickled_paths()))
def test_every_listed_path_imports_to_an_object_of_that_path(path: str) -> None:
    module_name, _, qualname = path.rpartition(".")
    obj = getattr(importlib.import_module(module_name), qualname)
    assert (obj.__module__, obj.__qualname__) == (module_name, qualname)  # what pickle writes for it


def test_the_contract_names_each_path_once_per_state() -> None:
    for state, paths in PICKLED_CLASSES.items():
        assert len(paths) == len(set(paths)), state


# ---------------------------------------------------------------------------------------------
# (b) what cgforge writes names only listed paths, and loads back


@pytest.fixture(scope="module")
def mace_model() -> tuple[torch.nn.Module, dict]:
    torch.set_default_dtype(torch.float64)
    model = build_model()
    return model, evaluate(model, water_dimer())


@pytest.mark.slow
def test_a_patched_mace_model_saved_and_loaded_back(mace_model, tmp_path: Path) -> None:
    model, ref = mace_model
    out = families.MACE.save(model, tmp_path / "patched.model")
    assert cgforge_globals(out.read_bytes()) <= set(PICKLED_CLASSES["mace"])
    loaded = torch.load(out, weights_only=False)
    assert families.MACE.is_patched(loaded)
    assert_same_outputs(evaluate(loaded, water_dimer()), ref, tol=1e-10)
    again = families.load(out)  # through the registry: the file is recognised, loaded and (still) patched
    assert_same_outputs(evaluate(again, water_dimer()), ref, tol=1e-10)


def test_a_mace_model_saved_in_each_runtime_state_names_only_listed_paths() -> None:
    from cgforge.patches.mace import set_radial_table, set_streaming
    from cgforge.patches.mace.radial_table import set_table_fusion
    from cgforge.patches.mace.row_chunks import set_row_chunks

    allowed = set(PICKLED_CLASSES["mace"]) | set(PICKLED_CLASSES["mace runtime"])
    model = families.MACE.patch(build_model())
    named = set()
    set_streaming(model, 7)
    named |= cgforge_globals(saved_bytes(model))
    set_streaming(model, None)
    set_radial_table(model, True)
    set_table_fusion(model, True)
    assert set_row_chunks(model, 3)
    named |= cgforge_globals(data := saved_bytes(model))
    assert named <= allowed, named - allowed
    assert set(PICKLED_CLASSES["mace runtime"]) <= named  # the list holds nothing these states never write
    assert families.MACE.is_patched(torch.load(io.BytesIO(data), weights_only=False))


@pytest.mark.slow
def test_a_patched_nequip_package_names_only_listed_paths(tmp_path: Path) -> None:
    pytest.importorskip("nequip")
    out = families.NEQUIP.save(BUNDLED / "water-nequip.nequip.zip", tmp_path / "patched.nequip.zip")
    allowed = set(PICKLED_CLASSES["nequip"]) | set(PICKLED_CLASSES["nequip runtime"])
    assert cgforge_globals(out) <= allowed
    assert package_externs(out) <= {path.rpartition(".")[0] for path in allowed}
    assert families.NEQUIP.is_patched(families.load(out))


# ---------------------------------------------------------------------------------------------
# (c) files written before the contract existed


@pytest.mark.slow
def test_old_patched_mace_file_names_only_listed_paths_and_loads() -> None:
    assert cgforge_globals(OLD_MACE) <= set(PICKLED_CLASSES["mace"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # no path of it needs a moved-module alias
        old = torch.load(OLD_MACE, weights_only=False)
    assert families.MACE.is_patched(old)
    fresh = families.load(BUNDLED / "water-mace.model")
    assert_same_outputs(evaluate(old, water_dimer()), evaluate(fresh, water_dimer()), tol=1e-6)
    assert families.MACE.is_patched(families.load(OLD_MACE, dtype="float64"))


@pytest.mark.slow
def test_old_patched_nequip_package_loads_and_matches() -> None:
    pytest.importorskip("nequip")
    from ase.build import molecule

    from cgforge.plugin import Calculator

    assert cgforge_globals(OLD_NEQUIP) <= set(PICKLED_CLASSES["nequip"])
    assert package_externs(OLD_NEQUIP) <= {path.rpartition(".")[0] for path in PICKLED_CLASSES["nequip"]}
    energies = []
    for path in (OLD_NEQUIP, BUNDLED / "water-nequip.nequip.zip"):
        atoms = molecule("H2O")
        atoms.center(vacuum=3.0)
        atoms.calc = Calculator(path, device="cpu", patch=True, warmup=False)
        assert atoms.calc.patched
        energies.append(atoms.get_potential_energy())
    assert np.isclose(energies[0], energies[1], rtol=1e-10, atol=0)


def test_a_lammps_model_file_names_only_listed_paths(tmp_path: Path) -> None:
    from cgforge.plugin.lammps import CgforgeMLIAP
    from cgforge.plugin.lammps.write import write_lammps_model

    out = write_lammps_model(CgforgeMLIAP("mace"), tmp_path / "water.pkl")
    allowed = set(PICKLED_CLASSES["lammps"]) | set(PICKLED_CLASSES["mace"])
    named = {n for n in pickled_globals(out.read_bytes()) if n.startswith("cgforge")}
    assert "cgforge.plugin.lammps.unified.CgforgeMLIAP" in named
    assert named <= allowed


def test_a_lammps_file_of_the_old_layout_says_to_write_it_again() -> None:
    import pickle

    old = b"ccgforge.lammps.unified\nCgforgeMLIAP\n."  # what an ML-IAP file of the earlier layout names
    with pytest.raises(ModuleNotFoundError, match=r"cgforge\.lammps moved to cgforge\.plugin\.lammps.*write it again"):
        pickle.loads(old)
    with pytest.raises(ModuleNotFoundError, match=r"cgforge\.cli moved to cgforge\.plugin\.cli"):
        importlib.import_module("cgforge.cli.commands")
