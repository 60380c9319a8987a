"""One convolution layer's table kernels under several tunings, with and without grad x (issue 38).

    python3 benchmarks/investigations/conv_layers.py [--problem mace-mp-medium-l2 ...]
        [--tuning NAME=SPEC ...] [--once]

Each ``--problem`` (``problem_set.MODEL_LAYERS`` or ``PROBLEMS``; default MACE-MP-medium's second layer and the
bundled MACE's) runs ``Convolution.forward_table`` on the 5,184-atom water box (bench_layer's graph, real edge
lengths, a radial table fitted to MACE's MLP shape) under each ``--tuning`` (``bench_layer.parse_tuning``'s
``name=value,...``; ``default=`` is the defaults), forward and forward + backward to (x, y, r) and to (y, r): with
grad x the backward MD's second layer runs (fixed-point atomics over the receivers where the grad-out rows exceed
the L2), without it the one of MD's first layer (the receiver walk, no grad x). Prints ms per call and the
backward (their difference).

``--once``: one forward + backward per case and no timing, for a profiler around the process, e.g.
``ncu --clock-control none --kernel-name regex:"cgf_.*backward" --set full -o OUT python3 ... --once``
(autograd runs the backward on a thread of its own: an NVTX range pushed in the main thread does not hold it).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from e3nn import o3

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
from bench_conv import edges, water_system  # noqa: E402
from bench_layer import edge_lengths, parse_tuning  # noqa: E402
from bench_radial_table import R_MAX, mlp_of_r  # noqa: E402
from common import cuda_time  # noqa: E402

from cgforge.kernels import ConvGraph, Convolution  # noqa: E402
from cgforge.kernels.problem_set import MODEL_LAYERS, PROBLEMS  # noqa: E402
from cgforge.kernels.radial_table import fit_radial_table  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problem", action="append", default=[], metavar="NAME")
    parser.add_argument("--tuning", action="append", default=[], metavar="NAME=SPEC")
    parser.add_argument("--once", action="store_true", help="one forward + backward per case, untimed")
    args = parser.parse_args()
    known = MODEL_LAYERS | PROBLEMS
    names = args.problem or ["mace-mp-medium-l2", "mace-water-l2"]
    unknown = [n for n in names if n not in known]
    if unknown:
        sys.exit(f"conv_layers: unknown problem(s) {unknown}; known: {sorted(known)}")
    tunings = {}
    for spec in args.tuning or ["default="]:
        name, sep, fields = spec.partition("=")
        if not sep or not name:
            sys.exit(f"conv_layers: --tuning wants NAME=SPEC, got {spec!r}")
        tunings[name] = parse_tuning(fields)
    if not torch.cuda.is_available():
        sys.exit("conv_layers: needs a CUDA GPU")
    atoms, cutoff = water_system()
    sender, receiver = edges(atoms, cutoff)
    n = len(atoms)
    lengths = edge_lengths(atoms, sender, receiver)
    graph = ConvGraph(sender, receiver, n, deterministic=True)
    generator = torch.Generator().manual_seed(0)
    print(f"water: {n} nodes, {sender.shape[0]} edges; ms per call, FP32, table kernels", flush=True)
    for problem in names:
        i1, i2, io, ins = known[problem]
        e3 = o3.TensorProduct(i1, i2, io, ins, shared_weights=False, internal_weights=False)
        coeffs = fit_radial_table(mlp_of_r(e3.weight_numel, generator).double(), R_MAX, tol=1e-7).coeffs
        coeffs = coeffs.float().cuda()
        y = torch.randn(sender.shape[0], i2.dim, device="cuda", requires_grad=True)
        r = lengths.clone().requires_grad_()
        for tag, tuning in tunings.items():
            conv = Convolution.from_e3nn(e3, tuning=tuning).to("cuda")
            for grad_x in (True, False):
                x = torch.randn(n, i1.dim, device="cuda", requires_grad=grad_x)
                leaves = (x, y, r) if grad_x else (y, r)

                def forward(conv=conv, x=x):
                    return conv.forward_table(x, y, r, coeffs, R_MAX, graph)

                g = torch.randn_like(forward())

                def forward_backward(forward=forward, leaves=leaves, g=g):
                    return torch.autograd.grad(forward(), leaves, g)

                label = f"{problem} {tag}{'' if grad_x else ' (no grad x)'}"
                if args.once:
                    forward_backward()
                    torch.cuda.synchronize()
                    print(f"ran: {label}", flush=True)
                    continue
                fwd = cuda_time(forward, iters=20, warmup=5)
                both = cuda_time(forward_backward, iters=20, warmup=5)
                print(f"{label:50s} fwd {fwd:7.3f}  fwd+bwd {both:7.3f}  bwd {both - fwd:7.3f}", flush=True)


if __name__ == "__main__":
    main()
