"""Where the MD engine's step goes (one GPU): ms per step over engine settings, then the kernels of one step.

    python benchmarks/profile_engine.py [--model bundled-mace|bundled-nequip] [--molecules 1728] [--steps 200]
                                        [--compile [MODE]]

Sweeps ``steps_per_graph`` and ``block`` (NVT Langevin, FP32, bundled model, 0.5 fs), then profiles the
fastest setting eagerly (kernels by name, count per step) so the integrator's small kernels show apart
from the model's. With ``--compile`` the same again with ``Calculator(compile=MODE)`` (torch.compile of the
model's forward and backward; MODE default or max-autotune-no-cudagraphs), so kernel counts and ms per step
show before and after; the first step of each (capture, and compilation) is timed apart. Prints a table; JSON
goes to benchmarks/results/ (or $OUT).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import environment, write_json  # noqa: E402

from cgforge.plugin.calculator import Calculator  # noqa: E402
from cgforge.plugin.md.engine import Engine  # noqa: E402
from cgforge.plugin.md.integrators import Langevin  # noqa: E402
from cgforge.plugin.water import water_box  # noqa: E402


def make(model: str, molecules: int, device: str = "cuda"):
    from ase.optimize import FIRE

    atoms = water_box(molecules)
    atoms.calc = Calculator(model.split("-")[1], device=device, dtype="float32")
    FIRE(atoms, logfile=None).run(steps=50)  # as bench_md's MD boxes: the grid box is far from equilibrium
    atoms.calc = None
    rng = np.random.default_rng(0)
    masses = atoms.get_masses()[:, None]
    atoms.set_momenta(rng.normal(size=(len(atoms), 3)) * np.sqrt(masses * 300 * 8.617e-5))
    return atoms


def first_step_s(calc, atoms) -> float:
    """Seconds of the engine's first step with this calculator: capture, and torch.compile when asked for."""
    engine = Engine(calc, atoms.copy(), Langevin(0.5, 300.0, 0.01), seed=1, max_temperature_K=float("inf"))
    torch.cuda.synchronize()
    t = time.perf_counter()
    engine.run(1)
    torch.cuda.synchronize()
    return time.perf_counter() - t


def ms_per_step(calc, atoms, steps: int, **engine_kw) -> float:
    a = atoms.copy()
    engine = Engine(calc, a, Langevin(0.5, 300.0, 0.01), seed=1, max_temperature_K=float("inf"), **engine_kw)
    engine.run(40)
    torch.cuda.synchronize()
    t = time.perf_counter()
    engine.run(steps)
    torch.cuda.synchronize()
    print(f"  steps_per_graph={engine.steps_per_graph} block={engine.block}: cuda_graph={engine.cuda_graph} "
          f"capture_error={engine.capture_error} stats={dict(engine.stats)}", flush=True)
    return 1000 * (time.perf_counter() - t) / steps


def kernel_table(calc, atoms, steps: int = 10, integrator=None) -> tuple[list[tuple[str, float, int]], int]:
    """(name, ms per step, calls per step) of every kernel of eager engine steps, slowest first, and kernels per
    step; ``integrator`` default NVT Langevin."""
    a = atoms.copy()
    integrator = integrator if integrator is not None else Langevin(0.5, 300.0, 0.01)
    engine = Engine(calc, a, integrator, seed=1, max_temperature_K=float("inf"), cuda_graph=False)
    engine.run(5)
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.run(steps)
        torch.cuda.synchronize()
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for e in prof.events():
        if e.device_type.name == "CUDA":
            total[e.name] += e.device_time_total / 1000 / steps
            count[e.name] += 1
    rows = sorted(((n, total[n], count[n] // steps) for n in total), key=lambda r: -r[1])
    return rows, sum(count.values()) // steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bundled-mace", choices=("bundled-mace", "bundled-nequip"))
    parser.add_argument("--molecules", type=int, default=1728)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--compile", nargs="?", const="default", default=None, metavar="MODE",
                        help="also measure Calculator(compile=MODE) (default mode when MODE is left out)")
    args = parser.parse_args()
    atoms = make(args.model, args.molecules)
    variants = [None] + ([args.compile] if args.compile else [])
    results = []
    for mode in variants:
        print(f"\n# compile={mode}", flush=True)
        t = time.perf_counter()
        calc = Calculator(args.model.split("-")[1], device="cuda", dtype="float32", compile=mode or False)
        setup = time.perf_counter() - t
        first = first_step_s(calc, atoms)
        sweep = []
        for spg, block in ((1, 10), (1, 50), (4, 20), (10, 50), (25, 50)):
            ms = ms_per_step(calc, atoms, args.steps, steps_per_graph=spg, block=block)
            sweep.append({"steps_per_graph": spg, "block": block, "ms_per_step": ms})
            print(sweep[-1], flush=True)
        kernels, per_step = kernel_table(calc, atoms)
        results.append({"compile": mode, "compile_error": calc.step.compile_error, "setup_s": setup,
                        "first_step_s": first, "sweep": sweep, "kernels_per_step": per_step,
                        "kernel_ms": sum(r[1] for r in kernels),
                        "kernels": [{"name": n, "ms": ms, "calls": c} for n, ms, c in kernels[:40]]})
        del calc
    path = write_json("engine-profile", {"environment": environment(), "args": vars(args), "results": results})
    print(f"\n{args.model}, {len(atoms)} atoms, NVT Langevin FP32; JSON: {path}")
    for res in results:
        print(f"\ncompile={res['compile']}: calculator {res['setup_s']:.1f} s, first engine step {res['first_step_s']:.1f} s"
              f" (capture{', torch.compile' if res['compile'] else ''})"
              + (f"; compile failed: {res['compile_error']}" if res["compile_error"] else ""))
        print(f"eager step: {res['kernels_per_step']} kernels, {res['kernel_ms']:.3f} ms of kernel time")
        for k in res["kernels"][:25]:
            print(f"  {k['ms']:8.3f} ms {k['calls']:4d}x  {k['name'][:110]}")
        print("steps_per_graph block  ms/step")
        for r in res["sweep"]:
            print(f"{r['steps_per_graph']:15d} {r['block']:5d} {r['ms_per_step']:8.3f}")


if __name__ == "__main__":
    main()
