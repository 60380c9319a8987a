"""Spherical harmonics of edge vectors: cgforge's kernel (``cgforge.kernels.harmonics``) against e3nn's module on
the same vectors, forward and forward + backward, with the memory floor beside them.

    python benchmarks/bench_harmonics.py [--edges 270000 5400000 54000000] [--lmax 2 3] [--dtype float32]

Edges: 270,000 ~ the 5,184-atom water box at 5 A, 54 M ~ the 1.03 M-atom box. The floor is the bytes moved
(forward: 3 values in, D out; backward: 3 + D in, 3 out) at the device's copy bandwidth. Median of CUDA-event
timings. The table last; JSON under $OUT when set, else benchmarks/results/.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import copy_bandwidth, cuda_time, environment, write_json  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--edges", type=int, nargs="+", default=[270_000, 5_400_000, 54_000_000])
    parser.add_argument("--lmax", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_harmonics: needs a CUDA GPU")
    from e3nn import o3

    from cgforge.kernels.harmonics import HarmonicsPolynomials, harmonics

    dtype = getattr(torch, args.dtype)
    bandwidth = copy_bandwidth()
    rows = []
    for lmax in args.lmax:
        module = o3.SphericalHarmonics(o3.Irreps.spherical_harmonics(lmax), normalize=True,
                                       normalization="component").cuda()
        polys = HarmonicsPolynomials.of(module)
        for edges in args.edges:
            v = torch.randn(edges, 3, dtype=dtype, device="cuda")
            grad = torch.randn(edges, polys.dim, dtype=dtype, device="cuda")
            size = torch.finfo(dtype).bits // 8
            floor_fwd = edges * (3 + polys.dim) * size / bandwidth * 1e3
            floor_both = floor_fwd + edges * (3 + polys.dim + 3) * size / bandwidth * 1e3
            for name, fn in (("e3nn", module), ("cgforge", lambda x: harmonics(x, polys))):
                x = v.clone().requires_grad_()

                def both(fn=fn, x=x, grad=grad) -> None:  # noqa: ANN001
                    torch.autograd.grad(fn(x), x, grad)

                with torch.no_grad():
                    fwd = cuda_time(lambda fn=fn, v=v: fn(v))
                row = {"lmax": lmax, "edges": edges, "impl": name, "dtype": args.dtype, "fwd_ms": fwd,
                       "fwd_bwd_ms": cuda_time(both), "floor_fwd_ms": floor_fwd, "floor_fwd_bwd_ms": floor_both}
                rows.append(row)
                print(f"lmax {lmax} edges {edges:>10,} {name:>8}: fwd {row['fwd_ms']:8.3f} ms, fwd+bwd "
                      f"{row['fwd_bwd_ms']:8.3f} ms", flush=True)
    out = write_json("harmonics", {"environment": environment(), "bandwidth_GBs": bandwidth / 1e9, "rows": rows})
    print(f"\n{'lmax':>4} {'edges':>11} {'impl':>8} {'fwd ms':>9} {'floor':>7} {'fwd+bwd ms':>11} {'floor':>7}")
    for r in rows:
        print(f"{r['lmax']:>4} {r['edges']:>11,} {r['impl']:>8} {r['fwd_ms']:9.3f} {r['floor_fwd_ms']:7.3f} "
              f"{r['fwd_bwd_ms']:11.3f} {r['floor_fwd_bwd_ms']:7.3f}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
