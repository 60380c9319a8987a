"""Radial tables vs the radial MLP they replace, per layer (one GPU, FP32).

    python benchmarks/bench_radial_table.py [--edges 436566] [--widths 96,224,512,1280]

For each weight width C: the MLP path (MACE's shape: an 8-function Bessel basis of r, then 8 -> 64 -> 64 -> 64 -> C
with SiLU, e3nn-style, as torch ops and cuBLAS GEMMs; its forward, and forward + the backward to r) against
``kernels.radial_table`` (the table's evaluation, and the evaluation + the dot-product backward), with the
edges taken in order of length (the default) and in their own order. The floor: writing [E, C] once (the
forward), and reading it once (the backward's gradient), at the copy bandwidth measured in the same run.
Prints a table; JSON goes to benchmarks/results/ (or $OUT).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import copy_bandwidth, cuda_time, environment, write_json  # noqa: E402

from cgforge.kernels.radial_table import fit_radial_table, ops  # noqa: E402

R_MAX = 6.0


def mlp_of_r(width: int, generator: torch.Generator) -> torch.nn.Module:
    """r [E] -> [E, width]: MACE's Bessel basis (times a polynomial cutoff) and a 3-hidden-layer SiLU MLP."""
    class Radial(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            sizes = (8, 64, 64, 64, width)
            self.weights = torch.nn.ParameterList(
                torch.nn.Parameter(torch.randn(a, b, generator=generator) / math.sqrt(a), requires_grad=False)
                for a, b in zip(sizes[:-1], sizes[1:], strict=True))
            self.register_buffer("freq", torch.arange(1, 9) * math.pi / R_MAX)

        def hidden(self, r: torch.Tensor) -> torch.Tensor:
            """The last hidden layer [E, 64]: what the last linear layer (``weights[-1]``) maps to W."""
            x = r.unsqueeze(1)
            u = x / R_MAX
            h = torch.sin(self.freq * x) / x * (1 - 28 * u ** 6 + 48 * u ** 7 - 21 * u ** 8)
            for w in self.weights[:-1]:
                h = torch.nn.functional.silu(h @ w)
            return h

        def forward(self, r: torch.Tensor) -> torch.Tensor:
            return self.hidden(r) @ self.weights[-1]

    return Radial()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--edges", type=int, default=436566, help="edges (default: the 5184-atom water box at 6 Å)")
    parser.add_argument("--widths", default="96,224,512,1280", help="weight widths C (comma-separated)")
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    r = (torch.rand(args.edges, generator=generator, dtype=torch.float64) * (R_MAX - 0.8) + 0.8).float().cuda()
    bandwidth = copy_bandwidth()
    rows = []
    for width in (int(w) for w in args.widths.split(",")):
        mlp = mlp_of_r(width, generator)
        table = fit_radial_table(mlp.double(), R_MAX, tol=1e-7)
        mlp = mlp.float().cuda()
        coeffs = table.coeffs.float().cuda()
        rg = r.clone().requires_grad_()

        def mlp_forward_backward():
            (g,) = torch.autograd.grad(mlp(rg).sum(), rg)
            return g

        def table_forward_backward(by_length: int):
            (g,) = torch.autograd.grad(ops.radial_table(rg, coeffs, R_MAX, by_length=by_length).sum(), rg)
            return g

        row = {"width": width, "edges": args.edges, "intervals": table.intervals,
               "table_error": max(table.value_error, table.slope_error),
               "mlp_fwd_ms": cuda_time(lambda: mlp(r)), "mlp_fwd_bwd_ms": cuda_time(mlp_forward_backward)}
        for label, by_length in (("sorted", 1), ("unsorted", 0)):
            row[f"table_fwd_ms_{label}"] = cuda_time(lambda: ops.radial_table(r, coeffs, R_MAX, by_length=by_length))
            row[f"table_fwd_bwd_ms_{label}"] = cuda_time(lambda: table_forward_backward(by_length))
        row["floor_fwd_ms"] = args.edges * width * 4 / bandwidth * 1e3
        row["floor_fwd_bwd_ms"] = 3 * row["floor_fwd_ms"]  # write W; the backward writes and reads its gradient
        rows.append(row)
        print(row, flush=True)
    path = write_json("radial-table", {"environment": environment(), "args": vars(args), "rows": rows,
                                       "copy_bandwidth_GBps": bandwidth / 1e9})
    print(f"\n{torch.cuda.get_device_name()}, {args.edges} edges, FP32, copy bandwidth {bandwidth / 1e9:.0f} GB/s; "
          f"JSON: {path}")
    print("width  intervals  MLP fwd  table fwd (sorted / own order)  floor | MLP f+b  table f+b (sorted / own)  floor")
    for x in rows:
        print(f"{x['width']:5d} {x['intervals']:10d} {x['mlp_fwd_ms']:8.3f} {x['table_fwd_ms_sorted']:10.3f} / "
              f"{x['table_fwd_ms_unsorted']:6.3f} {x['floor_fwd_ms']:14.3f} | {x['mlp_fwd_bwd_ms']:7.3f} "
              f"{x['table_fwd_bwd_ms_sorted']:9.3f} / {x['table_fwd_bwd_ms_unsorted']:6.3f} {x['floor_fwd_bwd_ms']:10.3f}")


if __name__ == "__main__":
    main()
