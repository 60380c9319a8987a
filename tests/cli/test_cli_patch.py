"""`cgforge patch` / `cgforge unpatch`: safe file handling, loadable results."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from mace_helpers import assert_same_outputs, build_model, evaluate, water_dimer

from cgforge import patches
from cgforge.patches import mace as pm
from cgforge.plugin.cli import main


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    model = build_model()
    path = tmp_path_factory.mktemp("cli") / "plain.model"
    torch.save(model, path)
    return path, evaluate(model, water_dimer())


def test_patch_writes_a_patched_copy_and_leaves_input_alone(model_file, tmp_path: Path) -> None:
    src, ref = model_file
    before, mtime = _sha(src), src.stat().st_mtime_ns
    out = tmp_path / "patched.model"
    assert main(["patch", str(src), str(out)]) == 0
    assert _sha(src) == before and src.stat().st_mtime_ns == mtime
    model = torch.load(out, weights_only=False)
    assert pm.is_patched(model)
    assert_same_outputs(evaluate(model, water_dimer()), ref, tol=1e-10)
    assert oct(out.stat().st_mode & 0o777) == oct(0o666 & ~_umask())
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_patch_refuses_to_overwrite_without_force(model_file, tmp_path: Path, capsys) -> None:
    src, _ = model_file
    out = tmp_path / "exists.model"
    out.write_bytes(b"keep me")
    assert main(["patch", str(src), str(out)]) == 1
    err = capsys.readouterr().err
    assert "exists" in err and "--force" in err
    assert out.read_bytes() == b"keep me"
    assert main(["patch", str(src), str(out), "--force"]) == 0
    assert pm.is_patched(torch.load(out, weights_only=False))


def test_patch_never_writes_over_its_input(model_file, tmp_path: Path, capsys) -> None:
    src = tmp_path / "same.model"
    src.write_bytes(model_file[0].read_bytes())
    before = _sha(src)
    assert main(["patch", str(src), str(src), "--force"]) == 1
    assert "same file" in capsys.readouterr().err
    assert _sha(src) == before


def test_failed_write_leaves_no_output_and_no_temp_file(model_file, tmp_path: Path, monkeypatch) -> None:
    src, _ = model_file
    out = tmp_path / "old.model"
    out.write_bytes(b"previous version")

    def broken_save(obj, f, *args, **kwargs):
        f.write(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    assert main(["patch", str(src), str(out), "--force"]) == 1
    assert out.read_bytes() == b"previous version"
    assert sorted(os.listdir(tmp_path)) == ["old.model"]


def test_patch_dtype_option(model_file, tmp_path: Path) -> None:
    out = tmp_path / "f32.model"
    assert main(["patch", str(model_file[0]), str(out), "--dtype", "float32"]) == 0
    model = torch.load(out, weights_only=False)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert_same_outputs(evaluate(model, water_dimer()), model_file[1], tol=1e-5)


def test_patch_of_a_patched_file_is_idempotent(model_file, tmp_path: Path) -> None:
    once, twice = tmp_path / "once.model", tmp_path / "twice.model"
    assert main(["patch", str(model_file[0]), str(once)]) == 0
    assert main(["patch", str(once), str(twice)]) == 0
    model = torch.load(twice, weights_only=False)
    assert len(model._forward_pre_hooks) == 1
    assert_same_outputs(evaluate(model, water_dimer()), model_file[1], tol=1e-10)


@pytest.mark.slow
def test_unpatched_file_loads_without_cgforge(model_file, tmp_path: Path) -> None:
    src, ref = model_file
    patched, plain = tmp_path / "p.model", tmp_path / "plain-again.model"
    assert main(["patch", str(src), str(patched)]) == 0
    assert main(["unpatch", str(patched), str(plain)]) == 0
    assert not pm.is_patched(torch.load(plain, weights_only=False))
    # A fresh interpreter in which importing cgforge fails: the file must not need it.
    script = (
        "import sys; sys.modules['cgforge'] = None\n"
        "import torch\n"
        "from mace.calculators import MACECalculator\n"
        "from ase import Atoms\n"
        f"calc = MACECalculator(model_paths={str(plain)!r}, device='cpu', default_dtype='float64')\n"
        "pos = [[0,0,0],[0.96,0,0],[-0.24,0.93,0],[2.6,0.3,0.1],[3.2,1.0,0.3],[3.1,-0.6,0.2]]\n"
        "a = Atoms('OHHOHH', positions=pos, cell=[5.0, 5.2, 5.4], pbc=True); a.calc = calc\n"
        "print(repr(a.get_potential_energy()))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    energy = float(result.stdout.strip().splitlines()[-1])
    assert abs(energy - float(ref["energy"][0])) <= 1e-10 * abs(float(ref["energy"][0]))


@pytest.mark.smoke
def test_missing_input_and_bad_arguments(tmp_path: Path, capsys) -> None:
    assert main(["patch", str(tmp_path / "nope.model"), str(tmp_path / "out.model")]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "out.model").exists()
    with pytest.raises(SystemExit) as exit_info:
        main(["patch", "a.model", "b.model", "--dtype", "float16"])
    assert exit_info.value.code == 2
    with pytest.raises(SystemExit):
        main([])


def test_unpatch_refuses_non_mace_input(tmp_path: Path, capsys) -> None:
    src = tmp_path / "run.ckpt"
    src.write_bytes(b"not really")
    assert main(["unpatch", str(src), str(tmp_path / "out.model")]) == 1
    assert "not one" in capsys.readouterr().err
    assert not (tmp_path / "out.model").exists()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_load_returns_a_patched_model_on_the_requested_device(model_file, device, dtype) -> None:
    model = patches.load(model_file[0], device=device, dtype=dtype)  # the file: an FP64 model saved on the CPU
    assert pm.is_patched(model)
    tensors = [*model.parameters(), *model.buffers()]
    assert {t.device.type for t in tensors} == {device}
    assert {t.dtype for t in tensors if t.is_floating_point()} == {getattr(torch, dtype)}
    assert np.isfinite(evaluate(model, water_dimer(), device=device)["energy"]).all()
    with pytest.raises(ValueError, match="device"):
        patches.load(model_file[0], device="tpu")


@pytest.mark.slow
def test_doctor_reports_and_compiles():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "cgforge.plugin.cli", "doctor"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "nvrtc" in done.stdout.lower()
    assert "e3nn" in done.stdout
    assert "[  ok] generated tensor product (sm_80)" in done.stdout  # the whole generator, CUDA compiled


@pytest.mark.parametrize("command", ["patch", "unpatch"])
def test_mace_output_names_are_checked_before_loading(model_file, tmp_path: Path, capsys, command) -> None:
    """As for NequIP (OUT must be a .nequip.zip), a MACE OUT must be named like a MACE model file."""
    src, _ = model_file
    for name in ("patched.zip", "patched", "patched.nequip.zip", "patched.nequip.pth", "patched.ckpt"):
        assert main([command, str(src), str(tmp_path / name)]) == 1, name
        err = capsys.readouterr().err
        assert f"OUT: {tmp_path / name} must end with .model, .pt, .pth" in err, err
    assert os.listdir(tmp_path) == []
    before = _sha(src)
    assert main([command, str(src), str(src), "--force"]) == 1  # never over IN, even with --force
    assert "same file" in capsys.readouterr().err and _sha(src) == before


def test_patch_and_unpatch_name_the_family_they_wrote(model_file, tmp_path: Path, capsys) -> None:
    src, _ = model_file
    assert main(["patch", str(src), str(tmp_path / "p.model")]) == 0
    assert f"wrote patched MACE model to {tmp_path / 'p.model'}" in capsys.readouterr().out
    assert main(["unpatch", str(tmp_path / "p.model"), str(tmp_path / "u.model")]) == 0
    assert f"wrote plain MACE model to {tmp_path / 'u.model'}" in capsys.readouterr().out
    assert not pm.is_patched(torch.load(tmp_path / "u.model", weights_only=False))


def _deny_writes_to(monkeypatch, directory: Path) -> None:
    """``directory`` as a read-only mount or a user without write permission sees it (root writes anyway)."""
    import cgforge.atomic

    real = os.access
    monkeypatch.setattr(cgforge.atomic.os, "access", lambda p, mode, *a, **k: False if Path(p) == directory
                        and mode & os.W_OK else real(p, mode, *a, **k))


def _no_model_loads(monkeypatch) -> None:
    import cgforge.plugin.lammps
    from cgforge.patches import families

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before OUT's directory was checked")

    monkeypatch.setattr(families, "load", refuse)
    monkeypatch.setattr(cgforge.plugin.lammps, "CgforgeMLIAP", refuse)


@pytest.mark.parametrize("command", ["patch", "unpatch", "lammps-model"])
def test_unwritable_out_directory_is_named_before_any_work(model_file, tmp_path: Path, capsys, monkeypatch,
                                                           command) -> None:
    src = str(model_file[0]) if command != "lammps-model" else "mace"  # lammps-model: the bundled model too
    locked = tmp_path / "locked"
    locked.mkdir()
    out = locked / ("out.pkl" if command == "lammps-model" else "out.model")
    _deny_writes_to(monkeypatch, locked)
    _no_model_loads(monkeypatch)
    assert main([command, src, str(out)]) == 1
    err = capsys.readouterr().err
    assert f"OUT: cannot write {out}: directory {locked} is not writable" in err, err
    assert os.listdir(locked) == []


def test_unwritable_out_directory_at_write_time_names_out_not_the_temporary_file(model_file, tmp_path: Path,
                                                                                 capsys, monkeypatch) -> None:
    """The directory turns read-only after the checks (or os.access says yes and the write is refused)."""
    import tempfile

    src, _ = model_file
    locked = tmp_path / "locked"
    locked.mkdir()
    out = locked / "out.model"
    real = tempfile.mkstemp

    def mkstemp(*args, dir=None, **kwargs):
        if dir is not None and Path(dir) == locked:
            raise OSError(30, "Read-only file system", str(locked / ".out.model.abc123.tmp"))
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    assert main(["patch", str(src), str(out)]) == 1
    err = capsys.readouterr().err
    assert f"cannot write {out}: directory {locked} is not writable (Read-only file system)" in err, err
    assert ".tmp" not in err
    assert os.listdir(locked) == []


def test_out_inside_a_file_is_refused_before_loading(model_file, tmp_path: Path, capsys, monkeypatch) -> None:
    src, _ = model_file
    (tmp_path / "notes.txt").write_text("a file, not a directory")
    out = tmp_path / "notes.txt" / "out.model"
    _no_model_loads(monkeypatch)
    assert main(["patch", str(src), str(out)]) == 1
    err = capsys.readouterr().err
    assert f"OUT: cannot write {out}: {tmp_path / 'notes.txt'} is a file, not a directory" in err, err
    assert (tmp_path / "notes.txt").read_text() == "a file, not a directory"


def test_patch_takes_the_bundled_names(tmp_path: Path, capsys) -> None:
    """`cgforge patch mace OUT` reads the bundled MACE file (as `cgforge md` and `lammps-model` take the names):
    OUT is checked against that file's family before loading, and the bundled file itself is never OUT."""
    from cgforge.plugin.runtime.bundled import model_path

    assert main(["patch", "MACE", str(tmp_path / "out.nequip.zip")]) == 1
    assert f"OUT: {tmp_path / 'out.nequip.zip'} must end with .model" in capsys.readouterr().err
    assert main(["patch", "nequip", str(tmp_path / "out.model")]) == 1
    assert ".nequip.zip" in capsys.readouterr().err
    before = _sha(model_path("mace"))
    assert main(["patch", "mace", str(model_path("mace")), "--force"]) == 1
    assert "same file" in capsys.readouterr().err and _sha(model_path("mace")) == before
    assert os.listdir(tmp_path) == []


def test_patch_bundled_names_resolve_to_their_files(tmp_path: Path, capsys) -> None:
    """'mace' and 'nequip' name the bundled models as in `cgforge md` and `lammps-model` (issue 63); the OUT
    checks of the family that name resolves to answer first, before any load."""
    from cgforge.plugin.runtime.bundled import NAMES

    assert NAMES == ("mace", "nequip")
    assert main(["patch", "nequip", str(tmp_path / "out.model")]) == 1
    err = capsys.readouterr().err
    assert "OUT: " in err and "must end with .nequip.zip" in err  # IN was found to be a NequIP package
    assert main(["unpatch", "NEQUIP", str(tmp_path / "out.nequip.zip")]) == 1
    err = capsys.readouterr().err
    assert "IN: " not in err and "does not exist" not in err and not (tmp_path / "out.nequip.zip").exists()
    assert main(["patch", "mace", str(tmp_path / "out.model")]) == 0
    assert "wrote patched MACE model" in capsys.readouterr().out
    assert patches.families.family_of(torch.load(tmp_path / "out.model", weights_only=False)).name == "mace"


def test_a_nequip_package_or_an_mliap_file_given_as_a_mace_checkpoint_says_what_it_is(tmp_path: Path, capsys) -> None:
    """Where a MACE checkpoint is expected (its suffix, or IN of `cgforge patch`), a NequIP package or the file
    `cgforge lammps-model` writes (pickle or torch.save) is named for what it is, not with torch's message."""
    from cgforge.plugin.lammps import CgforgeMLIAP
    from cgforge.plugin.lammps.write import write_lammps_model
    from cgforge.plugin.runtime.bundled import model_path

    package = tmp_path / "package.model"
    package.write_bytes(model_path("nequip").read_bytes())
    mliap = CgforgeMLIAP("mace", patch=False)
    pkl, pt = write_lammps_model(mliap, tmp_path / "w.pkl"), write_lammps_model(mliap, tmp_path / "w.pt")
    renamed = tmp_path / "w.model"
    renamed.write_bytes(pkl.read_bytes())
    not_mace, lammps = "not a MACE checkpoint", "this is a LAMMPS ML-IAP file written by cgforge lammps-model"
    cases = {package: ("this is a NequIP package", not_mace, "NAME.nequip.zip"), pt: (lammps, not_mace),
             renamed: (lammps, not_mace), pkl: (lammps, "not a checkpoint (a MACE .model")}
    for path, parts in cases.items():
        assert main(["patch", str(path), str(tmp_path / "out.model")]) == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"cgforge patch: error: {path}: {parts[0]}, ") and "\n" not in err, err
        assert all(part in err for part in parts) and "torch.load" not in err, err
        assert not (tmp_path / "out.model").exists()
    with pytest.raises(ValueError, match="this is a NequIP package, not a MACE checkpoint"):
        patches.load(package)
