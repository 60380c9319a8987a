"""The calculator under bad input (issue 16): unknown keywords, non-finite model output, damaged checkpoint
files; energy and forces from one model run; the fastest path on a CPU; stress with partial periodicity."""

from __future__ import annotations

import shutil
import struct
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from ase import Atoms
from mace_helpers import build_model, rel_err  # noqa: E402
from oracles import stress_by_finite_differences  # noqa: E402

from cgforge import patches  # noqa: E402
from cgforge.patches import mace as pm  # noqa: E402
from cgforge.plugin import Calculator, NonFiniteOutputError  # noqa: E402
from cgforge.plugin.runtime.bundled import model_path  # noqa: E402
from cgforge.plugin.runtime.diagnosis import non_finite_message  # noqa: E402
from cgforge.plugin.water import water_box  # noqa: E402


@pytest.fixture(autouse=True)
def _float64_default():
    """The MACE test models are built in float64; nequip's loader changes the default: set it per test."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("models") / "tiny.model"
    torch.save(build_model(r_max=4.0), path)
    return path


def box(seed: int = 1) -> Atoms:
    atoms = water_box(8, seed=seed)
    atoms.rattle(0.05, seed=seed + 1)
    return atoms


def energy(calc: Calculator, atoms: Atoms) -> float:
    a = atoms.copy()
    a.calc = calc
    return a.get_potential_energy()


# ---------------------------------------------------------------------------------------------
# 1. Keyword arguments: ours, MACECalculator's spellings, nothing else


def test_unknown_keywords_are_refused_by_name(model_file):
    with pytest.raises(TypeError, match=r"unknown keyword argument\(s\) 'defualt_dtype', 'skn'.*takes model, device"):
        Calculator(model_file, device="cpu", skn=0.5, defualt_dtype="float64")
    with pytest.raises(TypeError, match="'models'.*model_paths= and default_dtype= mean model= and dtype="):
        Calculator(models=[build_model()], device="cpu")  # MACECalculator's in-memory spelling: not ours
    with pytest.raises(TypeError, match="missing model"):
        Calculator(device="cpu")
    calc = Calculator(model_file, device="cpu", warmup=False, directory="somewhere")  # ase's own keywords pass
    assert str(calc.directory) == "somewhere" and calc.parameters == {}


def test_mace_calculator_spellings_mean_ours(model_file):
    atoms = box()
    ours = Calculator(model_file, device="cpu", dtype="float32", warmup=False)
    theirs = Calculator(model_paths=str(model_file), device="cpu", default_dtype="float32", warmup=False)
    assert theirs.dtype == ours.dtype == torch.float32
    assert energy(theirs, atoms) == energy(ours, atoms)
    listed = Calculator(model_paths=[model_file], default_dtype="", device="cpu", warmup=False)
    assert listed.dtype == torch.float64  # "" keeps the model's, as in MACECalculator
    with pytest.raises(TypeError, match="both model= and model_paths="):
        Calculator(model_file, model_paths=str(model_file), device="cpu")
    with pytest.raises(TypeError, match="both dtype= and default_dtype="):
        Calculator(model_file, dtype="float32", default_dtype="float64", device="cpu")
    with pytest.raises(TypeError, match="model_paths: cgforge's Calculator runs one model, got a list of 2"):
        Calculator(model_paths=[model_file, model_file], device="cpu")
    with pytest.raises(TypeError, match="model_paths: expected a checkpoint path"):
        Calculator(model_paths=3, device="cpu")
    with pytest.raises(ValueError, match="dtype: expected None, 'float32' or 'float64', got 'float16'"):
        Calculator(model_paths=str(model_file), default_dtype="float16", device="cpu")


# ---------------------------------------------------------------------------------------------
# 2. Non-finite model output


@pytest.mark.parametrize("patch", [False, True])
def test_overlapping_atoms_raise_a_clear_error(model_file, patch):
    calc = Calculator(model_file, device="cpu", patch=patch, warmup=False)
    atoms = box()
    atoms.positions[5] = atoms.positions[2] + atoms.cell[0]  # on atom 2's periodic image: 0 Å, minimum image
    atoms.calc = calc
    with pytest.raises(NonFiniteOutputError) as info:
        atoms.get_potential_energy()
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert "model output is not finite for this structure" in message and "forces on" in message
    assert "closest pair: atoms 2 and 5 at 0 Å (minimum image)" in message
    assert "atoms on top of each other" in message and "positions" not in message.split(";")[0]
    # the same structure with the atoms apart is fine
    atoms.positions[5] += 0.9
    assert np.isfinite(atoms.get_forces()).all()


def test_non_finite_message_names_outputs_and_first_atoms(model_file):
    calc = Calculator(model_file, device="cpu", warmup=False)
    atoms = Atoms("H2", positions=[[0, 0, 0], [0, 0, 5.0]])  # no cell: the non-periodic search
    host = np.zeros(1 + 3 * 20 + 9 + 20)
    host[0] = np.nan
    host[1 + 3 * 11] = np.inf  # atom 11's x force
    host[1 + 3 * 20 + 4] = np.nan  # the stress
    host[-20:][[3, 12, 13, 14, 15, 16, 17, 18, 19]] = np.nan  # per-atom energies
    positions = np.random.default_rng(0).uniform(0, 20, size=(20, 3))
    message = non_finite_message(host, positions, np.zeros((3, 3)), (False,) * 3, calc.model, calc.cutoff,
                                 patched=calc.patched, forces=True, stress=True, per_atom=True)
    assert message.startswith("model output is not finite for this structure: energy nan, forces on 1 of 20 atoms, "
                              "stress, per-atom energies of 9 of 20 atoms; atoms 3, 11, 12, 13, 14, 15, 16, 17, ...")
    far = non_finite_message(host[:1], atoms.positions, np.zeros((3, 3)), (False,) * 3, calc.model, calc.cutoff,
                             patched=calc.patched, forces=False, stress=False, per_atom=False)
    assert "no two atoms closer than the cutoff, 4 Å" in far


def test_a_model_with_nan_weights_is_refused_at_construction(tmp_path):
    model = build_model(r_max=4.0)
    with torch.no_grad():
        model.interactions[1].linear.weight[3] = float("nan")
    path = tmp_path / "broken.model"
    torch.save(model, path)
    with pytest.raises(NonFiniteOutputError, match=r"warm-up structure.*parameters hold NaN/inf "
                                                   r"\(interactions\.1\.linear\.weight\): the model file is broken"):
        Calculator(path, device="cpu")
    calc = Calculator(path, device="cpu", warmup=False)  # without the warm-up: at the first structure
    atoms = box()
    atoms.calc = calc
    with pytest.raises(NonFiniteOutputError, match="this structure: energy nan.*model file is broken"):
        atoms.get_forces()


# ---------------------------------------------------------------------------------------------
# 3. Energy, forces and stress: how many model runs


class StepSpy:
    """Counts the model step's runs and records the properties each computed."""

    def __init__(self, calc: Calculator) -> None:
        self.runs: list[tuple[bool, bool, bool]] = []
        inner = calc.step.run

        def run(*args, forces, stress, per_atom, **kwargs):
            self.runs.append((forces, stress, per_atom))
            return inner(*args, forces=forces, stress=stress, per_atom=per_atom, **kwargs)

        calc.step.run = run


@pytest.mark.parametrize(("options", "expected"), [
    ({}, [(True, False, False), (True, True, False)]),  # energy with forces, then stress
    ({"stress_with_forces": True}, [(True, True, False)]),  # all three from one run
    ({"forces_with_energy": False}, [(False, False, False), (True, False, False), (True, True, False)]),
])
def test_energy_forces_stress_cost_at_most_two_runs(model_file, options, expected):
    calc = Calculator(model_file, device="cpu", warmup=False, **options)
    spy = StepSpy(calc)
    atoms = box()
    atoms.calc = calc
    e, f, s = atoms.get_potential_energy(), atoms.get_forces(), atoms.get_stress()
    assert spy.runs == expected
    reference = Calculator(model_file, device="cpu", warmup=False, forces_with_energy=False)
    a = atoms.copy()
    a.calc = reference
    assert e == a.get_potential_energy() and rel_err(f, a.get_forces()) < 1e-12 and rel_err(s, a.get_stress()) < 1e-12
    atoms.get_potential_energies()  # per-atom energies of a structure whose forces are known: no backward
    assert spy.runs[-1] == (False, False, True)
    atoms.positions[0] += 0.01  # a new structure: energy and forces again, in one run (two without the option)
    atoms.get_potential_energy()
    atoms.get_forces()
    assert spy.runs[-1][0] and len(spy.runs) == len(expected) + 1 + (1 if calc.forces_with_energy else 2)


# ---------------------------------------------------------------------------------------------
# 4. patch=None: cgforge's kernels on CUDA, the faster unpatched model on a CPU


def test_cpu_default_runs_the_unpatched_model(model_file):
    calc = Calculator(model_file, device="cpu", warmup=False)
    assert calc.patched is False and not pm.is_patched(calc.model)
    patched = Calculator(model_file, device="cpu", warmup=False, patch=True)
    assert patched.patched is True and pm.is_patched(patched.model)
    atoms = box()
    assert abs(energy(calc, atoms) - energy(patched, atoms)) < 1e-10 * abs(energy(patched, atoms))
    given = Calculator(patched.model, device="cpu", warmup=False)  # a module patched already stays patched
    assert given.patched is True
    with pytest.raises(TypeError, match="patch: expected None, True or False, got 'yes'"):
        Calculator(model_file, device="cpu", patch="yes")


def test_cpu_default_unpatched_nequip_package(nequip_state):
    from cgforge.patches import nequip as pn

    calc = Calculator("nequip", device="cpu", warmup=False)
    assert calc.patched is False and not pn.is_patched(calc.model)


@pytest.mark.cuda
def test_cuda_default_runs_cgforge_kernels(model_file):
    calc = Calculator(model_file, device="cuda")
    assert calc.patched is True and pm.is_patched(calc.model)


# ---------------------------------------------------------------------------------------------
# 5. Damaged checkpoint files


def flip_bytes_in_largest_member(path: Path) -> str:
    """Invert 8 bytes in the middle of the file's largest tensor storage (torch.save: <name>/data/<key>,
    torch.package: <name>/.data/<key>.storage); returns the member's name."""
    with zipfile.ZipFile(path) as archive:
        storages = [i for i in archive.infolist() if "data/" in i.filename and not i.filename.endswith(".pkl")]
        info = max(storages, key=lambda i: i.compress_size)
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_length, extra_length = struct.unpack("<HH", f.read(4))
        at = info.header_offset + 30 + name_length + extra_length + info.compress_size // 2
        f.seek(at)
        data = f.read(8)
        f.seek(at)
        f.write(bytes(b ^ 0xFF for b in data))
    return info.filename


@pytest.mark.slow
def test_damaged_mace_model_file_is_refused(tmp_path):
    intact, damaged = tmp_path / "water.model", tmp_path / "damaged.model"
    shutil.copyfile(model_path("mace"), intact)
    shutil.copyfile(model_path("mace"), damaged)
    member = flip_bytes_in_largest_member(damaged)
    torch.load(damaged, map_location="cpu", weights_only=False)  # torch itself does not notice
    for load in (lambda p: Calculator(p, device="cpu", warmup=False), lambda p: patches.load(p, device="cpu")):
        with pytest.raises(ValueError, match=f"damaged.model: member '{member}' fails its check.*"
                                             "the file is damaged; re-download or re-export it"):
            load(damaged)
    atoms = box()
    assert np.isfinite(energy(Calculator(intact, device="cpu", warmup=False), atoms))


def test_damaged_nequip_files_are_refused(nequip_state, tmp_path):
    from cgforge.patches.nequip import load_nequip

    intact, damaged = tmp_path / "water.nequip.zip", tmp_path / "damaged.nequip.zip"
    shutil.copyfile(model_path("nequip"), intact)
    shutil.copyfile(model_path("nequip"), damaged)
    member = flip_bytes_in_largest_member(damaged)
    with pytest.raises(ValueError, match=f"member '{member}' fails its check.*the file is damaged"):
        Calculator(damaged, device="cpu", warmup=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.package's own warnings
        assert np.isfinite(energy(Calculator(intact, device="cpu", warmup=False), box()))
    # a .ckpt is a torch.save zip: checked the same way, before nequip reads it
    ckpt = tmp_path / "run.ckpt"
    torch.save({"state_dict": {"w": torch.arange(4096.0)}}, ckpt)
    patches.verify_checksums(ckpt)  # intact: no error
    member = flip_bytes_in_largest_member(ckpt)
    with pytest.raises(ValueError, match=f"run.ckpt: member '{member}' fails its check"):
        load_nequip(ckpt)


def test_checksums_of_files_that_are_not_zips_are_not_checked(tmp_path):
    legacy = tmp_path / "legacy.pt"
    legacy.write_bytes(b"\x80\x02 an old torch pickle")
    patches.verify_checksums(legacy)  # nothing to check: the loader says what the file is


# ---------------------------------------------------------------------------------------------
# 6. Stress with partial periodicity


def test_slab_stress_is_the_strain_derivative_over_the_cell_volume(model_file):
    from mace.calculators import MACECalculator

    atoms = water_box(8, seed=7)
    atoms.pbc = (True, True, False)
    calc = Calculator(model_file, device="cpu", warmup=False)
    a = atoms.copy()
    a.calc = calc
    stress = a.get_stress()
    # divided by the volume of atoms.cell, non-periodic vector included
    fd = stress_by_finite_differences(lambda a: energy(calc, a), atoms, h=1e-5)
    assert np.abs(stress).max() > 1e-7
    assert np.abs(stress - np.array(fd)).max() < 1e-5 * np.abs(stress).max(), (stress, fd)
    # MACECalculator divides the same virial by the volume of a cell whose non-periodic vector it enlarges
    # (max |position| * 5 * cutoff): its stress is ours times one constant, much smaller than 1.
    b = atoms.copy()
    b.calc = MACECalculator(models=build_model(r_max=4.0), device="cpu", default_dtype="float64")
    ratio = b.get_stress() / stress
    assert np.ptp(ratio[np.abs(stress) > 1e-3 * np.abs(stress).max()]) < 1e-6 and ratio[0] < 0.2


# ---------------------------------------------------------------------------------------------
# issue 61, the new-user trial: every argument checked before the model loads, a TypeError for a wrong type


@pytest.mark.parametrize("kwargs, error, match", [
    ({"device": 0}, TypeError, "device: expected 'cpu', 'cuda', 'cuda:N' or a torch.device, got int 0"),
    ({"workspace": 3}, TypeError, "workspace: expected one of 'auto', 'whole', 'tiled', got int"),
    ({"dtype": np.float64}, TypeError, "dtype: expected None, 'float32', 'float64' or a torch.dtype, got type"),
    ({"skin": "1"}, TypeError, "skin: expected a number of Å >= 0, got str '1'"),
    ({"skin": -1}, ValueError, "skin: expected a finite number of Å >= 0, got -1"),
    ({"radial_table": True, "patch": False}, ValueError, "radial_table=True, patch=False: the radial tables are read "
                                                          "by cgforge's kernels"),
])
def test_arguments_are_checked_before_the_model_loads(monkeypatch, kwargs, error, match):
    from cgforge.plugin.runtime import potential

    def refuse(*args, **kw):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(potential, "load_module", refuse)
    with pytest.raises(error, match=match):
        Calculator("mace", **{"device": "cpu", **kwargs})


def test_an_unknown_model_name_names_the_bundled_models():
    with pytest.raises(FileNotFoundError, match=r"model: macee not found; expected a bundled model \('mace', "
                                                r"'nequip'\) or a checkpoint file .*did you mean 'mace'\?"):
        Calculator("macee", device="cpu")


def test_radial_tables_on_a_cpu_patch_the_model(model_file):
    """radial_table=True needs cgforge's kernels: on a CPU (where patch=None leaves the model's own code) it
    patches the model, as radial_precision, compile and tuning do; an unpatched module given is named as such."""
    calc = Calculator(model_file, device="cpu", radial_table=True, warmup=False)
    assert calc.patched and calc.radial_table
    from cgforge.plugin.runtime.potential import Potential

    with pytest.raises(ValueError, match="radial_table=True: the tables are read by cgforge's kernels, and this "
                                         "model runs its own code"):
        Potential(build_model(r_max=4.0), torch.device("cpu"), radial_table=True, warmup=False)
