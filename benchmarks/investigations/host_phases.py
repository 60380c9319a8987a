"""What the host does in the engine's blocks: its time in each phase, and how often the list is searched.

    python3 benchmarks/investigations/host_phases.py [--model bundled-mace] [--steps 300] [--ensemble npt] [--attribute]
        [--events]

The device idles in gaps of the step when the host has queued nothing (issue 62): at a list's last block the host
searches the next list (host ops, and reads of the device that wait for the search's kernels), queues its install
and reads the block's report. This runs ``--steps`` engine steps (NVT Langevin, or bench_md's NPT with ``--ensemble
npt``; FP32, the engine's defaults, the graphs captured first) with the engine's, the force provider's and the
search's methods wrapped in timers, and prints the host's ms per step in each (phases nest: ``_run_block`` holds the
others), calls per step, the engine's stats (rebuilds, discarded steps) and the mean steps a list lived. With
``--attribute`` the steps run under torch.profiler, each phase a ``record_function`` range, and the device's idle time
in gaps of at least bench_md's ``LONG_GAP_US`` is charged to the innermost host phase running through it
(``idle_by_phase``): what the host was doing while the device waited; the profiler slows the host's launches, so
these gaps are upper bounds. ``--events`` then runs ``--steps`` more with neither profiler nor timers and CUDA events
recorded where the engine stops queueing and starts again (``bench_md.event_idle``): the device's idle at each block boundary
and behind a search that outlasts its hiding steps, as an unprofiled run has them. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import tempfile
import time
import types
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
import bench_md  # noqa: E402
import profile_engine  # noqa: E402
from common import device_spans  # noqa: E402

from cgforge.plugin.md.engine import Engine  # noqa: E402

ENGINE_PHASES = ("_run_block", "_read_report", "_plan_block", "_replay", "_install", "_rebuild", "_take_snapshot")
PROVIDER_PHASES = ("snapshot", "search", "can_install_ahead", "install")
# module functions the search calls through a module attribute (wrapped where they are looked up)
FUNCTIONS = (("cgforge.plugin.md.forces", "neighbour_list"), ("cgforge.plugin.runtime.neighbours", "_bin_atoms"),
             ("cgforge.plugin.runtime.neighbours", "candidate_pairs"),
             ("cgforge.plugin.runtime.neighbours", "edges_within"))


NO_PHASE = "(no wrapped phase: the engine loop)"


def idle_by_phase(spans: list[tuple[float, float, str]], ranges: list[tuple[float, float, str]],
                  min_gap_us: float = bench_md.LONG_GAP_US) -> dict[str, float]:
    """The device's idle time (us) in gaps of at least ``min_gap_us`` between its activities ``spans`` ((start, end,
    name), by start, as ``common.device_spans``), charged piece by piece to the innermost host range of ``ranges``
    ((start, end, label) on the same clock; nested phases: the shortest that holds the piece) running through it, or
    to ``NO_PHASE``."""
    gaps, end = [], None
    for start, stop, _ in spans:
        if end is not None and start - end >= min_gap_us:
            gaps.append((end, start))
        end = stop if end is None else max(end, stop)
    out: dict[str, float] = defaultdict(float)
    for g0, g1 in gaps:
        cuts = sorted({g0, g1, *(t for r0, r1, _ in ranges for t in (r0, r1) if g0 < t < g1)})
        for a, b in zip(cuts, cuts[1:]):
            mid = 0.5 * (a + b)
            active = [(r1 - r0, label) for r0, r1, label in ranges if r0 <= mid < r1]
            out[min(active)[1] if active else NO_PHASE] += b - a
    return dict(out)


def host_phases(engine: Engine, steps: int, attribute: bool = False
                ) -> tuple[float, dict[str, tuple[float, int]], dict[str, float] | None]:
    """Wall seconds of ``steps`` engine steps, per phase (host seconds, calls), each phase wrapped in a timer, and
    with ``attribute`` the device's idle us in long gaps by host phase (``idle_by_phase``; else None)."""
    total: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)

    def timed(label, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                with torch.profiler.record_function(label) if attribute else contextlib.nullcontext():
                    return fn(*a, **k)
            finally:
                total[label] += time.perf_counter() - t
                calls[label] += 1
        return wrapper

    undo = []
    targets = [(engine, "engine", n) for n in ENGINE_PHASES] + [(engine.provider, "provider", n)
                                                                 for n in PROVIDER_PHASES]
    targets += [(engine.provider.step, "step", "list_topology")]
    targets += [(importlib.import_module(m), m.rsplit(".", 1)[1], n) for m, n in FUNCTIONS]
    for owner, label, name in targets:
        original = getattr(owner, name)
        setattr(owner, name, timed(f"{label}.{name}", original))
        undo.append((owner, name, original))
    replay = torch.cuda.CUDAGraph.replay
    torch.cuda.CUDAGraph.replay = timed("CUDAGraph.replay", replay)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    try:
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=activities) if attribute else contextlib.nullcontext() as prof:
            t = time.perf_counter()
            engine.run(steps)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t
    finally:
        torch.cuda.CUDAGraph.replay = replay
        for owner, name, original in undo:
            if isinstance(owner, types.ModuleType):
                setattr(owner, name, original)
            else:
                delattr(owner, name)  # the instance attribute shadowed the class's method
    idle = None
    if attribute:
        ranges = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                  if e.device_type.name == "CPU" and e.name in total]
        idle = idle_by_phase(device_spans(prof), ranges)
    return wall, {k: (v, calls[k]) for k, v in total.items()}, idle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bundled-mace", choices=profile_engine.MODELS)
    parser.add_argument("--molecules", type=int, default=1728)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--ensemble", default="nvt", choices=("nvt", "npt"))
    parser.add_argument("--attribute", action="store_true", help="charge the device's idle gaps to host phases")
    parser.add_argument("--events", action="store_true",
                        help="also the idle at block boundaries and behind the search, from CUDA events (no profiler)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("host_phases: needs a CUDA GPU")
    atoms = profile_engine.make(args.molecules)
    with tempfile.TemporaryDirectory() as folder:
        calc = profile_engine.calculator(args.model, folder, None)
        engine = Engine(calc, atoms.copy(), bench_md.md_integrator(args.ensemble), seed=1,
                        max_temperature_K=float("inf"))
        engine.run(40)  # the graphs captured first
        before = dict(engine.stats)
        wall, phases, idle = host_phases(engine, args.steps, args.attribute)
        if args.events:
            marked_before = engine.stats["steps"]
            events_wall, gaps = bench_md.event_idle(engine, args.steps)
            events_steps = engine.stats["steps"] - marked_before
    stats = {k: engine.stats[k] - before[k] for k in ("steps", "blocks", "discarded", "rebuilds",
                                                        "overlapped_rebuilds", "captures", "grows")}
    n = stats["steps"]
    print(f"{args.model}, {len(atoms)} atoms: {1e3 * wall / n:.3f} ms a step over {n} steps; {stats}; "
          f"a list lived {n / max(stats['rebuilds'], 1):.1f} steps")
    print(f"{'phase':34} {'host ms/step':>12} {'calls/step':>10} {'ms/call':>8}")
    for name, (seconds, count) in sorted(phases.items(), key=lambda kv: -kv[1][0]):
        print(f"  {name:32} {1e3 * seconds / n:12.3f} {count / n:10.3f} {1e3 * seconds / count:8.3f}")

    if args.events:
        print(f"CUDA events, a second run of {events_steps} steps with no profiler and no timers: "
              f"{1e3 * events_wall / events_steps:.3f} ms a step")
        for name, values in gaps.items():
            mean = sum(values) / len(values) if values else 0.0
            print(f"  idle {name:9} {sum(values) / events_steps:8.4f} ms a step, {len(values)} gaps of {mean:.4f} ms "
                  f"(largest {max(values, default=0.0):.4f})")
    if idle is not None:
        print(f"device idle in gaps >= {bench_md.LONG_GAP_US:g} us, ms a step, by the host phase running through it "
              f"(innermost): {1e-3 * sum(idle.values()) / n:.3f} in all")
        for name, us in sorted(idle.items(), key=lambda kv: -kv[1]):
            print(f"  {name:40} {1e-3 * us / n:8.3f}")


if __name__ == "__main__":
    main()
