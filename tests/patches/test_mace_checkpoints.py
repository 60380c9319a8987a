"""Loading MACE .model files: e3nn 0.4 pickles, older mace-torch pickles, trainer output, bad files."""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from e3nn import nn as e3nn_nn
from e3nn import o3
from e3nn.util.codegen import CodeGenMixin
from mace_helpers import assert_same_outputs, build_model, evaluate, water_dimer

from cgforge import patches
from cgforge.patches import mace as pm
from cgforge.patches.mace import legacy as mace_legacy
from cgforge.plugin.cli import main as cli_main

# ---------------------------------------------------------------------------------------------
# Writing a checkpoint the way e3nn 0.4 pickled its modules


def _torchscript_bytes(graphmod: torch.nn.Module) -> bytes:
    from opt_einsum_fx import jitable  # what e3nn 0.4 scripted its generated code with

    buf = io.BytesIO()
    torch.jit.save(torch.jit.script(jitable(graphmod)), buf)
    return buf.getvalue()


@contextlib.contextmanager
def e3nn_04_pickling(tamper: torch.nn.Module | None = None) -> Iterator[None]:
    """While active, e3nn modules pickle in e3nn 0.4's layout.

    0.4 stored each generated submodule as raw TorchScript bytes (0.6: ("fx"|"torchscript", bytes)),
    and its SphericalHarmonics / Activation had no ``sph_func`` / ``paths``. ``tamper``: a module
    whose pickled path weights are scaled while its stored code is not (a corrupted file).
    """
    saved = {
        cls: cls.__dict__.get("__getstate__")
        for cls in (CodeGenMixin, o3.SphericalHarmonics, e3nn_nn.Activation)
    }
    codegen_getstate = CodeGenMixin.__getstate__

    def codegen_04(self):
        out = codegen_getstate(self)
        if "__codegen__" in out:
            out["__codegen__"] = {n: _torchscript_bytes(getattr(self, n)) for n in out["__codegen__"]}
        if self is tamper:
            out["instructions"] = [i._replace(path_weight=1.5 * i.path_weight) for i in out["instructions"]]
        return out

    def without(attr):
        def getstate(self):
            out = dict(torch.nn.Module.__getstate__(self))
            out.pop(attr, None)
            return out

        return getstate

    CodeGenMixin.__getstate__ = codegen_04
    o3.SphericalHarmonics.__getstate__ = without("sph_func")
    e3nn_nn.Activation.__getstate__ = without("paths")
    try:
        yield
    finally:
        for cls, fn in saved.items():
            if fn is None:
                delattr(cls, "__getstate__")
            else:
                cls.__getstate__ = fn


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def model_and_ref():
    model = build_model(interaction="RealAgnosticResidualInteractionBlock",
                        first="RealAgnosticInteractionBlock", hidden="8x0e+8x1o+8x2e")
    return model, evaluate(model, water_dimer())


@pytest.fixture()
def legacy_file(tmp_path: Path, model_and_ref) -> Path:
    path = tmp_path / "e3nn04.model"
    with e3nn_04_pickling():
        torch.save(model_and_ref[0], path)
    return path


# ---------------------------------------------------------------------------------------------
# e3nn 0.4 pickles


def test_e3nn04_file_fails_with_plain_torch_load(legacy_file: Path) -> None:
    # The hand-made file reproduces the real failure the loader exists for.
    with pytest.raises(ValueError, match="too many values to unpack"):
        torch.load(legacy_file, weights_only=False)


@pytest.mark.slow
def test_e3nn04_file_loads_patches_and_matches(legacy_file: Path, model_and_ref) -> None:
    _, ref = model_and_ref
    setstate_before = CodeGenMixin.__setstate__
    model = patches.load(legacy_file)
    assert pm.is_patched(model)
    assert_same_outputs(evaluate(model, water_dimer()), ref, tol=1e-10)
    # Scoped: e3nn itself is untouched, and ordinary files still load with ordinary torch.load.
    assert CodeGenMixin.__setstate__ is setstate_before
    buf = io.BytesIO()
    torch.save(build_model(), buf)
    buf.seek(0)
    assert type(torch.load(buf, weights_only=False).interactions[0].conv_tp) is o3.TensorProduct


def test_e3nn04_file_loads_without_warnings(legacy_file: Path) -> None:
    # reading e3nn 0.4's stored TorchScript is cgforge's business: no "torch.jit.load is deprecated" per module
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        patches.load(legacy_file)
    assert not [str(w.message) for w in caught if "torch.jit" in str(w.message)]


def test_e3nn04_modules_are_rebuilt_as_installed_e3nn_classes(legacy_file: Path, model_and_ref) -> None:
    model = pm.load_mace(legacy_file, patched=False)
    kinds = {type(m) for m in model.modules()}
    assert not any(issubclass(k, mace_legacy._LegacyE3nnModule) for k in kinds)
    assert {o3.TensorProduct, o3.FullyConnectedTensorProduct, o3.Linear, o3.SphericalHarmonics,
            e3nn_nn.Activation} <= kinds
    assert_same_outputs(evaluate(model, water_dimer()), model_and_ref[1], tol=1e-12)


def test_e3nn04_rebuild_is_checked_against_the_stored_code(tmp_path: Path, model_and_ref) -> None:
    model = model_and_ref[0]
    path = tmp_path / "corrupt.model"
    with e3nn_04_pickling(tamper=model.interactions[1].conv_tp):
        torch.save(model, path)
    with pytest.raises(mace_legacy.LegacyCheckpointError, match="interactions.1.conv_tp.*differs"):
        patches.load(path)


@pytest.mark.slow
def test_e3nn04_float32_file(tmp_path: Path) -> None:
    model = build_model(dtype=torch.float32)
    ref = evaluate(model, water_dimer())
    path = tmp_path / "f32.model"
    with e3nn_04_pickling():
        torch.save(model, path)
    loaded = patches.load(path)
    assert next(loaded.parameters()).dtype == torch.float32
    assert_same_outputs(evaluate(loaded, water_dimer()), ref, tol=1e-5)
    as64 = patches.load(path, dtype="float64")
    assert next(as64.parameters()).dtype == torch.float64


# ---------------------------------------------------------------------------------------------
# Older mace-torch pickles


def test_old_mace_pickle_without_buffers_is_upgraded_with_a_warning(tmp_path: Path, model_and_ref) -> None:
    model, ref = model_and_ref
    old = build_model(interaction="RealAgnosticResidualInteractionBlock",
                      first="RealAgnosticInteractionBlock", hidden="8x0e+8x1o+8x2e")
    r_max, numbers = float(old.r_max), [int(z) for z in old.atomic_numbers]
    for name in ("r_max", "atomic_numbers", "num_interactions"):
        del old._buffers[name]
    old.r_max, old.atomic_numbers = r_max, numbers  # as mace-torch 0.1/0.2 kept them
    del old.heads
    path = tmp_path / "old.model"
    torch.save(old, path)
    with pytest.warns(UserWarning, match="older mace-torch.*r_max, atomic_numbers, num_interactions, heads") as caught:
        loaded = patches.load(path)
    # one line naming the file: no line of cgforge's source under it
    (warning,) = [w for w in caught if "older mace-torch" in str(w.message)]
    assert (warning.filename, warning.lineno) == (str(path), 0)
    shown = warnings.formatwarning(warning.message, warning.category, warning.filename, warning.lineno)
    assert shown.strip().count("\n") == 0 and shown.startswith(f"{path}:0: UserWarning: MACE model pickled")
    assert isinstance(loaded.r_max, torch.Tensor) and float(loaded.r_max) == r_max
    assert loaded.atomic_numbers.tolist() == numbers
    assert int(loaded.num_interactions) == 2
    assert_same_outputs(evaluate(loaded, water_dimer()), ref, tol=1e-10)


def test_current_mace_pickle_loads_without_warning(tmp_path: Path, model_and_ref) -> None:
    model, ref = model_and_ref
    path = tmp_path / "new.model"
    torch.save(model, path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        loaded = patches.load(path)
    assert pm.is_patched(loaded)
    assert_same_outputs(evaluate(loaded, water_dimer()), ref, tol=1e-10)


# ---------------------------------------------------------------------------------------------
# A checkpoint written by mace's own trainer, patched through the CLI, run in MACECalculator


def _water_frames(n: int, seed: int) -> list:
    from ase.build import molecule
    from ase.calculators.emt import EMT

    rng = np.random.default_rng(seed)
    frames = []
    for _ in range(n):
        atoms = molecule("H2O") + molecule("H2O")
        atoms.positions[3:] += [2.8, 0.2, 0.1]
        atoms.positions += rng.normal(scale=0.05, size=atoms.positions.shape)
        atoms.cell, atoms.pbc = [6.0, 6.0, 6.0], True
        atoms.calc = EMT()
        atoms.info["REF_energy"] = atoms.get_potential_energy()
        atoms.arrays["REF_forces"] = atoms.get_forces()
        atoms.info["REF_stress"] = atoms.get_stress()
        atoms.calc = None
        frames.append(atoms)
    return frames


@pytest.fixture(scope="module")
def trained_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ase.io import write

    work = tmp_path_factory.mktemp("mace_train")
    write(work / "train.xyz", _water_frames(10, seed=0))
    trainer = Path(sys.executable).with_name("mace_run_train")
    cmd = [str(trainer), "--name", "tiny", "--train_file", "train.xyz", "--valid_fraction", "0.2",
           "--E0s", "average", "--model", "MACE", "--num_channels", "8", "--max_L", "1", "--r_max", "3.0",
           "--num_interactions", "2", "--correlation", "2", "--max_num_epochs", "1", "--batch_size", "4",
           "--valid_batch_size", "4", "--device", "cpu", "--default_dtype", "float64", "--seed", "1",
           "--energy_key", "REF_energy", "--forces_key", "REF_forces", "--stress_key", "REF_stress",
           "--num_radial_basis", "4", "--radial_MLP", "[8,8]"]
    result = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return work / "tiny.model"


@pytest.mark.slow  # > 10 s on a CPU: the full tier (CI) runs it
def test_trainer_checkpoint_patched_by_cli_matches(trained_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "tiny-cgforge.model"
    before = _sha(trained_model)
    assert cli_main(["patch", str(trained_model), str(out)]) == 0
    assert _sha(trained_model) == before
    plain = torch.load(trained_model, weights_only=False)
    patched = torch.load(out, weights_only=False)
    assert pm.is_patched(patched) and not pm.is_patched(plain)
    atoms = _water_frames(1, seed=5)[0]
    assert_same_outputs(evaluate(patched, atoms), evaluate(plain, atoms), tol=1e-10)


@pytest.mark.slow
def test_patched_file_runs_in_mace_calculator(trained_model: Path, tmp_path: Path) -> None:
    from mace.calculators import MACECalculator

    out = tmp_path / "calc.model"
    patches.save_patched(patches.load(trained_model), out)
    atoms = _water_frames(1, seed=6)[0]
    results = {}
    for name, path in (("plain", trained_model), ("patched", out)):
        calc = MACECalculator(model_paths=str(path), device="cpu", default_dtype="float64")
        if name == "patched":
            assert pm.is_patched(calc.models[0])
        atoms.calc = calc
        results[name] = {"energy": np.array(atoms.get_potential_energy()), "forces": atoms.get_forces(),
                         "stress": atoms.get_stress()}
    assert_same_outputs(results["patched"], results["plain"], tol=1e-10)


# ---------------------------------------------------------------------------------------------
# Bad files: clear errors, nothing written or changed


def _bad_files(tmp_path: Path, model_and_ref) -> dict[str, tuple[Path, type, str]]:
    good = tmp_path / "good.model"
    torch.save(model_and_ref[0], good)
    files = {}
    text = tmp_path / "frames.model"
    text.write_text("6\nLattice=\"6 0 0 0 6 0 0 0 6\"\nO 0 0 0\n")
    files["text"] = (text, ValueError, "not a readable torch checkpoint.*text file")
    truncated = tmp_path / "truncated.model"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    files["truncated"] = (truncated, ValueError, "truncated.model: not a readable torch checkpoint.*zip")
    empty = tmp_path / "empty.model"
    empty.write_bytes(b"")
    files["empty"] = (empty, ValueError, "empty file")
    state = tmp_path / "state.pt"
    torch.save({"model": model_and_ref[0].state_dict(), "optimizer": {}}, state)
    files["state_dict"] = (state, ValueError, "found a dict with keys \\[model, optimizer\\]")
    linear = tmp_path / "linear.model"
    torch.save(torch.nn.Linear(3, 3), linear)
    files["foreign model"] = (linear, ValueError, "expected a whole pickled MACE model.*torch.nn.*Linear")
    scripted = tmp_path / "tiny_compiled.model"
    torch.jit.save(torch.jit.script(torch.nn.Linear(3, 3)), scripted)
    files["torchscript"] = (scripted, ValueError, "TorchScript")
    unsupported = build_model()
    unsupported.interactions[1] = torch.nn.Identity()
    odd = tmp_path / "odd_block.model"
    torch.save(unsupported, odd)
    files["unsupported block"] = (odd, ValueError, "interactions.1.*Identity.*not supported")
    return files


def test_bad_files_give_clear_errors_and_stay_untouched(tmp_path: Path, model_and_ref) -> None:
    for label, (path, error, message) in _bad_files(tmp_path, model_and_ref).items():
        before = _sha(path)
        with pytest.raises(error, match=message):
            patches.load(path)
        out = tmp_path / f"{path.stem}-out.model"
        assert cli_main(["patch", str(path), str(out)]) == 1, label
        assert not out.exists(), label
        assert _sha(path) == before, label
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_missing_file_and_unknown_kind(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        patches.load(tmp_path / "nope.model")
    odd = tmp_path / "frames.xyz"
    odd.write_text("1\n\nH 0 0 0\n")
    with pytest.raises(ValueError, match="cannot tell the checkpoint type.*text file"):
        patches.load(odd)
    with pytest.raises(ValueError, match="dtype"):
        patches.load(odd.with_suffix(".model"), dtype="float16")


def test_nequip_files_are_dispatched_to_the_nequip_family(tmp_path: Path, monkeypatch) -> None:
    import types

    calls = []
    fake = types.ModuleType("cgforge.patches.nequip")
    fake.load_nequip = lambda path, device, dtype, patched, tuning: calls.append(
        (Path(path).name, str(device), dtype, patched, tuning)) or "model"
    monkeypatch.setitem(sys.modules, "cgforge.patches.nequip", fake)
    for name in ("run.ckpt", "deployed.nequip.zip"):
        assert patches.load(tmp_path / name, device="cpu", dtype="float32") == "model"
    assert calls == [("run.ckpt", "cpu", torch.float32, True, None),
                     ("deployed.nequip.zip", "cpu", torch.float32, True, None)]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype,tol", [("float64", 1e-10), ("float32", 1e-5)])
def test_e3nn04_file_loads_on_gpu(legacy_file: Path, model_and_ref, dtype: str, tol: float) -> None:
    model = patches.load(legacy_file, device="cuda", dtype=dtype)
    assert pm.is_patched(model) and next(model.parameters()).is_cuda
    assert_same_outputs(evaluate(model, water_dimer(), device="cuda"), model_and_ref[1], tol=tol)
