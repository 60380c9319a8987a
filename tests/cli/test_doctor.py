"""`cgforge doctor` names a CUDA major mismatch between torch, CuPy and NVRTC, with the extra that fixes it
(versions monkeypatched: this CPU machine has a CPU torch)."""

from __future__ import annotations

import pytest
import torch

from cgforge.kernels.core import compiler
from cgforge.plugin.cli import doctor


@pytest.mark.parametrize("torch_cuda,cupy,nvrtc,expected", [
    ("12.8", ["cupy-cuda12x"], (12, 9), [(True, "torch CUDA 12.8, cupy-cuda12x, NVRTC 12.9")]),
    ("13.0", ["cupy-cuda13x"], (13, 0), [(True, "torch CUDA 13.0, cupy-cuda13x, NVRTC 13.0")]),
    ("13.0", ["cupy-cuda12x"], (13, 0), [(False, "torch is built for CUDA 13.0 but CuPy is cupy-cuda12x (CUDA 12): "
                                                 "pip uninstall cupy-cuda12x; pip install 'cgforge[cuda13]'")]),
    ("12.6", ["cupy-cuda12x"], (13, 1), [(False, "torch is built for CUDA 12.6 but NVRTC is 13.1: "
                                                 "pip uninstall nvidia-cuda-nvrtc; pip install 'cgforge[cuda12]'")]),
    ("13.0", [], None, [(True, "torch CUDA 13.0, no CuPy, no NVRTC")]),
    ("11.8", ["cupy-cuda12x"], (12, 9), [(False, "but CuPy is cupy-cuda12x (CUDA 12): pip uninstall cupy-cuda12x; "
                                                 "no cgforge extra for CUDA 11"), (False, "but NVRTC is 12.9")]),
    (None, ["cupy-cuda12x"], (12, 9), [(True, "torch is a CPU build")]),
])
def test_cuda_version_checks(torch_cuda, cupy, nvrtc, expected):
    checks = doctor.cuda_version_checks(torch_cuda, cupy, nvrtc)
    assert [ok for ok, _ in checks] == [ok for ok, _ in expected]
    for (_, detail), (_, part) in zip(checks, expected):
        assert part in detail


def test_two_cupy_wheels_are_named():
    checks = doctor.cuda_version_checks("13.0", ["cupy-cuda12x", "cupy-cuda13x"], (13, 0))
    assert not checks[0][0] and "several CuPy wheels are installed (cupy-cuda12x, cupy-cuda13x)" in checks[0][1]
    assert not checks[1][0] and "pip uninstall cupy-cuda12x;" in checks[1][1]


def test_doctor_reports_a_mismatch_with_the_fix(monkeypatch):
    """torch for CUDA 13 with the CUDA 12 wheels (what `pip install cgforge[cuda]` used to give): a warning
    line per component with the fix; the doctor still passes, since a mix runs (the driver is newer)."""
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(doctor, "_cupy_distributions", lambda: ["cupy-cuda12x"])
    monkeypatch.setattr(compiler, "nvrtc_available", lambda: True)
    monkeypatch.setattr(compiler, "nvrtc_version", lambda: (12, 9))
    monkeypatch.setattr(compiler, "nvrtc_library_path", lambda: "/site/nvidia/cuda_nvrtc/lib/libnvrtc.so.12")
    monkeypatch.setattr(doctor, "_cupy_version", lambda: "14.2.0 (cupy-cuda12x)")
    # the compile checks need no patching to show the mismatch: skip them (they are tested in test_cli_patch)
    monkeypatch.setattr(doctor, "_check_compile", lambda report, arch: None)
    monkeypatch.setattr(doctor, "_check_generated_tp", lambda report, torch, gpu: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    lines: list[str] = []
    assert doctor.main(lines.append) == 0
    text = "\n".join(lines)
    assert "torch            2" in text and "(CUDA 13.0)" in text
    assert ("[warn] CUDA versions match: torch is built for CUDA 13.0 but CuPy is cupy-cuda12x (CUDA 12): "
            "pip uninstall cupy-cuda12x; pip install 'cgforge[cuda13]' (cupy-cuda13x and nvidia-cuda-nvrtc)") in text
    assert ("[warn] CUDA versions match: torch is built for CUDA 13.0 but NVRTC is 12.9: "
            "pip uninstall nvidia-cuda-nvrtc-cu12; pip install 'cgforge[cuda13]'") in text


def test_doctor_names_the_extra_when_nvrtc_is_missing(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(compiler, "nvrtc_available", lambda: False)

    def missing():
        raise compiler.NvrtcUnavailableError("libnvrtc not found (tried: nowhere)")

    monkeypatch.setattr(compiler, "nvrtc_version", missing)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    lines: list[str] = []
    assert doctor.main(lines.append) == 1
    assert ("[FAIL] nvrtc found: pip install 'cgforge[cuda12]' (cupy-cuda12x and nvidia-cuda-nvrtc-cu12)"
            in "\n".join(lines))


def test_doctor_prints_the_kernel_tuning_and_names_ignored_variables(monkeypatch):
    """The kernels' options: the default tuning, every knob; a leftover tuning variable is named as ignored (the
    three the compiler reads are not)."""
    monkeypatch.setattr(doctor, "_check_compile", lambda report, arch: None)
    monkeypatch.setattr(doctor, "_check_generated_tp", lambda report, torch, gpu: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CGFORGE_LOOP_ORDER", "edges")
    monkeypatch.setenv("CGFORGE_CACHE_DISABLE", "1")
    lines: list[str] = []
    doctor.main(lines.append)
    text = "\n".join(lines)
    assert "kernel tuning    the defaults" in text
    assert "TPTuning       forward_chunk=None, backward_chunk=None, loop_order='auto'" in text
    assert "SCTuning       block=128, chunk=16, pairings=('pq',)" in text
    ignored = next(line for line in lines if "ignored variables" in line)
    assert "CGFORGE_LOOP_ORDER" in ignored and "CGFORGE_CACHE_DISABLE" not in ignored


def _environment(**versions: str):
    """A version lookup of a made-up environment: the given versions, 'not installed' for anything else."""
    return lambda dist: versions.get(dist, "not installed")


ALL_DEPENDENCIES = {"torch": "2.13.0", "numpy": "2.1", "torch-ema": "0.3"}


@pytest.mark.parametrize("environment, mace, nequip", [
    # both (the dev environment: mace-torch --no-deps next to e3nn 0.6)
    ({"e3nn": "0.6.0", "mace-torch": "0.3.16", "nequip": "0.19.1"},
     (True, "mace-torch 0.3.16, e3nn 0.6.0 (mace-torch pins e3nn==0.4.4; cgforge runs MACE with either)"),
     (True, "nequip 0.19.1, e3nn 0.6.0")),
    # MACE only, with its pin: nequip is refused for the e3nn, with the fix
    ({"e3nn": "0.4.4", "mace-torch": "0.3.16", "nequip": "0.19.1"},
     (True, "mace-torch 0.3.16, e3nn 0.4.4"),
     (False, "cannot load: nequip 0.19.1 needs e3nn >= 0.6, this environment has e3nn 0.4.4 (pip install "
             "'e3nn>=0.6,<0.7'")),
    # NequIP only
    ({"e3nn": "0.6.0", "nequip": "0.19.1"},
     (False, "cannot load: mace-torch is not installed (pip install --no-deps mace-torch==0.3.16 after its "
             "dependencies"),
     (True, "nequip 0.19.1, e3nn 0.6.0")),
    # an untested version loads, and says so
    ({"e3nn": "0.6.1.dev0", "mace-torch": "0.3.14", "nequip": "0.20.0"},
     (True, "mace-torch 0.3.14, e3nn 0.6.1.dev0 (mace-torch pins e3nn==0.4.4; cgforge runs MACE with either); "
            "cgforge is tested with mace-torch 0.3.16"),
     (True, "nequip 0.20.0, e3nn 0.6.1.dev0; cgforge is tested with nequip 0.19.1")),
])
def test_family_checks_say_which_families_load_and_why_not(environment, mace, nequip):
    lines = doctor.family_checks(_environment(**environment, **ALL_DEPENDENCIES), lambda dist: ["torch", "e3nn"])
    assert [family for family, _, _ in lines] == ["MACE", "NequIP"]
    for (_, ok, why), (expected_ok, expected_why) in zip(lines, (mace, nequip)):
        assert ok == expected_ok and why.startswith(expected_why), why


def test_family_checks_name_a_missing_dependency_and_doctor_prints_a_line_per_family(monkeypatch):
    """mace-torch goes in with --no-deps: a dependency it needs and lacks is named (e3nn is judged by version)."""
    environment = _environment(**{"e3nn": "0.6.0", "mace-torch": "0.3.16", "nequip": "0.19.1", "torch": "2.13"})
    requirements = {"mace-torch": ["torch", "e3nn", "torch-ema", "prettytable"], "nequip": ["torch", "e3nn"]}
    lines = doctor.family_checks(environment, requirements.__getitem__)
    assert lines[0] == ("MACE", False, "cannot load: mace-torch 0.3.16 needs torch-ema, prettytable, not installed "
                                       "(pip install torch-ema prettytable)")
    assert lines[1][:2] == ("NequIP", True)
    monkeypatch.setattr(doctor, "family_checks", lambda: lines)
    monkeypatch.setattr(doctor, "_check_compile", lambda report, arch: None)
    monkeypatch.setattr(doctor, "_check_generated_tp", lambda report, torch, gpu: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    printed: list[str] = []
    doctor.main(printed.append)
    assert "  [warn] MACE models: cannot load: mace-torch 0.3.16 needs torch-ema" in "\n".join(printed)
    assert sum(line.startswith("  [  ok] NequIP models: nequip 0.19.1") for line in printed) == 1
