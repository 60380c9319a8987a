"""One table convolution, forward then forward + backward, inside a CUDA profiler range, for Nsight Compute.

    ncu --profile-from-start off --cache-control none --set full -o $OUT/conv \\
        python3 benchmarks/investigations/conv_ncu.py mace-mp-medium-l2 [--warmup 3]

Issue 62: the convolution's forward read ~9.9 GB of radial table a call and took what an L2-bandwidth bound
predicts, yet 25 % fewer table bytes (the packed table) did not make it faster, while visiting each receiver's
edges shortest first did (docs/convolution-bytes.md). Before a tensor-core radial path is built its gain must be
re-predicted with the kernels' real limiter: this runs the layer as ``bench_layer.py``'s ``cgforge-table`` row runs
it (the 5,184-atom water box, MACE's radial MLP shape with random weights fitted to a 1e-7 table, gradients to x,
y and the lengths) ``--warmup`` times outside the range, then once inside it (``--by-length``: each receiver's edges
shortest first). Prints the kernels' CUDA-event times beside, so the profile's kernels can be matched to the
benchmark's. Needs a CUDA GPU. (Its ``--forward-min-blocks`` timing of forward launch bounds, with the
``TPTuning.forward_min_blocks`` knob it measured, is in commit 3643ef5: a bound of 6 blocks made the forward slower.)
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from e3nn import o3

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_conv import edges, water_system  # noqa: E402
from bench_layer import edge_lengths  # noqa: E402
from bench_radial_table import R_MAX, mlp_of_r  # noqa: E402
from common import cuda_time  # noqa: E402

from cgforge.kernels import ConvGraph, Convolution  # noqa: E402
from cgforge.kernels.problem_set import MODEL_LAYERS, PROBLEMS  # noqa: E402
from cgforge.kernels.radial_table import fit_radial_table  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("problem", nargs="?", default="mace-mp-medium-l2")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--by-length", action="store_true", help="each receiver's edges shortest first")
    args = parser.parse_args()
    known = PROBLEMS | MODEL_LAYERS
    if args.problem not in known:
        sys.exit(f"conv_ncu: unknown problem {args.problem!r}; known: {sorted(known)}")
    if not torch.cuda.is_available():
        sys.exit("conv_ncu: needs a CUDA GPU")
    atoms, cutoff = water_system()
    sender, receiver = edges(atoms, cutoff)
    lengths = edge_lengths(atoms, sender, receiver)
    if args.by_length:
        order = torch.argsort(lengths)
        order = order[torch.argsort(receiver[order], stable=True)]
        sender, receiver, lengths = sender[order], receiver[order], lengths[order]
    n = len(atoms)
    graph = ConvGraph(sender, receiver, n, deterministic=True)
    i1, i2, io, ins = known[args.problem]
    e3 = o3.TensorProduct(i1, i2, io, ins, shared_weights=False, internal_weights=False)
    conv = Convolution.from_e3nn(e3).to("cuda")
    mlp = mlp_of_r(e3.weight_numel, torch.Generator().manual_seed(0))
    table = fit_radial_table(mlp.double(), R_MAX, tol=1e-7)
    coeffs = table.coeffs.float().cuda()
    x = torch.randn(n, i1.dim, device="cuda", requires_grad=True)
    y = torch.randn(sender.shape[0], i2.dim, device="cuda", requires_grad=True)
    r = lengths.clone().requires_grad_()

    def forward() -> torch.Tensor:
        return conv.forward_table(x, y, r, coeffs, R_MAX, graph)

    g = torch.randn_like(forward())

    def both() -> None:
        torch.autograd.grad(forward(), (x, y, r), g)

    for _ in range(args.warmup):
        both()
    torch.cuda.synchronize()
    print(f"{args.problem}: {n} nodes, {sender.shape[0]} edges, {e3.weight_numel} weights an edge, "
          f"{table.intervals} intervals ({coeffs.numel() * 4 / 1e6:.1f} MB of table); by length: {args.by_length}")
    print(f"CUDA events: forward {cuda_time(forward, iters=10, warmup=2):.3f} ms, "
          f"forward + backward {cuda_time(both, iters=10, warmup=2):.3f} ms", flush=True)
    torch.cuda.profiler.start()
    with torch.no_grad():
        forward()
    both()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
