"""One interaction layer's radial weights + convolution, per layer, forward and forward+backward (one GPU, FP32).

    python benchmarks/bench_layer.py [problem ...] [--tuning SPEC ...]     (default: mace-medium mace-large)

Issue 18's per-layer comparison on the 5184-atom water box (436,566 edges at 6 Å, real edge lengths):

- ``cgforge-table``: what the default calculator runs, ``Convolution.forward_table``: the radial weights read
  from a cubic table of the edge length inside the convolution's kernels (no [E, weight_numel] tensor);
- ``cgforge-mlp``: MACE's radial MLP as torch ops and cuBLAS GEMMs, then cgforge's convolution on stored weights;
- ``cueq-mlp``: the same MLP, then cuEquivariance's fused convolution (``SegmentedPolynomial``, ``uniform_1d``,
  gather by sender and scatter by receiver), as MACE runs it with cuEquivariance on.

The MLP is MACE's shape (8 Bessel functions times the polynomial cutoff, 8 -> 64 -> 64 -> 64 -> weight_numel,
SiLU), random weights; every row differentiates to x, y and the edge lengths (forces flow through all three).
``--tuning SPEC`` (repeatable) adds ``cgforge-table`` built with that ``TPTuning``, e.g. ``loop_order=chunks,
forward_chunk=64``, or ``backward_min_blocks=5,backward_chunk=64``: per layer kernel choices side by side in one process, a second table (with each one's forward's
relative difference from the default's); ``--by-length`` adds each of those rows with every receiver's edges
visited shortest first (neighbouring warps then read nearby rows of the table), the edges moved into that order;
``--by-length-perm`` the same visit order read through the graph's permutation (the edges left receiver-sorted),
beside a control that reads an identity permutation. Each row's backward is also timed alone, over one kept
forward. The floor (``layer_floor``) is a
lower bound per call: the larger of the bytes every kernel must move at the measured copy bandwidth and the CG
multiply-adds at the device's FP32 peak. Prints the tables; JSON goes to benchmarks/results/ (or $OUT).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch
from e3nn import o3

sys.path.insert(0, os.path.dirname(__file__))
from bench_conv import edges, water_system  # noqa: E402
from bench_radial_table import R_MAX, mlp_of_r  # noqa: E402
from common import copy_bandwidth, cuda_time, cueq_channelwise, environment, peers, write_json  # noqa: E402

from cgforge.kernels import ConvGraph, Convolution, TPTuning  # noqa: E402
from cgforge.kernels.problem_set import MODEL_LAYERS, PROBLEMS  # noqa: E402
from cgforge.kernels.radial_table import fit_radial_table  # noqa: E402
from cgforge.kernels.tensor_product.problem import TPProblem  # noqa: E402
from cgforge.kernels.tensor_product.program import build_program  # noqa: E402
from cgforge.kernels.tensor_product.schedule import build_schedule  # noqa: E402

# FP32 FMA throughput (non-tensor), TFLOP/s, by device name: NVIDIA's data sheets (SXM parts)
FP32_PEAK_TFLOPS = {"H100": 66.9, "H200": 66.9, "A100": 19.5}


def fp32_peak_tflops(device_name: str) -> float:
    """The data-sheet FP32 peak of a device named like 'NVIDIA H100 80GB HBM3' (nan if not listed)."""
    return next((v for k, v in FP32_PEAK_TFLOPS.items() if k in device_name), float("nan"))


def layer_floor(problem: TPProblem, nodes: int, edges: int, bandwidth: float, tflops: float,
                itemsize: int = 4) -> dict[str, float]:
    """Lower bounds (ms) of one table-convolution call, forward and forward + backward. Bytes: node rows read
    or written once (x, out; backward g, x, grad x), per edge y, the length, three 4-byte indices and (backward)
    grad y and grad r; the table itself and L2 reuse are free. FLOPs: 2 per CG multiply-add of the generated
    program (`TPProgram.summary`), nothing for the weights' cubics; both counts are under the truth."""
    i1, i2, io = problem.irreps_in1.dim, problem.irreps_in2.dim, problem.irreps_out.dim
    schedule = build_schedule(problem, itemsize=itemsize, rows_are_nodes=True)
    macs = {b: build_program(schedule, backward=b).summary()["cg_multiply_adds"] for b in (False, True)}
    per_edge = (i2 + 1) * itemsize + 3 * 4
    fwd_bytes = nodes * (i1 + io) * itemsize + edges * per_edge + nodes * 8
    bwd_bytes = nodes * (io + 2 * i1) * itemsize + edges * (per_edge + (i2 + 1) * itemsize) + nodes * 8
    ms = {}
    for tag, nbytes, flops in (("fwd", fwd_bytes, 2 * macs[False] * edges),
                               ("fb", fwd_bytes + bwd_bytes, 2 * (macs[False] + macs[True]) * edges)):
        ms[f"floor_{tag}_bytes_ms"] = nbytes / bandwidth * 1e3
        ms[f"floor_{tag}_flops_ms"] = flops / (tflops * 1e12) * 1e3
        ms[f"floor_{tag}"] = max(ms[f"floor_{tag}_bytes_ms"], ms[f"floor_{tag}_flops_ms"])
    return ms


def edge_lengths(atoms, sender: torch.Tensor, receiver: torch.Tensor) -> torch.Tensor:
    """|r| of every edge by the minimum image (the water box is cubic and periodic, its cell > 2 x 6 Å)."""
    pos = torch.tensor(atoms.positions, device="cuda", dtype=torch.float64)
    cell = torch.tensor(atoms.cell.array, device="cuda", dtype=torch.float64)
    d = pos[receiver] - pos[sender]
    frac = d @ torch.linalg.inv(cell)
    return ((frac - frac.round()) @ cell).norm(dim=1).float()


def parse_tuning(spec: str) -> TPTuning:
    """``name=value,...`` -> TPTuning (ints where the value is one, true/false/none as such); a bad spec exits
    naming it."""
    words = {"true": True, "false": False, "none": None}
    fields = {}
    try:
        for item in filter(None, spec.split(",")):
            key, value = (part.strip() for part in item.split("="))
            fields[key] = int(value) if value.lstrip("-").isdigit() else words.get(value.lower(), value)
        return TPTuning(**fields)
    except (TypeError, ValueError) as err:
        names = ", ".join(f.name for f in dataclasses.fields(TPTuning))
        sys.exit(f"bench_layer: --tuning {spec!r}: {err} (fields: {names})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("problems", nargs="*", default=["mace-medium", "mace-large"])
    parser.add_argument("--tuning", action="append", default=[], metavar="SPEC",
                        help="also time cgforge-table with this TPTuning (name=value,...); repeatable")
    parser.add_argument("--by-length", action="store_true",
                        help="also time each cgforge-table row with every receiver's edges in order of length")
    parser.add_argument("--by-length-perm", action="store_true",
                        help="also time each cgforge-table row visiting every receiver's edges in order of length "
                             "through the graph's permutation (the edges stay where they are: receiver-sorted), and "
                             "beside it the same kernels reading an identity permutation (the control)")
    args = parser.parse_args()
    names = args.problems
    known = PROBLEMS | MODEL_LAYERS
    unknown = [n for n in names if n not in known]
    if unknown:
        sys.exit(f"bench_layer: unknown problem(s) {unknown}; known: {sorted(known)}")
    tunings = {spec: parse_tuning(spec) for spec in args.tuning}
    if not torch.cuda.is_available():
        sys.exit("bench_layer: needs a CUDA GPU")
    found = peers()
    bandwidth, tflops = copy_bandwidth(), fp32_peak_tflops(torch.cuda.get_device_name())
    atoms, cutoff = water_system()
    sender, receiver = edges(atoms, cutoff)
    n, e = len(atoms), sender.shape[0]
    lengths = edge_lengths(atoms, sender, receiver)
    graph = ConvGraph(sender, receiver, n, deterministic=True)
    by_length = by_perm = by_identity = None
    order = None
    if args.by_length or args.by_length_perm:  # receivers' rows as before, each one's edges shortest first
        order = torch.argsort(lengths)
        order = order[torch.argsort(receiver[order], stable=True)]
    if args.by_length:  # the edges moved into that order: warps read nearby table rows
        by_length = order, ConvGraph(sender[order], receiver[order], n, deterministic=True)
        print(f"edges by length: perm empty {by_length[1].tensors().perm.numel() == 0} (given order: "
              f"{graph.tensors().perm.numel() == 0})", flush=True)
    if args.by_length_perm:  # the same visit order, read through perm: y, r and sender stay in receiver order
        if graph.tensors().perm.numel():
            sys.exit("bench_layer: --by-length-perm needs receiver-sorted edges (the given graph has a perm)")
        by_perm = ConvGraph.trusted(graph.tensors()._replace(perm=order.to(torch.int32).contiguous()), n)
        # the control: the same kernels reading an identity permutation (the given order)
        identity = torch.arange(e, dtype=torch.int32, device=sender.device)
        by_identity = ConvGraph.trusted(graph.tensors()._replace(perm=identity), n)
    print(f"water: {n} nodes, {e} edges, lengths {float(lengths.min()):.2f}..{float(lengths.max()):.2f} Å", flush=True)
    generator = torch.Generator().manual_seed(0)
    rows = []
    for name in names:
        i1, i2, io, ins = known[name]
        e3 = o3.TensorProduct(i1, i2, io, ins, shared_weights=False, internal_weights=False)
        conv = Convolution.from_e3nn(e3).to("cuda")
        mlp = mlp_of_r(e3.weight_numel, generator)
        table = fit_radial_table(mlp.double(), R_MAX, tol=1e-7)
        mlp, coeffs = mlp.float().cuda(), table.coeffs.float().cuda()
        x = torch.randn(n, i1.dim, device="cuda", requires_grad=True)
        y = torch.randn(e, i2.dim, device="cuda", requires_grad=True)
        r = lengths.clone().requires_grad_()
        row = {"problem": name, "edges": e, "weight_numel": e3.weight_numel, "table_intervals": table.intervals,
               **layer_floor(conv.problem, n, e, bandwidth, tflops)}
        impls = {"cgforge-table": (lambda: conv.forward_table(x, y, r, coeffs, R_MAX, graph), (x, y, r)),
                 "cgforge-mlp": (lambda: conv(x, y, mlp(r), graph), (x, y, r))}
        convs = {"": conv}
        for spec, tuning in tunings.items():
            tuned = convs[spec] = Convolution.from_e3nn(e3, tuning=tuning).to("cuda")
            impls[f"cgforge-table[{spec}]"] = (lambda c=tuned: c.forward_table(x, y, r, coeffs, R_MAX, graph),
                                               (x, y, r))
        if by_length is not None:
            order, graph_l = by_length
            y_l, r_l = y.detach()[order].requires_grad_(), r.detach()[order].requires_grad_()
            for spec, c in convs.items():
                impls[f"cgforge-table[{spec + ',' if spec else ''}by-length]"] = (
                    lambda c=c: c.forward_table(x, y_l, r_l, coeffs, R_MAX, graph_l), (x, y_l, r_l))
        if by_perm is not None:
            for spec, c in convs.items():
                impls[f"cgforge-table[{spec + ',' if spec else ''}by-length-perm]"] = (
                    lambda c=c: c.forward_table(x, y, r, coeffs, R_MAX, by_perm), (x, y, r))
                impls[f"cgforge-table[{spec + ',' if spec else ''}identity-perm]"] = (
                    lambda c=c: c.forward_table(x, y, r, coeffs, R_MAX, by_identity), (x, y, r))
        if "cueq" in found:
            try:
                sp, poly = cueq_channelwise(found, i1, i2, io, torch.float32)
                if poly.inputs[0].size != e3.weight_numel:
                    raise ValueError(f"cuEquivariance's weights are {poly.inputs[0].size} wide, e3nn's "
                                     f"{e3.weight_numel}")
                xc = torch.randn(n, poly.inputs[1].size, device="cuda", requires_grad=True)
                oc = torch.empty(n, poly.outputs[0].size, device="cuda")
                impls["cueq-mlp"] = (lambda sp=sp, xc=xc, oc=oc: sp([mlp(r), xc, y], {1: sender}, {0: oc},
                                                                     {0: receiver})[0], (xc, y, r))
            except Exception as exc:  # a peer that cannot run is reported, not fatal
                row["cueq_fail"] = repr(exc)[:200]
        with torch.no_grad():
            want = impls["cgforge-mlp"][0]()
            row["table_vs_mlp"] = float((impls["cgforge-table"][0]() - want).norm() / want.norm())
            base = impls["cgforge-table"][0]()
            for tag in (t for t in impls if t.startswith("cgforge-table[")):  # what each changes in the result
                row[f"{tag}_vs_default"] = float((impls[tag][0]() - base).norm() / base.norm())
        for tag, (fn, leaves) in impls.items():
            try:
                g = torch.randn_like(fn())
                row[f"{tag}_fwd"] = cuda_time(fn, iters=20, warmup=5)
                row[f"{tag}_fb"] = cuda_time(lambda fn=fn, g=g, leaves=leaves: torch.autograd.grad(fn(), leaves, g),
                                             iters=20, warmup=5)
                out = fn()  # the backward alone, over one kept forward (not fwd+bwd minus fwd: two medians' noise)
                row[f"{tag}_bwd"] = cuda_time(lambda out=out, g=g, leaves=leaves: torch.autograd.grad(
                    out, leaves, g, retain_graph=True), iters=20, warmup=5)
                del out
            except torch.OutOfMemoryError:
                row[f"{tag}_fail"] = "out of memory"
            except Exception as exc:
                row[f"{tag}_fail"] = repr(exc)[:200]
            torch.cuda.empty_cache()
        rows.append(row)
        print(row, flush=True)
    env = environment()
    path = write_json("layer", {"environment": env, "rows": rows})
    print(f"\n{env.get('device')}, torch {env['torch']}, commit {env.get('commit')}; JSON: {path}")
    print("ms per call, FP32, radial weights + convolution; fwd | fwd+bwd (gradients to x, y and the lengths)")
    tags = ("cgforge-table", "cgforge-mlp", "cueq-mlp", "floor")
    print(f"{'problem':12s} " + " ".join(f"{t:>14s}" for t in tags) + " |" + " ".join(f"{t:>14s}" for t in tags)
          + "   cueq/table fb  table/floor fb")
    for row in rows:
        fwd = " ".join(f"{row.get(f'{t}_fwd', float('nan')):14.3f}" for t in tags)
        fb = " ".join(f"{row.get(f'{t}_fb', float('nan')):14.3f}" for t in tags)
        ratio = row.get("cueq-mlp_fb", float("nan")) / row.get("cgforge-table_fb", float("nan"))
        print(f"{row['problem']:12s} {fwd} |{fb}   {ratio:.2f}x  "
              f"{row.get('cgforge-table_fb', float('nan')) / row['floor_fb']:6.1f}x")
    print(f"floor: bytes at {bandwidth / 1e9:.0f} GB/s (a measured copy) or CG multiply-adds at {tflops} TFLOP/s FP32, "
          "whichever is larger (fwd+bwd bytes | flops ms: "
          + ", ".join(f"{r['problem']} {r['floor_fb_bytes_ms']:.3f} | {r['floor_fb_flops_ms']:.3f}" for r in rows) + ")")
    if tunings or by_length is not None or by_perm is not None:
        print("\ncgforge-table per tuning: ms fwd, fwd+bwd, their difference, the backward timed alone, fwd+bwd vs the "
              "default, forward's relative difference from the default's")
        specs = ("", *tunings)
        base_specs = specs
        if by_length is not None:
            specs += tuple(f"{spec + ',' if spec else ''}by-length" for spec in base_specs)
        if by_perm is not None:
            specs += tuple(f"{spec + ',' if spec else ''}{kind}-perm" for spec in base_specs
                           for kind in ("by-length", "identity"))
        for row in rows:
            for spec in specs:
                tag = f"cgforge-table[{spec}]" if spec else "cgforge-table"
                fwd, fb = row.get(f"{tag}_fwd", float("nan")), row.get(f"{tag}_fb", float("nan"))
                bwd = row.get(f"{tag}_bwd", float("nan"))
                print(f"{row['problem']:12s} {spec or 'default':44s} {fwd:8.3f} {fb:8.3f} {fb - fwd:8.3f} {bwd:8.3f} "
                      f"{fb / row.get('cgforge-table_fb', float('nan')):6.2f}x "
                      f"{row.get(f'{tag}_vs_default', 0.0):8.1e}")


if __name__ == "__main__":
    main()
