"""cgforge as a user installs it: a wheel built from the source, installed non-editable, run from a folder outside
the repository (issue 63).

The wheel is built from a copy of the package (no build/ or egg-info left in the checkout, no stale file of an
earlier build in it) and installed with `pip install --no-deps --no-index --target DIR`: the dependencies come
from the running environment, nothing from the network. Every command runs with PYTHONPATH=DIR from an empty
folder, so the installed copy is the one imported (checked: ``cgforge.__file__`` lies under DIR), never the
checkout's. One process per command, tiny systems: the whole module is one slow test's worth of time.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import cgforge
from cgforge.plugin.runtime.bundled import MODEL_FILES

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "cgforge", source / "cgforge", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w",
          str(out), str(source)], cwd=out)
    (path,) = out.glob("cgforge-*.whl")
    return path


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str], Path]:
    """(the install folder, the environment that imports from it, an empty working folder outside the repo)."""
    target = tmp_path_factory.mktemp("site")
    _run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(target),
          str(wheel)], cwd=target)
    work = tmp_path_factory.mktemp("work")
    assert ROOT not in work.parents
    env = {**os.environ, "PYTHONPATH": str(target), "OMP_NUM_THREADS": "1"}
    return target, env, work


def test_the_wheel_holds_the_models_and_the_kernel_templates(wheel: Path) -> None:
    assert wheel.name == f"cgforge-{cgforge.__version__}-py3-none-any.whl"
    names = set(zipfile.ZipFile(wheel).namelist())
    for file in (*MODEL_FILES.values(), "README.md"):
        assert f"cgforge/models/{file}" in names
    templates = {Path(n).name for n in names if n.startswith("cgforge/kernels/templates/")}
    assert templates == {p.name for p in (ROOT / "cgforge" / "kernels" / "templates").glob("*.cu.j2")} != set()
    assert {f"cgforge/{p.relative_to(ROOT / 'cgforge').as_posix()}" for p in (ROOT / "cgforge").rglob("*.py")} <= names
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/", "scripts/")) or "__pycache__" in n]


def test_the_installed_package_runs_from_outside_the_repository(installed) -> None:
    target, env, work = installed
    cgforge_cli = str(target / "bin" / "cgforge")

    done = _run([cgforge_cli, "doctor"], work, env)
    assert f"cgforge          {cgforge.__version__}" in done.stdout
    assert "[  ok] MACE models" in done.stdout and "[  ok] NequIP models" in done.stdout, done.stdout

    done = _run([cgforge_cli, "md", "--molecules", "4", "--steps", "4", "--relax", "0", "--log-interval", "2",
                 "--device", "cpu"], work, env)  # the default model, the default trajectory name
    (trajectory,) = work.glob("md-*.traj")
    from ase.io import read

    frames = read(trajectory, ":")
    assert [f.info["md_step"] for f in frames] == [0, 4] and len(frames[-1]) == 12
    assert frames[-1].info["md_model"] == "mace" and math.isfinite(frames[-1].info["md_epot"])

    done = _run([cgforge_cli, "patch", "mace", "patched.model"], work, env)
    assert "wrote patched MACE model" in done.stdout and (work / "patched.model").stat().st_size > 10_000
    done = _run([cgforge_cli, "lammps-model", "nequip", "water.mliap.pkl"], work, env)
    assert "pair_style mliap unified water.mliap.pkl" in done.stdout and (work / "water.mliap.pkl").is_file()

    # the calculator with both bundled models, and the patched file loaded back, in one process
    script = (
        "import cgforge, torch\n"
        "from cgforge.patches import families\n"
        "from cgforge.plugin import Calculator, water_box\n"
        "print(cgforge.__file__)\n"
        "for name in ('mace', 'nequip'):\n"
        "    atoms = water_box(4)\n"
        "    atoms.calc = Calculator(name, device='cpu')\n"
        "    print(name, atoms.get_potential_energy() / len(atoms), abs(atoms.get_forces()).max())\n"
        "model = torch.load('patched.model', weights_only=False)\n"
        "print('patched', families.family_of(model).is_patched(model))\n"
    )
    lines = _run([sys.executable, "-c", script], work, env).stdout.splitlines()
    assert Path(lines[0]).is_relative_to(target), lines[0]  # the wheel's copy, not the checkout's
    energies = []
    for line, name in zip(lines[1:3], ("mace", "nequip")):
        kind, energy, force = line.split()
        assert kind == name and math.isfinite(float(energy)) and 0 < float(force) < 50, line
        energies.append(float(energy))
    assert abs(energies[0] - energies[1]) < 0.02, energies  # eV/atom: both imitate q-SPC/Fw to a few meV/atom
    assert lines[3] == "patched True"
    assert sorted(p.name for p in work.iterdir()) == sorted([trajectory.name, "patched.model", "water.mliap.pkl"])
