"""host_phases.py's attribution of the device's idle gaps to host phases (``idle_by_phase``) and bench_md's idle
from CUDA events (``event_gaps``, ``event_idle``, which host_phases --events prints), on synthetic timelines and a CPU
engine: no GPU needed. Run with ``.venv/bin/python -m pytest benchmarks/tests``."""

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


class _Stamp:
    """A stand-in for a CUDA event on a synthetic clock: recorded at the next time of ``times``."""

    def __init__(self, times: list[float]) -> None:
        self.times, self.at = times, None

    def record(self) -> None:
        self.at = self.times.pop(0)

    def elapsed_time(self, later: _Stamp) -> float:
        return later.at - self.at


def test_event_gaps_take_the_idle_after_each_report_and_behind_each_search() -> None:
    times = [0.0, 10.0, 12.0, 14.5, 30.0, 31.0]
    kinds = ["start", "search", "install", "end", "start", "end"]
    marks = []
    for kind in kinds:
        event = _Stamp(times)
        event.record()
        marks.append((kind, event))
    gaps = host_phases.bench_md.event_gaps(marks)
    assert gaps == {"boundary": [15.5], "search": [2.0]}  # the last report has nothing after it


@pytest.mark.slow
def test_event_idle_marks_every_block_of_a_cpu_engine() -> None:
    """On a CPU engine (the device is the host): one boundary gap between each pair of blocks, each shorter than the
    run, the engine's methods restored after."""
    import time

    from cgforge.plugin import Calculator
    from cgforge.plugin.md.engine import Engine
    from cgforge.plugin.md.integrators import VelocityVerlet
    from cgforge.plugin.water import water_box

    class Clock:
        def __init__(self) -> None:
            self.at = None

        def record(self) -> None:
            self.at = time.perf_counter()

        def elapsed_time(self, later) -> float:
            return 1e3 * (later.at - self.at)

    atoms = water_box(4, seed=1)
    calc = Calculator("mace", device="cpu", dtype="float64", skin=0.5)
    engine = Engine(calc, atoms, VelocityVerlet(0.5), block=3)
    engine.run(2)
    blocks = engine.stats["blocks"]
    wall, gaps = host_phases.bench_md.event_idle(engine, 9, new_event=Clock)
    ran = engine.stats["blocks"] - blocks  # 3 blocks of 3, or more where the list's slack shortened one
    assert ran >= 3 and len(gaps["boundary"]) == ran - 1
    assert all(0 <= g < 1e3 * wall for g in gaps["boundary"]) and "_run_block" not in vars(engine)
