"""bench_md's engine rows say what their timed steps held (captures, rebuilds): a step timed across a graph's
capture is not a steady step. On the CPU, the bundled NequIP on a small box."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_md  # noqa: E402

from cgforge.plugin.water import water_box  # noqa: E402


@pytest.mark.slow
def test_an_engine_row_counts_what_its_timed_steps_held(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench_md, "DEVICE", "cpu")
    monkeypatch.setattr(bench_md, "MD", dict(bench_md.MD, steps=6, warmup=2, ensembles=("nvt",)))
    atoms = water_box(8)
    row = bench_md.measure_md("bundled-nequip", "cgforge-engine", "float32", atoms, {})
    timed = row["nvt_timed"]
    assert set(timed) == {*bench_md.TIMED_STATS, "invalidations"}
    assert timed["blocks"] >= 1 and timed["captures"] == 0  # no CUDA graphs on the CPU
    assert 0 <= timed["rebuilds"] <= row["nvt_stats"]["rebuilds"]  # a part of the run's, which began before
    assert "timed steps: captures 0" in bench_md.md_details(row)


def test_ase_rows_have_no_timed_engine_stats() -> None:
    row = {"nvt_s": 0.01, "nvt_ns_per_day": 4.3, "model": "bundled-mace", "backend": "cgforge-ase"}
    assert "timed steps" not in bench_md.md_details(row)
