"""Where the memory of a streaming MACE step goes: at rest, energy only, energy + forces (one GPU, FP32).

    python3 benchmarks/investigations/streaming_memory.py --systems 20k,100k [--streaming on|off] [--calls forces,forces] [--cuda-graph]

Prints, for each call in order (the first builds the neighbour list): its peak GB, what is allocated at rest before
it (neighbour list, edge layout, model, and anything a previous call left behind), and what is alive at its peak,
by the code that allocated it (torch's allocation history, replayed); bytes per atom / per edge of the largest
forces call. JSON goes to benchmarks/results/ (or $OUT).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
from bench_md import WATER  # noqa: E402
from common import add_backward_range_flag, apply_backward_range, environment, write_json  # noqa: E402
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


def probe(atoms, model: torch.nn.Module, streaming: bool, skin: float, calls: tuple[str, ...] = ("energy", "forces"),
          cuda_graph: bool = False) -> dict:
    """Peak GB of each call in ``calls`` (energy or forces; the first builds the neighbour list; the atoms move by
    1e-3 Å between calls, as an MD step does), what is allocated at rest before each later call, and what is alive at
    each peak. Keys: ``<i>_<call>_peak_gb``, ``<i>_rest_gb``, ``<i>_<call>_alive_at_peak_gb``; ``forces_peak_gb`` is
    the largest forces call."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    calc = Calculator(model, device="cuda", streaming=streaming, cuda_graph=cuda_graph, forces_with_energy=False,
                      skin=skin)
    a = atoms.copy()
    a.calc = calc
    row = {"atoms": len(a), "calls": list(calls)}
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    try:
        for i, call in enumerate(calls):
            key = f"{i}_{call}"
            if i:
                a.positions += 1e-3
                row[f"{i}_rest_gb"] = (torch.cuda.memory_allocated() - base) / GB
            torch.cuda.reset_peak_memory_stats()
            try:
                (a.get_potential_energy if call == "energy" else a.get_forces)()
            except torch.cuda.OutOfMemoryError as error:  # what was alive when it failed
                row["error"] = f"out of GPU memory in call {i} ({call}): {str(error).splitlines()[0][:160]}"
            trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
            torch.cuda.memory._record_memory_history(enabled=None)
            torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python", clear_history=True)
            row[f"{key}_peak_gb"] = (torch.cuda.max_memory_allocated() - base) / GB
            row[f"{key}_alive_at_peak_gb"] = dict(peak_allocations(trace)[1])
            if "error" in row:
                return row
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    row.update(edges=calc.n_edges, streaming=calc.streaming)
    row["forces_peak_gb"] = max((row[f"{i}_forces_peak_gb"] for i, c in enumerate(calls) if c == "forces"),
                                default=float("nan"))
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
    parser.add_argument("--calls", default="energy,forces",
                        help="the calls in order, energy or forces (the first builds the neighbour list); e.g. "
                             "forces,forces,forces as bench_md and MD run")
    parser.add_argument("--cuda-graph", action="store_true", help="captured, as the default calculator runs")
    add_backward_range_flag(parser)
    args = parser.parse_args()
    apply_backward_range(args)
    calls = tuple(args.calls.split(","))
    if not calls or any(c not in ("energy", "forces") for c in calls):
        sys.exit(f"--calls: expected energy and/or forces separated by commas, got {args.calls!r}")
    if not torch.cuda.is_available():
        sys.exit("streaming_memory.py needs a CUDA GPU")
    model = mace_mp_shape(torch.float32, "medium")
    rows = []
    for name in args.systems.split(","):
        try:
            row = probe(water_box(n_side=WATER[name]), model, args.streaming == "on", args.skin, calls,
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
    for r in rows:
        for i, call in enumerate(r.get("calls", ())):
            for site, gb in r.get(f"{i}_{call}_alive_at_peak_gb", {}).items():
                print(f"{r['system']:8} alive at call {i}'s peak ({call}): {gb:7.3f} GB  {site}")
    print(f"{'system':8} {'atoms':>8} {'edges':>10}  calls: peak GB (GB at rest before it)")
    for r in rows:
        calls_gb = "  ".join(f"{i} {c} {r[f'{i}_{c}_peak_gb']:.2f}" + (f" ({r[f'{i}_rest_gb']:.2f})" if i else "")
                             for i, c in enumerate(r.get("calls", ())) if f"{i}_{c}_peak_gb" in r)
        print(f"{r['system']:8} {r.get('atoms', 0):8d} {r.get('edges', 0):10d}  {calls_gb}  {r.get('error', '')}")


if __name__ == "__main__":
    main()
