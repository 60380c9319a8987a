"""What a neighbour-list rebuild costs the MD engine's step, and whether the pipelined search hides it (issue 38).

    python3 benchmarks/investigations/rebuild_cost.py [--models bundled-mace,mace-mp-medium] [--rounds 3]
        [--steps 240] [--warmup 40] [--molecules 1728] [--hide 2,4] [--device cpu]

Why: on an H200 (2026-11-29, results/issue38-table-h200-20261129, call 7) the bundled MACE's step grew from 1.73 to
2.72 ms when ``rebuild_margin`` 2.5 doubled its rebuilds (37 -> 72 in 240 steps) and to 2.85 ms with a 0.7 A skin
(73 rebuilds), while its captured step's kernels take 1.33 ms: the rebuilds, pipelined or not, look like most of the
~0.5 ms above the kernels. MACE-MP-medium's step (7.7 ms) barely moved. This script says where that time goes.

Per model (FP32, skin 1 A, bench_md's relaxed box, NVT Langevin 0.5 fs) these variants run interleaved round by
round, each a fresh Engine timed over ``--steps`` after ``--warmup``:

- ``hide=K``: the pipelined rebuild with the list's last K steps as the block during which the next list is
  searched on a side stream (``engine._HIDE_STEPS``; 2 landed);
- ``hide=K+priority``: the same with the search's side stream at high priority, so that its small kernels do not
  wait behind the block's;
- ``serial``: ``pipelined_rebuild=False`` (the search between blocks, the GPU idle meanwhile).

Host timers (wall clock, no sync added) around the engine's parts: ``search`` (the host's waits for the side
stream), the report read after a block (the host's wait for the block's steps), ``install``, a serial
``rebuild``. Printed per variant: ms per step (median over rounds), rebuilds and blocks (last round), and per
pipelined rebuild the search's host ms against the wait for its block after it (a search that outlasts its
block's steps leaves the GPU idle for the difference), and the search alone with nothing else on the device
(``idle search``). ``--device cpu`` smoke-tests the script (a small box, one round): its times say nothing about a
GPU. JSON goes to benchmarks/results/ (or $OUT).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
import bench_md  # noqa: E402
from common import environment, write_json  # noqa: E402

import cgforge.plugin.md.engine as engine_module  # noqa: E402
from cgforge.plugin.calculator import Calculator  # noqa: E402
from cgforge.plugin.md.engine import Engine  # noqa: E402
from cgforge.plugin.md.integrators import Langevin  # noqa: E402
from cgforge.plugin.water import water_box  # noqa: E402

MODELS = ("bundled-mace", "bundled-nequip", "mace-mp-medium", "nequip-M")


@contextlib.contextmanager
def hide_steps(k: int) -> Iterator[None]:
    """``engine._HIDE_STEPS`` set to ``k`` inside the block (the engine reads it when it plans a block)."""
    before = engine_module._HIDE_STEPS
    engine_module._HIDE_STEPS = k
    try:
        yield
    finally:
        engine_module._HIDE_STEPS = before


class Timers:
    """Host wall time of an engine's parts, by wrapping its provider's and its own bound methods."""

    def __init__(self, engine: Engine) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.count: dict[str, int] = defaultdict(int)
        self.pairs: list[tuple[float, float]] = []  # (search host s, wait for its block after it) per search
        self._search_s: float | None = None
        provider = engine.provider
        for name in ("search", "install", "rebuild"):
            if callable(getattr(provider, name, None)):
                setattr(provider, name, self._wrap(name, getattr(provider, name)))
        engine._read_report = self._wrap("report", engine._read_report)

    def _wrap(self, name: str, method: Callable) -> Callable:
        def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - a pass-through
            t = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t
                self.total[name] += dt
                self.count[name] += 1
                if name == "search":
                    self._search_s = dt
                elif name == "report" and self._search_s is not None:
                    self.pairs.append((self._search_s, dt))
                    self._search_s = None

        return timed

    def reset(self) -> None:
        self.total.clear()
        self.count.clear()
        self.pairs.clear()
        self._search_s = None


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_variant(calc: Calculator, atoms, variant: dict, warmup: int, steps: int, device: str) -> dict:
    """One fresh engine under ``variant`` (hide, priority, pipelined): ms per step and the timers of the timed part."""
    with hide_steps(variant["hide"]):
        engine = Engine(calc, atoms.copy(), Langevin(0.5, 300.0, 0.01), seed=1, max_temperature_K=float("inf"),
                        pipelined_rebuild=variant["pipelined"])
        if variant["priority"]:
            # the provider makes its side stream on its first search; one made first is kept
            engine.provider._side = torch.cuda.Stream(torch.device(device), priority=-1)
        timers = Timers(engine)
        engine.run(warmup)
        sync(device)
        timers.reset()
        before = dict(engine.stats)
        t = time.perf_counter()
        engine.run(steps)
        sync(device)
        wall = time.perf_counter() - t
        idle = idle_search_ms(engine, device) if variant["pipelined"] else None
    stats = {k: engine.stats[k] - before[k] for k in ("steps", "blocks", "discarded", "rebuilds",
                                                        "overlapped_rebuilds")}
    searches = np.array(timers.pairs) if timers.pairs else np.zeros((0, 2))
    return {"ms_per_step": 1000 * wall / steps, "stats": stats,
            "host_ms": {k: 1000 * v for k, v in timers.total.items()}, "calls": dict(timers.count),
            "idle_search_ms": idle,
            "search_ms_median": float(np.median(searches[:, 0]) * 1000) if len(searches) else None,
            "wait_after_search_ms_median": float(np.median(searches[:, 1]) * 1000) if len(searches) else None}


def idle_search_ms(engine: Engine, device: str, repeats: int = 5) -> float:
    """Median ms of the provider's search at the engine's current state with nothing else on the device (the
    search's own cost, host waits included, against its cost beside a block); the list found is not installed."""
    times = []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        pending = engine.provider.snapshot(engine.state.positions, engine.state.cell)
        engine.provider.search(pending)
        sync(device)
        times.append(time.perf_counter() - t)
    return 1000 * float(np.median(times))


def variants(hides: list[int], device: str) -> dict[str, dict]:
    out = {}
    for k in hides:
        out[f"hide={k}"] = {"hide": k, "priority": False, "pipelined": True}
        if device == "cuda":
            out[f"hide={k}+priority"] = {"hide": k, "priority": True, "pipelined": True}
    out["serial"] = {"hide": engine_module._HIDE_STEPS, "priority": False, "pipelined": False}
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="bundled-mace,mace-mp-medium")
    parser.add_argument("--molecules", type=int, default=1728)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=240)
    parser.add_argument("--warmup", type=int, default=40)
    parser.add_argument("--hide", default="2,4", help="values of engine._HIDE_STEPS to run (comma-separated)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu only to smoke-test this script")
    args = parser.parse_args(argv)
    models = args.models.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {', '.join(MODELS)}")
    try:
        hides = [int(k) for k in args.hide.split(",")]
    except ValueError:
        parser.error(f"--hide wants comma-separated integers, got {args.hide!r}")
    if min(hides) < 1 or min(args.rounds, args.steps, args.molecules) < 1 or args.warmup < 0:
        parser.error("--hide values, --rounds, --steps and --molecules must be >= 1, --warmup >= 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA GPU here: --device cpu smoke-tests the script")
    bench_md.DEVICE = args.device  # md_atoms relaxes the box on this device
    atoms = bench_md.md_atoms(water_box(args.molecules), "float32")
    table = variants(hides, args.device)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            calc = Calculator(bench_md.fp32_source(model, Path(tmp)), device=args.device,
                              dtype=None if model.startswith("nequip-") else "float32", skin=1.0)
            runs: dict[str, list[dict]] = {name: [] for name in table}
            for r in range(args.rounds):
                for name, variant in table.items():
                    runs[name].append(run_variant(calc, atoms, variant, args.warmup, args.steps, args.device))
                print(f"{model} round {r + 1}: " + ", ".join(f"{n} {v[-1]['ms_per_step']:.3f}"
                                                              for n, v in runs.items()), flush=True)
            for name, variant in table.items():
                results.append({"model": model, "atoms": len(atoms), "variant": name, **variant,
                                "median_ms": float(np.median([x["ms_per_step"] for x in runs[name]])),
                                "rounds": runs[name]})
            del calc
    path = write_json("rebuild-cost", {"environment": environment(), "args": vars(args), "results": results})
    print(f"\n{len(atoms)} atoms, NVT Langevin FP32, skin 1 A, on {args.device}; JSON: {path}")
    print("per pipelined rebuild: the search's host ms, then the host's wait for its block (medians, last round)")
    print(f"{'model':15s} {'variant':18s} {'ms/step':>8s} {'rebuilds':>8s} {'blocks':>6s} {'search':>7s} "
          f"{'wait':>6s} {'idle search':>11s}")
    for row in results:
        last = row["rounds"][-1]

        def cell(v: float | None) -> str:
            return f"{v:7.2f}" if v is not None else "      -"

        print(f"{row['model']:15s} {row['variant']:18s} {row['median_ms']:8.3f} {last['stats']['rebuilds']:8d} "
              f"{last['stats']['blocks']:6d} {cell(last['search_ms_median'])} "
              f"{cell(last['wait_after_search_ms_median'])[1:]} {cell(last['idle_search_ms']):>11s}")


if __name__ == "__main__":
    main()
