"""The examples run as a user runs them: `python examples/<name>.py` in a scratch directory, small arguments.

With one OpenMP thread each (set here unless the environment sets it) they took 3 s and 4 s on the 2 shared cores
at load 3 (at load 13 with torch's default threads: 54 s and 145 s); on 2026-11-29, 8 s and 10 s on 2 cores: both
are `slow` (the full tier, CI)."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from ase.io import read

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run_example(name: str, *args: str, cwd: Path) -> str:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    done = subprocess.run([sys.executable, str(EXAMPLES / name), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, f"{name} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_tensor_product_example_matches_e3nn(tmp_path: Path) -> None:
    out = run_example("tensor_product.py", cwd=tmp_path)
    errors = [float(e) for e in re.findall(r"vs e3nn: relative error ([0-9.e+-]+)", out)]
    assert len(errors) == 2, out  # the fused convolution and the tensor product
    assert max(errors) < 1e-5, out  # FP32 inputs
    assert "backward ok" in out
    assert not list(tmp_path.iterdir()), "the example wrote files"


def test_water_md_example_runs_a_few_steps(tmp_path: Path) -> None:
    traj = tmp_path / "water.traj"
    out = run_example("water_md.py", "--molecules", "8", "--relax", "5", "--steps", "5", "--device", "cpu",
                      "--seed", "1", "-o", str(traj), cwd=tmp_path)
    assert "24 atoms" in out and "relaxed 5 FIRE steps" in out, out
    assert re.search(r"done: 5 steps", out) and "final temperature" in out, out
    frames = read(traj, ":")
    assert len(frames) >= 2 and all(len(f) == 24 for f in frames)
    assert frames[-1].info["md_step"] == 5 and math.isfinite(frames[-1].get_potential_energy())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["water.traj"]
