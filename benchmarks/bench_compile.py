"""How long torch.compile takes for a water model's step, in a first process and in a second one that finds the
first's caches on disk (issue 38: "compilation of a water model <= 10 s on a second run of the same model").

    python benchmarks/bench_compile.py [--models bundled-mace,mace-mp-medium,bundled-nequip] [--molecules 1728]
        [--processes 2] [--device auto] [--dtype float32] [--cache DIR]

Each model runs ``--processes`` processes one after another, all with one cache folder (``--cache``, default a new
temporary one, so the first process starts cold): ``TORCHINDUCTOR_CACHE_DIR`` (Inductor's FX graph and AOTAutograd
caches, and Triton's kernels under it) and ``CGFORGE_CACHE_DIR`` (cgforge's NVRTC kernels). In each: a compiled
Calculator (``compile=True``) on a water box, timed: construction (load, patch, kernels, warm-up), the first force
call (the CUDA-graph capture and torch.compile: Dynamo's trace, AOTAutograd, Inductor's code generation or a cache
hit), and a later call; with the caches' hit, miss and bypass counts (torch's counters) and why a bypass happened.
Runs on a CPU too (Inductor's C++ backend), where it shows whether the caches hit, not the GPU's times. The table
last; JSON under $OUT when set, else benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

MODELS = ("bundled-mace", "bundled-nequip", "mace-mp-medium")


def worker(args: argparse.Namespace) -> None:
    """One process: a compiled Calculator on the box, timed; one RESULT line."""
    import torch
    from torch._dynamo.utils import counters

    from cgforge.plugin import Calculator
    from cgforge.plugin.water import water_box

    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    device = "cpu" if device == "auto" else device
    model = _model_file(args.model, args.dtype, Path(args.cache))
    atoms = water_box(args.molecules, seed=0)
    start = time.perf_counter()
    calc = Calculator(model, device=device, dtype=args.dtype, compile=True)
    built = time.perf_counter() - start
    atoms.calc = calc
    start = time.perf_counter()
    atoms.get_forces()
    _sync(device)
    first = time.perf_counter() - start
    atoms.positions += 0.01  # a new call, the same graph
    start = time.perf_counter()
    atoms.get_forces()
    _sync(device)
    later = time.perf_counter() - start
    caches = {group: {k: v for k, v in counters[group].items() if "cache" in k or "bypass" in k}
              for group in ("inductor", "aot_autograd")}
    print("RESULT " + json.dumps({"model": args.model, "device": device, "atoms": len(atoms), "setup_s": built,
                                  "first_call_s": first, "later_call_s": later, "caches": caches,
                                  "compile_error": calc.step.compile_error}), flush=True)


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _model_file(name: str, dtype: str, folder: Path) -> str:
    """A checkpoint for NAME: the bundled models by name, the MACE-MP-medium shape written into ``folder`` once."""
    if name in ("bundled-mace", "bundled-nequip"):
        return name.removeprefix("bundled-")
    if name == "mace-mp-medium":
        from shapes import mace_mp_file

        return str(mace_mp_file(folder, dtype))
    raise SystemExit(f"--models: {name!r} is not one of {', '.join(MODELS)}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="bundled-mace,mace-mp-medium,bundled-nequip")
    parser.add_argument("--molecules", type=int, default=1728, help="water molecules (1728: 5,184 atoms)")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    parser.add_argument("--cache", default=None, help="the cache folder the processes share (default: a new one)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per process")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return
    if args.processes < 1 or args.molecules < 1:
        parser.error("--processes and --molecules: expected positive numbers")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"--models: {', '.join(unknown)} not among {', '.join(MODELS)}")
    from common import environment, write_json

    rows = []
    payload = {"environment": environment(), "args": vars(args), "rows": rows}
    path = None
    for name in models:
        cache = Path(args.cache) if args.cache else Path(tempfile.mkdtemp(prefix=f"cgforge-compile-{name}-"))
        cache.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"),
                   CGFORGE_CACHE_DIR=str(cache / "kernels"))
        for process in range(1, args.processes + 1):
            cmd = [sys.executable, __file__, "--worker", "--model", name, "--molecules", str(args.molecules),
                   "--device", args.device, "--dtype", args.dtype, "--cache", str(cache)]
            start = time.perf_counter()
            try:
                run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
                found = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
                row = json.loads(found[-1][7:]) if found else {"model": name, "error": (run.stderr or run.stdout)
                                                                   .strip().splitlines()[-1:]}
            except subprocess.TimeoutExpired:
                row = {"model": name, "error": f"timed out after {args.timeout:g} s"}
            row.update(process=process, wall_s=time.perf_counter() - start, cache=str(cache))
            rows.append(row)
            print(_line(row), flush=True)
            path = write_json("compile", payload, path)
    path = write_json("compile", payload, path)
    print(f"\n{'model':<16}{'process':>8}{'setup s':>9}{'first call s':>14}{'later s':>9}  caches (hit/miss/bypass)")
    for row in rows:
        print(_line(row))
    print(f"wrote {path}")


def _line(row: dict) -> str:
    if "error" in row:
        return f"{row['model']:<16}{row.get('process', '-'):>8}  failed: {row['error']}"
    fx = row["caches"]["inductor"]
    aot = row["caches"]["aot_autograd"]
    caches = (f"fx {fx.get('fxgraph_cache_hit', 0)}/{fx.get('fxgraph_cache_miss', 0)}/"
              f"{fx.get('fxgraph_cache_bypass', 0)}, aot {aot.get('autograd_cache_hit', 0)}/"
              f"{aot.get('autograd_cache_miss', 0)}/{aot.get('autograd_cache_bypass', 0)}")
    error = f"  compile failed: {row['compile_error'][:60]}" if row.get("compile_error") else ""
    return (f"{row['model']:<16}{row['process']:>8}{row['setup_s']:>9.1f}{row['first_call_s']:>14.1f}"
            f"{row['later_call_s']:>9.3f}  {caches}{error}")


if __name__ == "__main__":
    main()
