"""Where the memory of a streaming MACE step goes: at rest, energy only, energy + forces (one GPU, FP32).

    python benchmarks/streaming_memory.py --systems 20k,100k [--streaming on|off] [--first-call forces] [--cuda-graph]

Prints GB and bytes per atom / per edge for: the calculator's buffers at rest after a step (neighbour list,
edge layout, model), the peak of an energy-only call (forward, the first call: it builds the neighbour list)
and of an energy + forces call, and what is alive at the forces call's peak, by the code that allocated it
(torch's allocation history, replayed). JSON goes to benchmarks/results/ (or $OUT).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_md import WATER  # noqa: E402
from common import environment, write_json  # noqa: E402
from shapes import mace_mp_shape  # noqa: E402

from cgforge.plugin.calculator import Calculator  # noqa: E402
from cgforge.plugin.water import water_box  # noqa: E402

GB = 1e9


def _label(frames: list[dict]) -> str:
    """Where an allocation was made: the innermost Python frame outside torch's own files, after the innermost
    torch frame when there is one (``autograd/__init__.py:grad`` marks the autograd engine's backward)."""
    py = [f for f in frames if f.get("filename", "").endswith(".py")]
    inner_torch = next((f for f in py if "/torch/" in f["filename"]), None)
    ours = next((f for f in py if "/torch/" not in f["filename"]), None)
    site = "" if ours is None else f"{'/'.join(ours['filename'].split('/')[-2:])}:{ours.get('line')} {ours.get('name')}"
    if inner_torch is not None and (ours is None or py.index(inner_torch) < py.index(ours)):
        site = f"[torch {'/'.join(inner_torch['filename'].split('/')[-2:])}:{inner_torch.get('name')}] " + site
    return site or "no Python frame"


def peak_allocations(trace: list[dict], top: int = 16) -> tuple[float, list[tuple[str, float]]]:
    """Replay one device's allocation trace: the peak (GB above what was allocated when recording began) and
    the allocations alive at that moment, summed by the code that made them (GB, largest first)."""
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    peak_event = ""
    for event in trace:
        action, addr, size = event.get("action"), event.get("addr"), int(event.get("size", 0))
        if action == "alloc":
            live[addr] = (size, _label(event.get("frames", [])))
            total += size
            if total > peak:
                peak, at_peak = total, dict(live)
                backward = any(f.get("name") in ("grad", "backward") and "/torch/" in f.get("filename", "")
                               for f in event.get("frames", []))
                peak_event = f"{'backward' if backward else 'forward'}: {size / GB:.3f} GB at {live[addr][1]}"
        elif action == "free_completed" and addr in live:
            total -= live.pop(addr)[0]
    by_site: dict[str, float] = {}
    for size, site in at_peak.values():
        by_site[site] = by_site.get(site, 0.0) + size / GB
    first = (f"(the allocation that set the peak, in the {peak_event})", 0.0)
    return peak / GB, [first] + sorted(by_site.items(), key=lambda kv: -kv[1])[:top]


def probe(atoms, model: torch.nn.Module, streaming: bool, skin: float, phases: tuple[str, ...] = ("energy", "forces"),
          cuda_graph: bool = False) -> dict:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    calc = Calculator(model, device="cuda", streaming=streaming, cuda_graph=cuda_graph, forces_with_energy=False,
                      skin=skin)
    a = atoms.copy()
    a.calc = calc
    torch.cuda.reset_peak_memory_stats()
    row = {"atoms": len(a)}
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    try:
        for phase in phases:
            call = a.get_potential_energy if phase == "energy" else a.get_forces
            if phase == "forces" and "energy" in phases:
                a.positions += 1e-3
                row["rest_gb"] = (torch.cuda.memory_allocated() - base) / GB
            torch.cuda.reset_peak_memory_stats()
            try:
                call()
            except torch.cuda.OutOfMemoryError as error:  # what was alive when it failed
                row["error"] = f"out of GPU memory in the {phase} call: {str(error).splitlines()[0][:160]}"
            trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
            torch.cuda.memory._record_memory_history(enabled=None)
            torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python", clear_history=True)
            row[f"{phase}_peak_gb"] = (torch.cuda.max_memory_allocated() - base) / GB
            above, sites = peak_allocations(trace)
            row[f"{phase}_alive_at_peak_gb"] = dict(sites)
            if "error" in row:
                return row
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    row.update(edges=calc.n_edges, streaming=calc.streaming)
    row.setdefault("rest_gb", float("nan"))
    row["energy_peak_gb"] = row.get("energy_peak_gb", float("nan"))
    row["bytes_per_atom"] = row["forces_peak_gb"] * GB / len(a)
    row["bytes_per_edge"] = row["forces_peak_gb"] * GB / max(calc.n_edges, 1)
    del calc, a
    gc.collect()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", default="20k,100k")
    parser.add_argument("--streaming", default="on", choices=("on", "off"))
    parser.add_argument("--skin", type=float, default=1.0, help="Verlet skin in Å (bench_md's default)")
    parser.add_argument("--first-call", default="energy", choices=("energy", "forces"),
                        help="energy: an energy call (it builds the neighbour list), then a forces call; forces: "
                             "one forces call that builds the list too, as bench_md and MD begin")
    parser.add_argument("--cuda-graph", action="store_true", help="captured, as the default calculator runs")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("streaming_memory.py needs a CUDA GPU")
    model = mace_mp_shape(torch.float32, "medium")
    rows = []
    for name in args.systems.split(","):
        try:
            phases = ("energy", "forces") if args.first_call == "energy" else ("forces",)
            row = probe(water_box(n_side=WATER[name]), model, args.streaming == "on", args.skin, phases,
                        args.cuda_graph)
        except torch.cuda.OutOfMemoryError as error:
            row = {"system": name, "error": f"out of GPU memory: {str(error).splitlines()[0][:160]}"}
        gc.collect()
        torch.cuda.empty_cache()
        row["system"] = name
        rows.append(row)
        print(row, flush=True)
    path = write_json("streaming-memory", {"environment": environment(), "rows": rows, "args": vars(args)})
    print(f"JSON: {path}")
    print(f"{'system':8} {'atoms':>8} {'edges':>10} {'rest GB':>8} {'E GB':>8} {'E+F GB':>8} {'B/atom':>8} {'B/edge':>7}")
    for r in rows:
        for phase in ("energy", "forces"):
            for site, gb in r.get(f"{phase}_alive_at_peak_gb", {}).items():
                print(f"{r['system']:8} alive at the {phase} peak: {gb:7.3f} GB  {site}")
    for r in rows:
        if "error" in r:
            print(f"{r['system']:8} {r['error']}")
            continue
        print(f"{r['system']:8} {r['atoms']:8d} {r['edges']:10d} {r['rest_gb']:8.2f} {r['energy_peak_gb']:8.2f} "
              f"{r['forces_peak_gb']:8.2f} {r['bytes_per_atom']:8.0f} {r['bytes_per_edge']:7.0f}")


if __name__ == "__main__":
    main()
