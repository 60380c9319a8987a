"""What the host does in the engine's blocks: its time in each phase, and how often the list is searched.

    python3 benchmarks/investigations/host_phases.py [--model bundled-mace] [--steps 300] [--ensemble npt]

The device idles in gaps of the step when the host has queued nothing (issue 62): at a list's last block the host
searches the next list (host ops, and reads of the device that wait for the search's kernels), queues its install
and reads the block's report. This runs ``--steps`` engine steps (NVT Langevin, or bench_md's NPT with ``--ensemble
npt``; FP32, the engine's defaults, the graphs captured first) with the engine's, the force provider's and the
search's methods wrapped in timers, and prints the host's ms per step in each (phases nest: ``_run_block`` holds the
others), calls per step, the engine's stats (rebuilds, discarded steps) and the mean steps a list lived. Needs a
CUDA GPU.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
import time
import types
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
import profile_engine  # noqa: E402

from cgforge.plugin.md.engine import Engine  # noqa: E402

ENGINE_PHASES = ("_run_block", "_read_report", "_plan_block", "_replay", "_install", "_rebuild", "_take_snapshot")
PROVIDER_PHASES = ("snapshot", "search", "can_install_ahead", "install")
# module functions the search calls through a module attribute (wrapped where they are looked up)
FUNCTIONS = (("cgforge.plugin.md.forces", "neighbour_list"), ("cgforge.plugin.runtime.neighbours", "_bin_atoms"),
             ("cgforge.plugin.runtime.neighbours", "candidate_pairs"),
             ("cgforge.plugin.runtime.neighbours", "edges_within"))


def host_phases(engine: Engine, steps: int) -> tuple[float, dict[str, tuple[float, int]]]:
    """Wall seconds of ``steps`` engine steps and, per phase, (host seconds, calls), each phase wrapped in a timer."""
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
    try:
        torch.cuda.synchronize()
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
    return wall, {k: (v, calls[k]) for k, v in total.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bundled-mace", choices=profile_engine.MODELS)
    parser.add_argument("--molecules", type=int, default=1728)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--ensemble", default="nvt", choices=("nvt", "npt"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("host_phases: needs a CUDA GPU")
    atoms = profile_engine.make(args.molecules)
    with tempfile.TemporaryDirectory() as folder:
        calc = profile_engine.calculator(args.model, folder, None)
        engine = Engine(calc, atoms.copy(), profile_engine.integrator(args.ensemble), seed=1,
                        max_temperature_K=float("inf"))
        engine.run(40)  # the graphs captured first
        before = dict(engine.stats)
        wall, phases = host_phases(engine, args.steps)
    stats = {k: engine.stats[k] - before[k] for k in ("steps", "blocks", "discarded", "rebuilds",
                                                        "overlapped_rebuilds", "captures", "grows")}
    n = stats["steps"]
    print(f"{args.model}, {len(atoms)} atoms: {1e3 * wall / n:.3f} ms a step over {n} steps; {stats}; "
          f"a list lived {n / max(stats['rebuilds'], 1):.1f} steps")
    print(f"{'phase':34} {'host ms/step':>12} {'calls/step':>10} {'ms/call':>8}")
    for name, (seconds, count) in sorted(phases.items(), key=lambda kv: -kv[1][0]):
        print(f"  {name:32} {1e3 * seconds / n:12.3f} {count / n:10.3f} {1e3 * seconds / count:8.3f}")


if __name__ == "__main__":
    main()
