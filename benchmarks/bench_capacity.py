"""Capacity ladder: one energy + forces call on water boxes of growing size, through an ASE calculator.

    python benchmarks/bench_capacity.py --model mace-mp-medium --atoms 5184 1029000 2000000 5000000 10000000
    python benchmarks/bench_capacity.py --model mace-mp-medium --atoms 5184 1029000 --workspace whole
    python benchmarks/bench_capacity.py --peer symmetrix --profile capacity --atoms 3000000   # MACE models only

Each size runs in a process of its own (a size that runs out of memory, or a peer that cannot survive that,
leaves the others standing). Per size: the atoms, what ran (cgforge's workspace and tile grid, or the peer's
profile), seconds of the second call (the first builds and plans), µs per atom, the device's peak memory during
that call (torch's allocator for cgforge; the driver's used memory for a peer, which allocates outside torch),
bytes per atom. FP32, water at 1 g/cm^3 (``cgforge.plugin.water.water_box``), the model shapes of
``benchmarks/shapes.py`` with random weights. Prints a table; writes ``capacity-*.json``.

Symmetrix-XL reads the MACE model as JSON made by ``symmetrix_extract_mace`` (run here on the model file this
script saves); see ../shared/device/README.md for installing it on the GPU machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, write_json  # noqa: E402

MODELS = ("mace-mp-medium", "nequip-M")


def build_model(name: str) -> torch.nn.Module:
    import shapes

    if name == "mace-mp-medium":
        return shapes.mace_mp_shape(torch.float32, "medium")
    if name == "nequip-M":
        return shapes.nequip_shape("M")
    raise ValueError(f"--model: expected one of {MODELS}, got {name!r}")


def water(n_atoms: int):
    from cgforge.plugin.water import water_box

    return water_box(n_molecules=max(1, n_atoms // 3), seed=0)


def device_used_bytes() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def run_cgforge(model_name: str, n_atoms: int, workspace: str) -> dict:
    from cgforge.plugin.calculator import Calculator

    atoms = water(n_atoms)
    calc = Calculator(build_model(model_name), "cuda", workspace=workspace)
    atoms.calc = calc
    start = time.perf_counter()
    atoms.get_forces()
    first = time.perf_counter() - start
    atoms.positions[0, 0] += 1e-4  # a new structure: the calculator computes again
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    forces = atoms.get_forces()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated()
    pot = calc.potential
    tiled = pot.workspace.tiled_last
    row = {"backend": "cgforge", "model": model_name, "atoms": len(atoms), "workspace": workspace,
           "ran": "tiles" if tiled else "whole graph", "first_s": first, "seconds": seconds,
           "us_per_atom": 1e6 * seconds / len(atoms), "peak_bytes": peak, "bytes_per_atom": peak / len(atoms),
           "reserved_peak_bytes": torch.cuda.max_memory_reserved(), "edges": pot.n_edges,
           "finite": bool(torch.isfinite(torch.as_tensor(forces)).all())}
    if tiled:
        evaluation = pot.workspace.evaluation
        row.update(grid=list(pot.workspace.grid.counts), tiles=pot.workspace.grid.n_tiles,
                   largest_cluster=evaluation.largest_cluster, tile_budget_bytes=pot.workspace.budget_bytes)
    return row


def run_symmetrix(model_json: str, n_atoms: int, profile: str) -> dict:
    from symmetrix import Symmetrix

    atoms = water(n_atoms)
    kwargs = {"execution_profile": "capacity", "allow_fixed_workspace": True} if profile == "capacity" else {}
    calc = Symmetrix(model_json, dtype="float32", **kwargs)
    start = time.perf_counter()
    calc.calculate(atoms, ["energy", "forces"], [])
    first = time.perf_counter() - start
    atoms.positions[0, 0] += 1e-4
    start = time.perf_counter()
    calc.calculate(atoms, ["energy", "forces"], [])
    seconds = time.perf_counter() - start
    used = device_used_bytes()
    return {"backend": "symmetrix-xl", "model": "mace-mp-medium", "atoms": len(atoms), "profile": profile,
            "ran": profile, "first_s": first, "seconds": seconds, "us_per_atom": 1e6 * seconds / len(atoms),
            "peak_bytes": used, "bytes_per_atom": used / len(atoms),
            "note": "device memory in use after the call (driver), not a peak"}


def one(args: argparse.Namespace, n_atoms: int) -> dict:
    """One size in a child process; its row, or what went wrong."""
    cmd = [sys.executable, __file__, "--child", str(n_atoms), "--model", args.model, "--workspace", args.workspace,
           "--peer", args.peer or "", "--profile", args.profile, "--model-json", args.model_json or ""]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("ROW "):
            return json.loads(line[4:])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"backend": args.peer or "cgforge", "model": args.model, "atoms": n_atoms, "error": " | ".join(tail),
            "returncode": proc.returncode}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=MODELS, default="mace-mp-medium")
    parser.add_argument("--atoms", type=int, nargs="+", default=[5184, 1_029_000, 2_000_000, 5_000_000, 10_000_000])
    parser.add_argument("--workspace", choices=("auto", "whole", "tiled"), default="auto")
    parser.add_argument("--peer", choices=("", "symmetrix"), default="")
    parser.add_argument("--profile", choices=("default", "capacity"), default="default")
    parser.add_argument("--model-json", default=None, help="Symmetrix's model file (made when not given)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per size")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        row = (run_symmetrix(args.model_json, args.child, args.profile) if args.peer
               else run_cgforge(args.model, args.child, args.workspace))
        print("ROW " + json.dumps(row), flush=True)
        return 0
    if args.peer and not args.model_json:
        if args.model != "mace-mp-medium":
            raise SystemExit("--peer symmetrix: MACE models only")
        out = Path(os.environ.get("OUT", "/tmp"))
        model_file = out / "mace-mp-medium-shape.model"
        torch.save(build_model(args.model), model_file)
        args.model_json = str(out / "mace-mp-medium-shape.json")
        subprocess.run(["symmetrix_extract_mace", "--model", str(model_file), "--output", args.model_json], check=True)
    rows = []
    for n in args.atoms:
        row = one(args, n)
        rows.append(row)
        print(json.dumps(row), flush=True)
    path = write_json("capacity", {"environment": environment(), "args": vars(args), "rows": rows})
    print(f"\n{'backend':<13} {'model':<15} {'atoms':>10} {'ran':<12} {'s/call':>8} {'us/atom':>8} {'peak GB':>8} "
          f"{'B/atom':>7}  tiles")
    for r in rows:
        if "error" in r:
            print(f"{r['backend']:<13} {r['model']:<15} {r['atoms']:>10} failed: {r['error'][:90]}")
            continue
        print(f"{r['backend']:<13} {r['model']:<15} {r['atoms']:>10} {r['ran']:<12} {r['seconds']:8.3f} "
              f"{r['us_per_atom']:8.3f} {r['peak_bytes'] / 1e9:8.2f} {r['bytes_per_atom']:7.0f}  {r.get('grid', '')}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
