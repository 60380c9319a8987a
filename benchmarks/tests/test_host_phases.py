"""host_phases.py's attribution of the device's idle gaps to host phases (``idle_by_phase``), on synthetic
timelines: no GPU needed. Run with ``.venv/bin/python -m pytest benchmarks/tests``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

INVESTIGATIONS = Path(__file__).resolve().parents[1] / "investigations"
sys.path.insert(0, str(INVESTIGATIONS))
import host_phases  # noqa: E402

sys.path.remove(str(INVESTIGATIONS))


def test_each_piece_of_a_long_gap_goes_to_the_innermost_phase_running_through_it() -> None:
    spans = [(0.0, 10.0, "a"), (50.0, 60.0, "b"), (70.0, 75.0, "c"), (100.0, 110.0, "d"), (200.0, 210.0, "e")]
    ranges = [(5.0, 120.0, "engine._run_block"), (12.0, 40.0, "provider.search"),
              (40.0, 55.0, "engine._read_report")]
    idle = host_phases.idle_by_phase(spans, ranges, min_gap_us=20.0)
    # gap 10-50: 2 us in the block alone, 28 in the search, 10 in the report's wait; 60-70 is too short;
    # 75-100 in the block; 110-200: 10 us in the block, then 80 with no phase
    assert idle == pytest.approx({"engine._run_block": 2.0 + 25.0 + 10.0, "provider.search": 28.0,
                                  "engine._read_report": 10.0, host_phases.NO_PHASE: 80.0})


def test_overlapping_device_activity_leaves_no_gap() -> None:
    spans = [(0.0, 100.0, "long"), (10.0, 20.0, "inside"), (130.0, 140.0, "after")]
    assert host_phases.idle_by_phase(spans, [], min_gap_us=20.0) == {host_phases.NO_PHASE: 30.0}
    assert host_phases.idle_by_phase(spans, [], min_gap_us=31.0) == {}
