"""Where the MD engine's step goes (one GPU): ms per step over engine settings, then the kernels of one step.

    python benchmarks/profile_engine.py [--model bundled-mace|bundled-nequip|mace-mp-medium|nequip-M] [--molecules 1728]
                                        [--steps 200] [--ensemble nvt|npt] [--no-sweep] [--compile [MODE]]

Sweeps ``steps_per_graph`` and ``block`` (NVT Langevin, or with ``--ensemble npt`` bench_md's NPT: stochastic cell
rescaling; FP32, 0.5 fs; ``--no-sweep``: the engine's defaults only),
then profiles the engine's default setting twice: eagerly (kernels by name, count per step, so the integrator's
small kernels show apart from the model's) and as the CUDA graphs it replays (the kernels' own times in the
captured step: what the step's wall time is made of, apart from the gaps between kernels). Kernels are grouped
by bench_md's categories. The box is bench_md's (relaxed by 50 FIRE steps of the bundled MACE). With
``--compile`` the same again with ``Calculator(compile=MODE)`` (torch.compile of the model's forward and
backward; MODE default or max-autotune-no-cudagraphs), so kernel counts and ms per step show before and after;
the first step of each (capture, and compilation) is timed apart. Prints a table; JSON goes to
benchmarks/results/ (or $OUT).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
import bench_md  # noqa: E402
from common import environment, write_json  # noqa: E402

from cgforge.plugin.calculator import Calculator  # noqa: E402
from cgforge.plugin.md.engine import Engine  # noqa: E402
from cgforge.plugin.water import water_box  # noqa: E402

MODELS = ("bundled-mace", "bundled-nequip", "mace-mp-medium", "nequip-M")


def make(molecules: int):
    """bench_md's MD box: ``molecules`` waters relaxed by the bundled MACE, momenta at 300 K."""
    return bench_md.md_atoms(water_box(molecules), "float32")


def calculator(model: str, folder: str, compile_mode: str | None) -> Calculator:
    """The FP32 Calculator of one of ``MODELS`` (NequIP's presets are built in FP32), at bench_md's skin
    (``cgforge md``'s)."""
    return Calculator(bench_md.fp32_source(model, Path(folder)), device="cuda", skin=bench_md.SKIN,
                      dtype=None if model == "nequip-M" else "float32", compile=compile_mode or False)


def first_step_s(calc, atoms, ensemble: str) -> float:
    """Seconds of the engine's first step with this calculator: capture, and torch.compile when asked for."""
    engine = Engine(calc, atoms.copy(), bench_md.md_integrator(ensemble), seed=1, max_temperature_K=float("inf"))
    torch.cuda.synchronize()
    t = time.perf_counter()
    engine.run(1)
    torch.cuda.synchronize()
    return time.perf_counter() - t


def ms_per_step(calc, atoms, steps: int, ensemble: str, **engine_kw) -> float:
    a = atoms.copy()
    engine = Engine(calc, a, bench_md.md_integrator(ensemble), seed=1, max_temperature_K=float("inf"), **engine_kw)
    engine.run(40)
    torch.cuda.synchronize()
    t = time.perf_counter()
    engine.run(steps)
    torch.cuda.synchronize()
    print(f"  steps_per_graph={engine.steps_per_graph} block={engine.block}: cuda_graph={engine.cuda_graph} "
          f"capture_error={engine.capture_error} stats={dict(engine.stats)}", flush=True)
    return 1000 * (time.perf_counter() - t) / steps


def kernel_table(calc, atoms, ensemble: str, steps: int = 10, cuda_graph: bool = False
                 ) -> tuple[list[tuple[str, float, int]], int]:
    """(name, ms per step, calls per step) of every kernel of engine steps of ``ensemble``, slowest first, and
    kernels per step; eager steps, or with ``cuda_graph`` the captured graphs' replays."""
    a = atoms.copy()
    engine = Engine(calc, a, bench_md.md_integrator(ensemble), seed=1, max_temperature_K=float("inf"),
                    cuda_graph=cuda_graph)
    engine.run(20 if cuda_graph else 5)  # captured graphs before the profile
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
    parser.add_argument("--model", default="bundled-mace", choices=MODELS)
    parser.add_argument("--molecules", type=int, default=1728)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--ensemble", default="nvt", choices=("nvt", "npt"))
    parser.add_argument("--no-sweep", action="store_true", help="the engine's default setting only")
    parser.add_argument("--compile", nargs="?", const="default", default=None, metavar="MODE",
                        help="also measure Calculator(compile=MODE) (default mode when MODE is left out)")
    args = parser.parse_args()
    atoms = make(args.molecules)
    folder = tempfile.mkdtemp()
    variants = [None] + ([args.compile] if args.compile else [])
    results = []
    for mode in variants:
        print(f"\n# compile={mode}", flush=True)
        t = time.perf_counter()
        calc = calculator(args.model, folder, mode)
        setup = time.perf_counter() - t
        first = first_step_s(calc, atoms, args.ensemble)
        sweep = []
        settings = [{}] if args.no_sweep else [{"steps_per_graph": spg, "block": block} for spg, block in
                                               ((1, 10), (1, 50), (4, 20), (10, 50), (25, 50))]
        for setting in settings:
            ms = ms_per_step(calc, atoms, args.steps, args.ensemble, **setting)
            sweep.append(setting | {"ms_per_step": ms})
            print(sweep[-1], flush=True)
        result = {"compile": mode, "compile_error": calc.step.compile_error, "setup_s": setup,
                  "first_step_s": first, "sweep": sweep}
        for label, graph in (("eager", False), ("captured", True)):
            kernels, per_step = kernel_table(calc, atoms, args.ensemble, cuda_graph=graph)
            categories: dict[str, float] = defaultdict(float)
            for name, ms, _ in kernels:
                categories[bench_md.kernel_category(name)] += ms
            result[label] = {"kernels_per_step": per_step, "kernel_ms": sum(r[1] for r in kernels),
                             "categories": dict(categories),
                             "kernels": [{"name": n, "ms": ms, "calls": c} for n, ms, c in kernels]}
        results.append(result)
        del calc
    path = write_json("engine-profile", {"environment": environment(), "args": vars(args), "results": results})
    what = "NVT Langevin" if args.ensemble == "nvt" else "NPT stochastic cell rescaling"
    print(f"\n{args.model}, {len(atoms)} atoms, {what} FP32; JSON: {path}")
    for res in results:
        print(f"\ncompile={res['compile']}: calculator {res['setup_s']:.1f} s, first engine step {res['first_step_s']:.1f} s"
              f" (capture{', torch.compile' if res['compile'] else ''})"
              + (f"; compile failed: {res['compile_error']}" if res["compile_error"] else ""))
        for label in ("eager", "captured"):
            part = res[label]
            print(f"{label} step: {part['kernels_per_step']} kernels, {part['kernel_ms']:.3f} ms of kernel time; "
                  + ", ".join(f"{c} {ms:.3f}" for c, ms in sorted(part["categories"].items(), key=lambda kv: -kv[1])))
            for k in part["kernels"][:25]:
                print(f"  {k['ms']:8.3f} ms {k['calls']:4d}x  {k['name'][:110]}")
        default = next((r["ms_per_step"] for r in res["sweep"] if "steps_per_graph" not in r), None)
        if default is not None:  # what the captured step spends between its kernels (launch gaps, tails)
            gaps = default - res["captured"]["kernel_ms"]
            print(f"captured step {default:.3f} ms = {res['captured']['kernel_ms']:.3f} ms of kernels + {gaps:.3f} ms "
                  f"between them ({1000 * gaps / max(res['captured']['kernels_per_step'], 1):.2f} us a kernel)")
        print("steps_per_graph block  ms/step")
        for r in res["sweep"]:
            print(f"{str(r.get('steps_per_graph', 'default')):>15s} {str(r.get('block', 'default')):>7s} "
                  f"{r['ms_per_step']:8.3f}")


if __name__ == "__main__":
    main()
