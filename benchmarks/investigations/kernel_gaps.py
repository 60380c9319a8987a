"""Where the engine's captured step idles: the gaps between its kernels, by the pair of kernels around each gap.

    python3 benchmarks/investigations/kernel_gaps.py [--model bundled-mace] [--steps 20] [--top 20] [--carveout PCT]
                                                     [--trace FILE.json]

profile_engine.py reports a captured step as kernel time plus "time between kernels" (0.77 ms of the bundled
MACE's 2.09 ms on an H200, 2.9 us a kernel; NequIP M 0.8 us a kernel). This profiles ``--steps`` captured engine
steps (NVT Langevin, FP32, the engine's defaults) with the CUDA activity, orders the kernels and copies by start,
and charges each idle interval of the device (no kernel running on any stream) to the kernel that ended before it
and the one that started after it. Prints the step's wall time, its busy and idle time per step, and the pairs
with the most idle time. ``--carveout PCT``: every cgforge kernel asks for PCT % of the unified L1 as shared
memory (``CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT``) as it loads: does a change of the SMs' L1/shared
split between kernels show as gaps? Then (unprofiled, ``--steps`` x 10 steps) the host's time in each phase of the
engine's blocks (its methods and the force provider's, and ``CUDAGraph.replay``), wrapped in timers: what the host
does while the device waits at a block's start. ``--trace``: the profile as a Chrome trace too (host ops and
device activity on one time line: which host call a gap waits for). Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
import profile_engine  # noqa: E402
from common import device_spans, device_timeline  # noqa: E402

from cgforge.plugin.md.engine import Engine  # noqa: E402
from cgforge.plugin.md.integrators import Langevin  # noqa: E402


def short(name: str, width: int = 70) -> str:
    return name if len(name) <= width else name[:width - 3] + "..."


def prefer_carveout(percent: int) -> None:
    """Every cgforge kernel loaded from now on prefers ``percent`` % of its SM's L1 as shared memory."""
    from cupy.cuda import driver

    from cgforge.kernels.core import runtime

    load, done = runtime.KernelHandle._function, set()

    def function(self, device):
        fn = load(self, device)
        if fn.ptr not in done:
            driver.funcSetAttribute(fn.ptr, 9, percent)  # CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
            done.add(fn.ptr)
        return fn

    runtime.KernelHandle._function = function


HOST_PHASES = {"engine": ("_queue_block", "_finish", "_read_report", "_plan_block", "_replay", "_install", "_rebuild",
                          "_take_snapshot"),
               "provider": ("snapshot", "search", "install")}


def host_phases(engine: Engine, steps: int) -> list[tuple[str, float, int]]:
    """(phase, host ms per step, calls) of ``steps`` engine steps, each phase's method wrapped in a timer."""
    total: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)

    def timed(label, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                total[label] += time.perf_counter() - t
                calls[label] += 1
        return wrapper

    targets = {"engine": engine, "provider": engine.provider}
    for owner, names in HOST_PHASES.items():
        for name in names:
            setattr(targets[owner], name, timed(f"{owner}.{name}", getattr(targets[owner], name)))
    replay = torch.cuda.CUDAGraph.replay
    torch.cuda.CUDAGraph.replay = timed("CUDAGraph.replay", replay)
    try:
        torch.cuda.synchronize()
        t = time.perf_counter()
        engine.run(steps)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    finally:
        torch.cuda.CUDAGraph.replay = replay
    rows = [("wall", wall, 1)] + sorted(((k, v, calls[k]) for k, v in total.items()), key=lambda r: -r[1])
    return [(name, 1e3 * seconds / steps, count) for name, seconds, count in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bundled-mace", choices=profile_engine.MODELS)
    parser.add_argument("--molecules", type=int, default=1728)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--carveout", type=int, default=None, metavar="PCT")
    parser.add_argument("--trace", default=None, metavar="FILE", help="also write the profile as a Chrome trace")
    args = parser.parse_args()
    if args.carveout is not None:
        prefer_carveout(args.carveout)
    if not torch.cuda.is_available():
        sys.exit("kernel_gaps: needs a CUDA GPU")
    atoms = profile_engine.make(args.molecules)
    with tempfile.TemporaryDirectory() as folder:
        calc = profile_engine.calculator(args.model, folder, None)
        engine = Engine(calc, atoms.copy(), Langevin(0.5, 300.0, 0.01), seed=1, max_temperature_K=float("inf"))
        engine.run(40)  # the graphs captured before the profile
        torch.cuda.synchronize()
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if args.trace else [])
        with profile(activities=activities, with_stack=bool(args.trace)) as prof:
            engine.run(args.steps)
            torch.cuda.synchronize()
        if args.trace:
            prof.export_chrome_trace(args.trace)
        phases = host_phases(engine, 10 * args.steps)
    spans = device_spans(prof)
    if not spans:
        sys.exit("kernel_gaps: the profile holds no device activity")
    n = args.steps
    line = device_timeline(spans, n)
    idle, count, gaps = line["idle_by_pair_us"], line["gaps_by_pair"], line["gaps_us"]
    print(f"{args.model}: {n} captured steps, {line['activities']:.0f} device activities a step "
          f"({line['kernels']:.0f} kernels); per step: wall {line['wall_ms']:.3f} ms, busy {line['busy_ms']:.3f} ms, "
          f"idle {line['idle_ms']:.3f} ms")
    print(f"{'idle us/step':>12} {'gaps/step':>9} {'us/gap':>7}  before -> after")
    for pair, total in sorted(idle.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"{total / n:12.1f} {count[pair] / n:9.1f} {total / count[pair]:7.2f}  "
              f"{short(pair[0])}\n{'':32}-> {short(pair[1])}")
    if gaps:
        q = [gaps[int(f * (len(gaps) - 1))] for f in (0.1, 0.5, 0.9, 0.99)]
        print(f"gap quantiles (us): 10% {q[0]:.2f}, 50% {q[1]:.2f}, 90% {q[2]:.2f}, 99% {q[3]:.2f}")
    print(f"host time per step over {10 * n} steps (the engine's phases nest: _queue_block and _finish hold the others)")
    for name, ms, count in phases:
        print(f"  {name:28} {ms:8.3f} ms/step  {count:6d} calls")


if __name__ == "__main__":
    main()
