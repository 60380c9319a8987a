"""What the MD engine's neighbour-list rebuilds cost (one GPU), and the step without them.

    python benchmarks/engine_rebuild.py [--model bundled-mace] [--molecules 1728] [--steps 200]
                                        [--skins 0.5,1,1.5,2] [--compile]

For each skin (NVT Langevin, FP32, 0.5 fs, on the box profile_engine.py relaxes): ms per engine step over
``--steps`` steps with its rebuild count, then the parts of one rebuild timed with device syncs (the search,
loading the list into the step's buffers) and the captured one-step graph replayed alone (the step without
rebuilds or block syncs). The difference between the engine's ms/step and the replayed step is what
rebuilds and block syncs cost per step. Prints a table; JSON goes to benchmarks/results/ (or $OUT).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import environment, write_json  # noqa: E402
from profile_engine import make  # noqa: E402

from cgforge.plugin.calculator import Calculator  # noqa: E402
from cgforge.plugin.md.engine import Engine  # noqa: E402
from cgforge.plugin.md.integrators import Langevin  # noqa: E402
from cgforge.plugin.runtime.neighbours import neighbour_list  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, repeats: int) -> float:
    """Median ms of ``fn()`` between device syncs."""
    times = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(1000 * (time.perf_counter() - t))
    return sorted(times)[len(times) // 2]


def _time_methods(engine: Engine, names: tuple[str, ...]) -> dict[str, float]:
    """Wrap the engine's methods ``names`` with wall-clock timers (seconds summed per name, filled as it runs):
    _read_report's time is mostly the wait for the block's GPU work."""
    totals = dict.fromkeys(names, 0.0)
    for name in names:
        method = getattr(engine, name)

        def timed_method(*args, _method=method, _name=name, **kwargs):
            t = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                totals[_name] += time.perf_counter() - t

        setattr(engine, name, timed_method)
    return totals


def measure(model: str, atoms, skin: float, steps: int, compile_mode: str | None, device: str, block: int,
            pipelined: bool) -> dict:
    calc = Calculator(model.split("-")[1], device=device, dtype="float32", skin=skin, compile=compile_mode or False)
    engine = Engine(calc, atoms.copy(), Langevin(0.5, 300.0, 0.01), seed=1, max_temperature_K=float("inf"),
                    block=block, pipelined_rebuild=pipelined)
    engine.run(40)  # capture (and compilation) and the first blocks
    sync()
    before = dict(engine.stats)
    host = _time_methods(engine, ("_rebuild", "_install", "_read_report", "_replay", "_capture", "_plan_block"))
    t = time.perf_counter()
    engine.run(steps)
    sync()
    ms_step = 1000 * (time.perf_counter() - t) / steps
    host_ms = {name: 1000 * seconds / steps for name, seconds in host.items()}
    rebuilds = engine.stats["rebuilds"] - before["rebuilds"]
    blocks = engine.stats["blocks"] - before["blocks"]
    provider, state, pbc = engine.provider, engine.state, engine.pbc
    step = provider.step
    nl = calc.neighbours
    pos, cell = step.positions, step.cell
    search = timed(lambda: neighbour_list(pos, cell, pbc, nl.list_cutoff), 10)
    rebuild = timed(lambda: provider.rebuild(state.positions, state.cell), 10)
    graph = engine._graphs.get(1) if engine._graphs else None
    replay = timed(graph.replay, 50) if graph is not None else float("nan")
    row = {"skin": skin, "block": block, "pipelined": pipelined, "compile": compile_mode, "ms_per_step": ms_step, "rebuilds": rebuilds, "blocks": blocks,
           "steps": steps, "search_ms": search, "rebuild_ms": rebuild, "replay_ms": replay,
           "list_pairs": int(nl.sender.shape[0]), "capacity": step.capacity,
           "discarded": engine.stats["discarded"] - before["discarded"],
           "captures": engine.stats["captures"] - before["captures"],
           "overlapped": engine.stats["overlapped_rebuilds"] - before["overlapped_rebuilds"], "host_ms_per_step": host_ms}
    print(row, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bundled-mace", choices=("bundled-mace", "bundled-nequip"))
    parser.add_argument("--molecules", type=int, default=1728)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--skins", default="0.5,1,1.5,2")
    parser.add_argument("--blocks", default="10", help="the engine's block sizes (steps between host syncs)")
    parser.add_argument("--pipelined", default="0,1", help="pipelined rebuilds off (0) and/or on (1)")
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the script")
    parser.add_argument("--compile", nargs="?", const="default", default=None, metavar="MODE",
                        help="also measure Calculator(compile=MODE) at every skin")
    args = parser.parse_args()
    atoms = make(args.model, args.molecules, args.device)
    rows = []
    for mode in [None] + ([args.compile] if args.compile else []):
        for skin in (float(s) for s in args.skins.split(",")):
            for block in (int(b) for b in args.blocks.split(",")):
                for pipelined in (bool(int(p)) for p in args.pipelined.split(",")):
                    rows.append(measure(args.model, atoms, skin, args.steps, mode, args.device, block, pipelined))
    path = write_json("engine-rebuild", {"environment": environment(), "args": vars(args), "rows": rows})
    print(f"\n{args.model}, {len(atoms)} atoms, NVT Langevin FP32, 0.5 fs; JSON: {path}")
    print("compile  skin block pipe  ms/step  rebuilds (overlapped)  blocks  discarded  rebuild ms  (search ms)  one-step replay ms  "
          "list pairs  capacity | host ms per step: " + " ".join(rows[0]["host_ms_per_step"]))
    for r in rows:
        print(f"{str(r['compile']):8s} {r['skin']:4.1f} {r['block']:5d} {int(r['pipelined']):4d} {r['ms_per_step']:8.3f} {r['rebuilds']:9d} {r['overlapped']:12d} {r['blocks']:7d} "
              f"{r['discarded']:10d} {r['rebuild_ms']:11.2f} {r['search_ms']:12.2f} {r['replay_ms']:19.3f} "
              f"{r['list_pairs']:11d} {str(r['capacity']):>9s} | "
              + " ".join(f"{v:.3f}" for v in r["host_ms_per_step"].values()))


if __name__ == "__main__":
    main()
