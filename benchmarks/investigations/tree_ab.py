"""Two source trees of cgforge side by side on one GPU: the force call and the MD engine step, "no slower" checks of
a refactor (issue 61's constraint: the step and force call of the tree before and after).

    git archive 0a4da58 cgforge | tar -x -C /tmp/before         # the old package, anywhere outside the project
    python3 benchmarks/investigations/tree_ab.py --tree before=/tmp/before --tree after=. [--rounds 2]

Each round runs every tree in a process of its own (``--child``, its working directory the tree, the tree first on
PYTHONPATH: nothing of another tree is imported; the child checks ``cgforge.__file__``), rounds interleaved so that
drift of the machine falls on all alike. The structure is written once by the parent (5,184-atom water,
``bench_md.md_atoms``: relaxed by 50 FIRE steps of the bundled model, 300 K momenta) and read by every child. Per
model (the bundled MACE and the MACE-MP-medium shape, FP32, skin 1 Å): the median of ``--calls`` energy+forces
calls of the ASE Calculator (positions moved by 1e-4 Å between calls) and ms per step of the device engine
(NVT Langevin, 0.5 fs, 300 K; 20 warm-up steps, then ``--steps``), through the API both trees have (``Calculator``,
``Engine``, ``Langevin``). Prints a table and writes JSON to $OUT or benchmarks/results/. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent  # benchmarks/
MODELS = ("bundled-mace", "mace-mp-medium")


def child(tree: Path, structure: Path, models: dict, calls: int, steps: int, device: str) -> dict:
    """In the tree's own process: {model: {"force_call_ms", "step_ms"}}."""
    import numpy as np
    import torch
    from ase.io import read

    import cgforge
    from cgforge.plugin import Calculator, Engine
    from cgforge.plugin.md.integrators import Langevin

    if not Path(cgforge.__file__).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"imported {cgforge.__file__}, not the tree {tree}")
    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    out = {}
    for name, source in models.items():
        calc = Calculator(source, device=device, dtype="float32", skin=1.0)
        atoms = read(structure)
        positions = atoms.get_positions()
        times = []
        for k in range(calls + 5):
            atoms.set_positions(positions + 1e-4 * (k % 2))
            sync()
            start = time.perf_counter()
            calc.calculate(atoms, ["energy", "forces"], [])
            sync()
            times.append(time.perf_counter() - start)
        md = read(structure)
        engine = Engine(calc, md, Langevin(0.5, 300.0, 0.01), seed=0)
        engine.run(20)
        sync()
        start = time.perf_counter()
        engine.run(steps)
        sync()
        step_ms = 1e3 * (time.perf_counter() - start) / steps
        out[name] = {"force_call_ms": 1e3 * float(np.median(times[5:])), "step_ms": step_ms,
                     "energy_eV": float(calc.results["energy"])}
        del engine, calc
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", default=[], help="NAME=PATH, a folder holding cgforge/")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--molecules", type=int, default=1728, help="water molecules of the box")
    parser.add_argument("--device", default="cuda", help="cpu: a check of the script itself")
    parser.add_argument("--child", nargs=2, metavar=("TREE", "JOB"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        job = json.loads(Path(args.child[1]).read_text())
        print(json.dumps(child(Path(args.child[0]), Path(job["structure"]), job["models"], args.calls, args.steps,
                               args.device)))
        return
    if len(args.tree) < 2 or any("=" not in t for t in args.tree):
        parser.error(f"--tree: expected two or more NAME=PATH, got {args.tree}")
    trees = dict(t.split("=", 1) for t in args.tree)
    for name, path in trees.items():
        if not (Path(path) / "cgforge" / "__init__.py").is_file():
            parser.error(f"--tree {name}={path}: no cgforge/__init__.py there")
    sys.path.insert(0, str(BENCH))
    import bench_md
    from ase.io import write
    from common import environment, write_json
    from shapes import mace_mp_file

    from cgforge.plugin.runtime.bundled import model_path
    from cgforge.plugin.water import water_box

    folder = Path(tempfile.mkdtemp())
    structure = folder / "water.extxyz"
    bench_md.DEVICE = args.device
    write(structure, bench_md.md_atoms(water_box(args.molecules, seed=0), "float32"))
    models = {"bundled-mace": str(model_path("mace")), "mace-mp-medium": str(mace_mp_file(folder, "float32"))}
    job = folder / "job.json"
    job.write_text(json.dumps({"structure": str(structure), "models": models}))
    runs: dict[str, list] = {name: [] for name in trees}
    for round_ in range(args.rounds):
        for name, path in trees.items():
            root = Path(path).resolve()
            rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                    if p and Path(p).resolve() != Path.cwd().resolve()]
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), *rest])}
            done = subprocess.run([sys.executable, __file__, "--calls", str(args.calls), "--steps", str(args.steps),
                                   "--device", args.device, "--child", str(root), str(job)], cwd=root, env=env, capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"tree {name}, round {round_}: exit {done.returncode}\n{done.stderr[-3000:]}")
            runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"round {round_} {name}: {runs[name][-1]}", flush=True)
    first = next(iter(trees))
    table = {}
    print(f"{'model':16s} {'tree':10s} {'force call ms':>14s} {'step ms':>9s} {'vs ' + first:>12s}")
    for model in MODELS:
        for name in trees:
            call = statistics.median(r[model]["force_call_ms"] for r in runs[name])
            step = statistics.median(r[model]["step_ms"] for r in runs[name])
            table[model, name] = (call, step)
            ref = table[model, first]
            print(f"{model:16s} {name:10s} {call:14.3f} {step:9.3f} {call / ref[0]:5.2f}x/{step / ref[1]:4.2f}x")
    path = write_json("tree_ab", {"trees": trees, "args": vars(args), "environment": environment(), "runs": runs,
                                  "medians": {f"{m}/{t}": v for (m, t), v in table.items()}})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
