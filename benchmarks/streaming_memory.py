"""Where the memory of a streaming MACE step goes: at rest, energy only, energy + forces (one GPU, FP32).

    python benchmarks/streaming_memory.py --systems 20k,100k [--streaming on|off]

Prints GB and bytes per atom / per edge for: the calculator's buffers at rest after a step (neighbour list,
edge layout, model), the peak of an energy-only call (forward) and of an energy + forces call. JSON goes to
benchmarks/results/ (or $OUT).
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


class SavedTensors:
    """What autograd keeps for the backward, in GB, by kind of row: per atom, per edge, other (each storage once)."""

    def __init__(self, atoms: int, edges: int) -> None:
        self.atoms, self.edges = atoms, edges
        self.seen: dict[int, tuple[str, int, tuple]] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.is_cuda:
            rows = t.shape[0] if t.dim() else 0
            kind = "atom" if rows == self.atoms else "edge" if rows >= 0.9 * self.edges and rows > self.atoms else "other"
            storage = t.untyped_storage()
            self.seen[storage.data_ptr()] = (kind, storage.nbytes(), tuple(t.shape))
        return t

    def unpack(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def summary(self) -> dict:
        out: dict = {}
        for kind, nbytes, shape in self.seen.values():
            out.setdefault(kind, 0.0)
            out[kind] += nbytes / GB
            key = f"{kind} {list(shape[1:])}"
            out[key] = out.get(key, 0.0) + nbytes / GB
        return dict(sorted(out.items(), key=lambda kv: -kv[1])[:16])


def probe(atoms, model: torch.nn.Module, streaming: bool) -> dict:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    calc = Calculator(model, device="cuda", streaming=streaming, cuda_graph=False, forces_with_energy=False)
    a = atoms.copy()
    a.calc = calc
    torch.cuda.reset_peak_memory_stats()
    a.get_potential_energy()
    row = {"atoms": len(a), "edges": calc.n_edges, "streaming": calc.streaming,
           "energy_peak_gb": (torch.cuda.max_memory_allocated() - base) / GB}
    row["rest_gb"] = (torch.cuda.memory_allocated() - base) / GB
    a.positions += 1e-3
    torch.cuda.reset_peak_memory_stats()
    saved = SavedTensors(len(a), calc.n_edges)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        a.get_forces()
    row["forces_peak_gb"] = (torch.cuda.max_memory_allocated() - base) / GB
    row["saved_for_backward_gb"] = saved.summary()
    row["bytes_per_atom"] = row["forces_peak_gb"] * GB / len(a)
    row["bytes_per_edge"] = row["forces_peak_gb"] * GB / max(calc.n_edges, 1)
    del calc, a
    gc.collect()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", default="20k,100k")
    parser.add_argument("--streaming", default="on", choices=("on", "off"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("streaming_memory.py needs a CUDA GPU")
    model = mace_mp_shape(torch.float32, "medium")
    rows = []
    for name in args.systems.split(","):
        try:
            row = probe(water_box(n_side=WATER[name]), model, args.streaming == "on")
        except torch.cuda.OutOfMemoryError:
            row = {"system": name, "error": "out of GPU memory"}
        row["system"] = name
        rows.append(row)
        print(row, flush=True)
    path = write_json("streaming-memory", {"environment": environment(), "rows": rows, "args": vars(args)})
    print(f"JSON: {path}")
    print(f"{'system':8} {'atoms':>8} {'edges':>10} {'rest GB':>8} {'E GB':>8} {'E+F GB':>8} {'B/atom':>8} {'B/edge':>7}")
    for r in rows:
        if "saved_for_backward_gb" in r:
            print(r["system"], "saved for backward (GB):", {k: round(v, 2) for k, v in r["saved_for_backward_gb"].items()})
    for r in rows:
        if "error" in r:
            print(f"{r['system']:8} {r['error']}")
            continue
        print(f"{r['system']:8} {r['atoms']:8d} {r['edges']:10d} {r['rest_gb']:8.2f} {r['energy_peak_gb']:8.2f} "
              f"{r['forces_peak_gb']:8.2f} {r['bytes_per_atom']:8.0f} {r['bytes_per_edge']:7.0f}")


if __name__ == "__main__":
    main()
