"""scripts/lammps_gpu.sh (the GPU machine's LAMMPS build) up to its configure step, on fake sources, and the
pieces of benchmarks/bench_lammps.py that need no LAMMPS: build kinds, launchers, failure reasons.

The real builds are checked by hand (the CPU --plain build, the Kokkos CUDA configure; see the script's header).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "lammps_gpu.sh"

# the three Kokkos 4.3.01 lines CUDA 13 breaks, as they stand there
KOKKOS_INSTANCE = """  cudaError_t f() const {
    return cudaMemAdvise(devPtr, count, advice, device);
  }
  cudaError_t g() const {
    return cudaMemPrefetchAsync(devPtr, count, dstDevice,
                                get_input_stream(stream));
  }
  cudaError_t h() const {
    return cudaGraphAddDependencies(graph, from, to, numDependencies);
  }
"""


def _tarball(path: Path, files: dict[str, str], top: str = "") -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            member = path.parent / "staging" / top / name
            member.parent.mkdir(parents=True, exist_ok=True)
            member.write_text(text)
        tar.add(path.parent / "staging" / top, arcname=top or ".")
    return path


def _run(args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def _last(run: subprocess.CompletedProcess) -> str:
    return run.stdout.strip().splitlines()[-1]


def test_unknown_option_fails_with_its_name(tmp_path):
    run = _run(["--cuda", str(tmp_path / "dest")])
    assert run.returncode != 0
    assert _last(run).startswith("FAILED: unknown option --cuda")


def test_missing_tarball_names_the_variable(tmp_path):
    run = _run(["--plain", str(tmp_path / "dest")], {"CGFORGE_LAMMPS_TARBALL": str(tmp_path / "none.tar.gz")})
    assert run.returncode != 0
    assert _last(run).startswith("FAILED: CGFORGE_LAMMPS_TARBALL:")


def test_dest_of_another_mode_is_refused(tmp_path):
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / ".mode").write_text("plain\n")
    run = _run(["--kokkos-host", str(dest)])
    assert run.returncode != 0
    assert "holds a 'plain' build" in _last(run)


def test_kokkos_sources_are_adapted_and_trimmed_once(tmp_path):
    """A fake LAMMPS (under a top folder) and Kokkos: extraction, the CUDA 13 edits (idempotent), the removal of
    unneeded KOKKOS style twins; the fake CMake project then fails the configure step with a FAILED line."""
    lammps = _tarball(tmp_path / "lammps.tar.gz", {
        "cmake/CMakeLists.txt": ('cmake_minimum_required(VERSION 3.16)\nproject(fake NONE)\n'
                                 'message(FATAL_ERROR "fake")\n'),
        "cmake/Modules/Packages/KOKKOS.cmake": "set(S ${DIR}/kokkos.cpp ${DIR}/fix_nh_kokkos.cpp)\n",
        "src/KOKKOS/kokkos.cpp": "", "src/KOKKOS/fix_nh_kokkos.cpp": "", "src/KOKKOS/fix_nh_kokkos.h": "",
        "src/KOKKOS/pair_mliap_kokkos.cpp": '#include "pair_mliap_kokkos.h"\n', "src/KOKKOS/pair_mliap_kokkos.h": "",
        "src/KOKKOS/pair_lj_cut_kokkos.cpp": "", "src/KOKKOS/pair_lj_cut_kokkos.h": "",
        "src/KOKKOS/pair_snap_kokkos.cpp": "", "src/KOKKOS/sna_kokkos.h": "",
        # a style twin a kept file includes stays
        "src/KOKKOS/fix_property_atom_kokkos.cpp": "", "src/KOKKOS/fix_property_atom_kokkos.h": "",
        "src/KOKKOS/atom_kokkos.cpp": '#include "fix_property_atom_kokkos.h"\n',
        "src/ML-IAP/pair_mliap.cpp": "", "src/lammps.cpp": "",
    }, top="lammps-29Aug2024")
    kokkos = _tarball(tmp_path / "kokkos.tar.gz", {
        "CMakeLists.txt": "", "core/src/Cuda/Kokkos_Cuda_Instance.hpp": KOKKOS_INSTANCE,
        "bin/nvcc_wrapper": 'default_arch="sm_70"\n',
    }, top="kokkos")
    dest = tmp_path / "dest"
    env = {"CGFORGE_LAMMPS_TARBALL": str(lammps), "CGFORGE_KOKKOS_TARBALL": str(kokkos)}
    run = _run(["--kokkos-host", str(dest)], env)
    assert run.returncode != 0
    assert _last(run).startswith("FAILED:"), run.stdout
    src = dest / "src"
    header = (src / "lib" / "kokkos" / "core" / "src" / "Cuda" / "Kokkos_Cuda_Instance.hpp").read_text()
    assert header.count("#if CUDART_VERSION >= 13000") == 3
    assert "cudaGraphAddDependencies(graph, from, to, nullptr, numDependencies)" in header
    assert "cudaMemAdvise(devPtr, count, advice, loc)" in header
    assert 'default_arch="sm_90"' in (src / "lib" / "kokkos" / "bin" / "nvcc_wrapper").read_text()
    kept = {p.name for p in (src / "src" / "KOKKOS").iterdir()}
    assert {"pair_mliap_kokkos.cpp", "fix_nh_kokkos.cpp", "kokkos.cpp", "fix_property_atom_kokkos.h"} <= kept
    assert not kept & {"pair_lj_cut_kokkos.cpp", "pair_lj_cut_kokkos.h", "pair_snap_kokkos.cpp", "sna_kokkos.h"}
    # a second call (the edit step redone) edits nothing twice
    (src / "lib" / "kokkos" / ".ready").unlink()
    _run(["--kokkos-host", str(dest)], env)
    again = (src / "lib" / "kokkos" / "core" / "src" / "Cuda" / "Kokkos_Cuda_Instance.hpp").read_text()
    assert again == header


# the switch of LAMMPS 22 Jul 2025's kokkos.cpp that sends pair communication through the host path when MPI is
# not GPU-aware (as it stands there, in its block)
PAIR_COMM_SWITCH = """  if ((!gpu_aware_flag && nmpi > 1) || lmp->pair_only_flag) {
    if (forward_pair_comm_classic == 0) {
      forward_pair_comm_classic = 1;
      forward_pair_comm_changed = 1;
    }
    if (reverse_pair_comm_classic == 0) {
      reverse_pair_comm_classic = 1;
      reverse_pair_comm_changed = 1;
    }
  }
"""


def test_pair_communication_stays_on_the_device_path_edited_once(tmp_path):
    """Without GPU-aware MPI, LAMMPS would send ML-IAP's exchanged features through the host path that reads
    device memory (a segfault on two GPUs): the build keeps them on the device path with host-staged MPI, except
    for pair/only runs; a second call edits nothing twice."""
    lammps = _tarball(tmp_path / "lammps.tar.gz", {
        "cmake/CMakeLists.txt": 'cmake_minimum_required(VERSION 3.16)\nproject(fake NONE)\nmessage(FATAL_ERROR "x")\n',
        "cmake/Modules/Packages/KOKKOS.cmake": "", "src/KOKKOS/kokkos.cpp": PAIR_COMM_SWITCH, "src/lammps.cpp": "",
        "src/ML-IAP/pair_mliap.cpp": "",
        "lib/kokkos/CMakeLists.txt": "", "lib/kokkos/core/src/Cuda/Kokkos_Cuda_Instance.hpp": "CUDART_VERSION >= 13000",
        "lib/kokkos/bin/nvcc_wrapper": 'default_arch="sm_90"\n',
    }, top="lammps")
    dest = tmp_path / "dest"
    env = {"CGFORGE_LAMMPS_TARBALL": str(lammps), "CGFORGE_KOKKOS_TARBALL": str(tmp_path / "none.tar.gz")}
    run = _run(["--kokkos-host", str(dest)], env)
    assert "pair communication kept on the device path" in run.stdout, run.stdout
    edited = (dest / "src" / "src" / "KOKKOS" / "kokkos.cpp").read_text()
    for kind in ("forward", "reverse"):
        assert f"if ({kind}_pair_comm_classic == 0 && lmp->pair_only_flag) {{" in edited
    assert edited.replace(" && lmp->pair_only_flag) {  // CGFORGE_PAIRCOMM", ") {") == PAIR_COMM_SWITCH
    (dest / "src" / ".paircomm").unlink()
    _run(["--kokkos-host", str(dest)], env)
    assert (dest / "src" / "src" / "KOKKOS" / "kokkos.cpp").read_text() == edited


def test_a_kokkos_that_handles_cuda13_is_not_edited(tmp_path):
    """LAMMPS 22 Jul 2025 brings lib/kokkos 4.6.2, whose wrappers pick the CUDA 13 forms themselves: left as is."""
    old = "    return cudaMemAdvise(devPtr, count, advice, device);\n"
    new = "    return cudaMemAdvise(devPtr, count, advice, loc);\n"
    native = KOKKOS_INSTANCE.replace(old, "#if CUDART_VERSION >= 13000\n" + new + "#else\n" + old + "#endif\n")
    lammps = _tarball(tmp_path / "lammps.tar.gz", {
        "cmake/CMakeLists.txt": 'cmake_minimum_required(VERSION 3.16)\nproject(fake NONE)\nmessage(FATAL_ERROR "x")\n',
        "cmake/Modules/Packages/KOKKOS.cmake": "", "src/KOKKOS/kokkos.cpp": "", "src/lammps.cpp": "",
        "lib/kokkos/CMakeLists.txt": "", "lib/kokkos/core/src/Cuda/Kokkos_Cuda_Instance.hpp": native,
        "lib/kokkos/bin/nvcc_wrapper": 'default_arch="sm_80"\n',
    }, top="lammps")
    dest = tmp_path / "dest"
    run = _run(["--kokkos-host", str(dest)], {"CGFORGE_LAMMPS_TARBALL": str(lammps),
                                               "CGFORGE_KOKKOS_TARBALL": str(tmp_path / "none.tar.gz")})
    assert "handles CUDA >= 13 itself" in run.stdout and _last(run).startswith("FAILED:"), run.stdout
    kokkos = dest / "src" / "lib" / "kokkos"
    assert (kokkos / "core" / "src" / "Cuda" / "Kokkos_Cuda_Instance.hpp").read_text() == native
    assert (kokkos / "bin" / "nvcc_wrapper").read_text() == 'default_arch="sm_80"\n'


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_lammps", ROOT / "benchmarks" / "bench_lammps.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def test_bench_build_kinds_and_launchers(bench, tmp_path, monkeypatch):
    kk = tmp_path / "kk"
    (kk / "src" / "build").mkdir(parents=True)
    (kk / ".mode").write_text("kokkos\n")
    build = bench.Build.find(str(kk))
    assert (build.kind, build.kokkos) == ("kokkos", True)
    assert "no liblammps.so" in build.unusable()
    (kk / "src" / "build" / "liblammps.so").write_text("")
    assert "not finished" in build.unusable()
    (kk / ".built").write_text("")
    assert build.unusable() is None
    assert build.launcher(1) == []
    monkeypatch.setattr(bench.shutil, "which", lambda name: None)
    assert "need an MPI build" in build.launcher(2)
    monkeypatch.setattr(bench.shutil, "which", lambda name: "/usr/bin/mpirun")  # the machine's MPI, one GPU a rank
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert build.launcher(2) == ["/usr/bin/mpirun", "-np", "2"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert "need 2 GPUs, found 1" in build.launcher(2)
    mpi = tmp_path / "mpi"
    (mpi / "tools" / "bin").mkdir(parents=True)
    (mpi / "tools" / "bin" / "mpirun").write_text("")
    found = bench.Build.find(str(mpi))
    assert found.kind == "mpi" and not found.kokkos
    assert found.launcher(2) == [str(mpi / "tools" / "bin" / "mpirun"), "-np", "2"]


def test_bench_failure_reason_is_the_python_exception(bench):
    output = ("LAMMPS (29 Aug 2024)\nTraceback (most recent call last):\n  File x\nAttributeError: 'MLIAPDataPy' "
              "object has no attribute 'forward_exchange'\nERROR: Running mliappy unified compute_forces failure.\n")
    assert bench._why(output).startswith("AttributeError: 'MLIAPDataPy'")
    assert bench._why("ERROR: Unrecognized pair style 'mliap/kk'\n").startswith("ERROR: Unrecognized")
    assert bench._why("") == "no output"


def test_bench_case_results_timeouts_and_late_failures(bench):
    """A case's RESULT counts even when the process fails after it; no RESULT is an error; a hang times out."""
    result = 'import json; print("RESULT " + json.dumps({"ms_per_step": 2.0}), flush=True)'
    env = dict(os.environ)
    ok = bench._run_case([sys.executable, "-c", result], env, 60)
    assert ok["ms_per_step"] == 2.0 and "exit" not in ok and "error" not in ok
    late = bench._run_case([sys.executable, "-c", result + "; raise SystemExit('teardown')"], env, 60)
    assert late["ms_per_step"] == 2.0 and late["exit"] == 1 and "error" not in late
    failed = bench._run_case([sys.executable, "-c", "raise ValueError('no model')"], env, 60)
    assert failed["error"] == "exit 1: ValueError: no model"
    hung = bench._run_case([sys.executable, "-c", "import time; time.sleep(60)"], env, 1)
    assert hung["error"] == "timed out after 1 s"
    # a warning printed before the hang is not given as its cause; an exception is
    warned = "import sys, time; print('UserWarning-ish: falling back to JIT', flush=True); time.sleep(60)"
    assert bench._run_case([sys.executable, "-c", warned], env, 1)["error"] == "timed out after 1 s"
    raised = "import time; print('ValueError: bad box', flush=True); time.sleep(60)"
    assert bench._run_case([sys.executable, "-c", raised], env, 1)["error"] == ("timed out after 1 s: "
                                                                              "ValueError: bad box")


@pytest.mark.parametrize("flag, value", [("--budget", "-9"), ("--budget", "0"), ("--timeout", "0")])
def test_bench_refuses_a_spent_budget(flag, value):
    """A budget or timeout of no seconds is refused by name before anything is built (a run once got a negative
    budget from a shell's arithmetic and skipped every row)."""
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_lammps.py"), flag, value],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and flag in run.stderr and "more than 0" in run.stderr, run.stderr
