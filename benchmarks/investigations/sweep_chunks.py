"""Channel-chunk sweep: time cgforge's forward and backward kernels for each chunk size, one process.

The forward and backward kernels have their own chunk and shared-memory window, so one variant
(chunk c for both) gives the forward time at c and the backward time (f+b minus fwd) at c.
The first chunk is measured again at the end to show drift. Informs schedule.default_chunks.

    python3 benchmarks/investigations/sweep_chunks.py        (CHUNKS=32,64,128 DTYPES=float32 BATCH=50000)
"""

from __future__ import annotations

import os
import sys

import torch
from e3nn import o3

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
from bench_conv import edges, water_system  # noqa: E402
from common import cuda_time, environment, write_json  # noqa: E402

from cgforge.kernels import ConvGraph, Convolution, TensorProduct, TPTuning  # noqa: E402
from cgforge.kernels.problem_set import PROBLEMS  # noqa: E402

TP_PROBLEMS = ["mace-large", "mace-medium", "nequip-water", "nequip-benzene", "nequip-presetM", "nequip-lmax2",
               "diffdock-L1", "tetris-poly"]
CONV_PROBLEMS = ["mace-medium", "mace-large", "nequip-water", "nequip-benzene"]


def fwd_and_bwd(run, leaves) -> tuple[float, float]:
    out = run()
    g = torch.randn_like(out)
    fwd = cuda_time(run, iters=10, warmup=3)
    fb = cuda_time(lambda: torch.autograd.grad(run(), leaves, g), iters=10, warmup=3)
    return fwd, fb - fwd


def main() -> None:
    chunks = [int(c) for c in os.environ.get("CHUNKS", "32,64,128").split(",")]
    dtypes = [getattr(torch, d) for d in os.environ.get("DTYPES", "float32").split(",")]
    batch = int(os.environ.get("BATCH", "50000"))
    atoms, cutoff = water_system()
    sender, receiver = edges(atoms, cutoff)
    n, e = len(atoms), sender.shape[0]
    graphs = {"det": ConvGraph(sender, receiver, n), "atomic": ConvGraph(sender, receiver, n, deterministic=False)}
    rows = []
    for dtype in dtypes:
        for chunk in [*chunks, chunks[0]]:
            tuning = TPTuning(forward_chunk=chunk, backward_chunk=chunk)  # a plan of its own per chunk
            for name in TP_PROBLEMS:
                i1, i2, io, ins = PROBLEMS[name]
                e3 = o3.TensorProduct(i1, i2, io, ins, shared_weights=False, internal_weights=False)
                tp = TensorProduct.from_e3nn(e3, tuning=tuning).to("cuda")
                x, y, w = (torch.randn(batch, d, device="cuda", dtype=dtype, requires_grad=True)
                           for d in (i1.dim, i2.dim, e3.weight_numel))
                f, b = fwd_and_bwd(lambda: tp(x, y, w), (x, y, w))
                rows.append({"kind": "tp", "problem": name, "dtype": str(dtype)[6:], "chunk": chunk, "fwd": f, "bwd": b})
                print(rows[-1], flush=True)
            for name in CONV_PROBLEMS:
                i1, i2, io, ins = PROBLEMS[name]
                e3 = o3.TensorProduct(i1, i2, io, ins, shared_weights=False, internal_weights=False)
                conv = Convolution.from_e3nn(e3, tuning=tuning).to("cuda")
                x = torch.randn(n, i1.dim, device="cuda", dtype=dtype, requires_grad=True)
                y = torch.randn(e, i2.dim, device="cuda", dtype=dtype, requires_grad=True)
                w = torch.randn(e, e3.weight_numel, device="cuda", dtype=dtype, requires_grad=True)
                for tag, graph in graphs.items():
                    f, b = fwd_and_bwd(lambda graph=graph: conv(x, y, w, graph), (x, y, w))
                    rows.append({"kind": f"conv-{tag}", "problem": name, "dtype": str(dtype)[6:], "chunk": chunk,
                                 "fwd": f, "bwd": b})
                    print(rows[-1], flush=True)
                torch.cuda.empty_cache()
    path = write_json("chunk-sweep", {"env": environment(), "edges": e, "batch": batch, "rows": rows})
    print(f"\nJSON: {path}\n{'kind':12s} {'problem':16s} {'dtype':8s} " +
          " ".join(f"{'f' + str(c):>8s}" for c in chunks) + " " + " ".join(f"{'b' + str(c):>8s}" for c in chunks)
          + "   (ms; last column pair = first chunk again)")
    keys = sorted({(r["kind"], r["problem"], r["dtype"]) for r in rows}, key=lambda k: (k[2], k[0], k[1]))
    for k in keys:
        sel = [r for r in rows if (r["kind"], r["problem"], r["dtype"]) == k]
        f = " ".join(f"{r['fwd']:8.3f}" for r in sel)
        b = " ".join(f"{r['bwd']:8.3f}" for r in sel)
        print(f"{k[0]:12s} {k[1]:16s} {k[2]:8s} {f} | {b}")


if __name__ == "__main__":
    main()
