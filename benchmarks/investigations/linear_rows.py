"""The row paths' frozen Linear on a chunk of rows, three ways, on the GPU: MACE-MP-medium's two block linears
(the convolution's [R, 2048] / [R, 5120] rows -> [R, 2048]) and their transposes, R rows written into rows of a
wider output as the row paths do.

- ``map``: ``SplitLinear._map`` then a copy into the output (before map_into);
- ``map_into``: per vector irrep a transposed copy of the input, one GEMM, one move into the output;
- ``bmm``: no copies: per row a [mul_out, mul_in] x [mul_in, dim] product straight from the input's columns into
  the output's (one strided batched GEMM per path, the weights broadcast).

    python3 benchmarks/investigations/linear_rows.py [--rows 13107] [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
from shapes import mace_mp_shape  # noqa: E402


def map_into_bmm(layer, x: torch.Tensor, out: torch.Tensor, transpose: bool = False) -> None:
    """``layer.map_into`` by strided batched GEMMs (candidate: no transposed copies)."""
    in_dims, out_dims = (layer.out_dims, layer.in_dims) if transpose else (layer.in_dims, layer.out_dims)
    rows = x.shape[0]
    in_starts = [sum(in_dims[:i]) for i in range(len(in_dims))]
    out_starts = [sum(out_dims[:i]) for i in range(len(out_dims))]
    written: set[int] = set()
    with torch.no_grad():
        for (i_in, i_out, _, mul_in, mul_out, _), w in zip(layer.paths, layer._scaled_blocks(), strict=True):
            if transpose:
                i_in, i_out, mul_in, mul_out, w = i_out, i_in, mul_out, mul_in, w.t()
            dim = in_dims[i_in] // mul_in
            xi = x.narrow(1, in_starts[i_in], in_dims[i_in]).view(rows, mul_in, dim)
            target = out.narrow(1, out_starts[i_out], out_dims[i_out]).view(rows, mul_out, dim)
            wt = w.t().unsqueeze(0).expand(rows, mul_out, mul_in)
            target.baddbmm_(wt, xi, beta=1 if i_out in written else 0)
            written.add(i_out)
        for i_out, width in enumerate(out_dims):
            if i_out not in written:
                out.narrow(1, out_starts[i_out], width).zero_()


def timed(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=13107)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    from cgforge.patches import patch

    model = patch(mace_mp_shape(torch.float32, "medium")).cuda()
    rows_out = []
    print(f"{'layer':8s} {'dir':9s} {'map':>8s} {'map_into':>9s} {'bmm':>8s}  ms per {args.rows} rows; bmm error")
    for i, block in enumerate(model.interactions):
        layer = block.linear.module if hasattr(block.linear, "module") else block.linear
        layer.requires_grad_(False)
        for transpose in (False, True):
            d_in, d_out = (layer.out_width, sum(layer.in_dims)) if transpose else (sum(layer.in_dims), layer.out_width)
            x = torch.randn(args.rows, d_in, device="cuda")
            wide = torch.empty(args.rows * 2, d_out + 64, device="cuda")
            out = wide[: args.rows, 32:32 + d_out]
            times = {
                "map": timed(lambda: out.copy_(layer._map(x, transpose)), args.repeats),
                "map_into": timed(lambda: layer.map_into(x, out, transpose), args.repeats),
                "bmm": timed(lambda: map_into_bmm(layer, x, out, transpose), args.repeats),
            }
            layer.map_into(x, out, transpose)
            want = out.clone()
            map_into_bmm(layer, x, out, transpose)
            error = float((out - want).abs().max() / want.abs().max())
            name = "backward" if transpose else "forward"
            print(f"{i:<8d} {name:9s} {times['map']:8.3f} {times['map_into']:9.3f} {times['bmm']:8.3f}  {error:.1e}")
            rows_out.append({"layer": i, "direction": name, "rows": args.rows, **times, "bmm_rel_error": error})
    with open(os.path.join(os.environ.get("OUT", "."), "linear_rows.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
