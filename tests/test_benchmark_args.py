"""The benchmark scripts name a bad flag and exit non-zero before they need a GPU (the flags this project's GPU
sessions pass them: a typo must not cost a device call)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.parametrize("script, args, named", [
    ("streaming_memory.py", ["--calls", "energy,force"], "--calls"),
    ("streaming_memory.py", ["--backward-range-gb", "0"], "--backward-range-gb"),
    ("bench_md.py", ["--backward-range-gb", "-2", "--device", "cpu"], "--backward-range-gb"),
    ("bench_layer.py", ["mace-huge"], "mace-huge"),
    ("bench_layer.py", ["--tuning", "loop_order=rows"], "loop_order=rows"),
    ("bench_layer.py", ["--tuning", "backward_min_blocks=99"], "backward_min_blocks"),
    ("bench_layer.py", ["--tuning", "chunk=64"], "chunk=64"),
])
def test_a_bad_flag_is_named_and_exits_non_zero(script: str, args: list[str], named: str) -> None:
    run = subprocess.run([sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode != 0
    assert named in run.stderr, run.stderr[-2000:]
