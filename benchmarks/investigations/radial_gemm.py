"""The radial-MLP GEMMs of MACE-MP-medium on a 5184-atom water box, with cuBLAS and with cuBLASLt.

    python3 benchmarks/investigations/radial_gemm.py [--edges 436566]

Those GEMMs (FP32, no TF32) are ~9 ms of the 5184-atom MD step; torch picks cuBLAS by default. This
times each shape (forward [E, k] @ [k, n] and the input-gradient [E, n] @ [n, k]) with both libraries and
prints TFLOP/s, so the choice is measured, not guessed. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
from common import cuda_time, environment, write_json

# (k, n) of the last radial-MLP layer per interaction and of a hidden layer
SHAPES = [(64, 1280), (64, 512), (64, 64), (8, 64)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--edges", type=int, default=436566)
    args = parser.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    for k, n in SHAPES:
        a = torch.randn(args.edges, k, device="cuda")
        w = torch.randn(k, n, device="cuda")
        g = torch.randn(args.edges, n, device="cuda")
        for kind, fn in (("forward", lambda: a @ w), ("grad_input", lambda: g @ w.T)):
            row = {"shape": f"[{args.edges},{k if kind == 'forward' else n}]x[{k if kind == 'forward' else n},"
                            f"{n if kind == 'forward' else k}]", "kind": kind}
            for library in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(library)
                ms = cuda_time(fn, iters=20, warmup=5)
                row[library + "_ms"] = ms
                row[library + "_tflops"] = 2 * args.edges * k * n / (ms * 1e-3) / 1e12
            rows.append(row)
    torch.backends.cuda.preferred_blas_library("cublas")
    print(f"{'GEMM':28s} {'kind':10s} {'cuBLAS ms':>10s} {'TF/s':>6s} {'cuBLASLt ms':>12s} {'TF/s':>6s}")
    for r in rows:
        print(f"{r['shape']:28s} {r['kind']:10s} {r['cublas_ms']:10.3f} {r['cublas_tflops']:6.1f} "
              f"{r['cublaslt_ms']:12.3f} {r['cublaslt_tflops']:6.1f}")
    write_json("radial-gemm", {"environment": environment(), "edges": args.edges, "rows": rows})


if __name__ == "__main__":
    main()
