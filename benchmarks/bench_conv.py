"""Fused convolution on real graphs: cgforge (deterministic and atomic) vs e3nn TP + index_add,
OpenEquivariance TensorProductConv (atomic, deterministic) and cuEquivariance's fused uniform_1d
polynomial with gather/scatter indices, in one process on one GPU.

    python benchmarks/bench_conv.py [problem ...]     (SYSTEMS=water,dhfr DTYPES=float32,float64 DOUBLE=1)
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
from e3nn import o3

sys.path.insert(0, os.path.dirname(__file__))
from common import NP_DTYPE, copy_bandwidth, cuda_time, cueq_channelwise, environment, fmt, peers, write_json  # noqa: E402
from shapes import dhfr_atoms  # noqa: E402

from cgforge.kernels import ConvGraph, Convolution  # noqa: E402
from cgforge.kernels.problem_set import PROBLEMS  # noqa: E402


def water_system():
    from cgforge.plugin.water import water_box

    return water_box(n_side=12), 6.0


def dhfr_system():
    return dhfr_atoms(), 5.0


def edges(atoms, cutoff):
    from cgforge.plugin.runtime.neighbours import neighbour_list

    pos = torch.tensor(atoms.positions, device="cuda")
    cell = torch.tensor(np.array(atoms.cell), device="cuda")
    s, r, _ = neighbour_list(pos, cell, tuple(bool(p) for p in atoms.pbc), cutoff)
    return s, r


def double_backward(fn, g, leaves) -> None:
    """What training with forces does: gradients with create_graph, then a gradient of a function of them."""
    grads = torch.autograd.grad(fn(), leaves, g, create_graph=True)
    torch.autograd.grad(sum(t.square().sum() for t in grads), leaves)


def main() -> None:
    double = os.environ.get("DOUBLE", "1") == "1"
    names = sys.argv[1:] or ["mace-medium", "mace-large", "nequip-water", "nequip-benzene"]
    systems = os.environ.get("SYSTEMS", "water,dhfr").split(",")
    dtypes = [getattr(torch, d) for d in os.environ.get("DTYPES", "float32,float64").split(",")]
    found = peers()
    bandwidth = copy_bandwidth()
    rows = []
    for sysname in systems:
        atoms, cutoff = water_system() if sysname == "water" else dhfr_system()
        sender, receiver = edges(atoms, cutoff)
        n, e = len(atoms), sender.shape[0]
        print(f"{sysname}: {n} nodes, {e} edges", flush=True)
        graph = ConvGraph(sender, receiver, n, deterministic=True)
        graph_atomic = ConvGraph(sender, receiver, n, deterministic=False)
        for dtype in dtypes:
            for name in names:
                i1, i2, io, ins = PROBLEMS[name]
                e3 = o3.TensorProduct(i1, i2, io, ins, shared_weights=False, internal_weights=False).to("cuda", dtype)
                conv = Convolution.from_e3nn(e3)
                x = torch.randn(n, i1.dim, device="cuda", dtype=dtype, requires_grad=True)
                y = torch.randn(e, i2.dim, device="cuda", dtype=dtype, requires_grad=True)
                w = torch.randn(e, e3.weight_numel, device="cuda", dtype=dtype, requires_grad=True)
                r = {"system": sysname, "problem": name, "dtype": str(dtype).split(".")[-1], "edges": e}
                nbytes = (x.numel() + y.numel() + w.numel() + n * io.dim) * x.element_size()
                r["floor_fwd"] = nbytes / bandwidth * 1e3
                r["floor_fb"] = 2.2 * r["floor_fwd"]  # backward re-reads x, y, W, g and writes the grads

                def e3nn_conv():
                    msg = e3(x[sender], y, w)
                    return torch.zeros(n, io.dim, device="cuda", dtype=dtype).index_add(0, receiver, msg)

                impls = {"det": lambda: conv(x, y, w, graph), "atomic": lambda: conv(x, y, w, graph_atomic)}
                try:
                    ref = e3nn_conv()
                    impls["e3nn"] = e3nn_conv
                    r["err"] = float((impls["det"]() - ref).norm() / ref.norm())
                    del ref
                except torch.OutOfMemoryError:
                    r["e3nn_fail"] = "out of memory"
                    torch.cuda.empty_cache()
                if "oeq" in found:
                    oeq = found["oeq"]
                    try:
                        prob = oeq.TPProblem(i1, i2, io, ins, shared_weights=False, internal_weights=False,
                                             irrep_dtype=NP_DTYPE[dtype], weight_dtype=NP_DTYPE[dtype])
                        ca = oeq.TensorProductConv(prob, torch_op=True, deterministic=False)
                        impls["oeq_atomic"] = lambda ca=ca: ca.forward(x, y, w, receiver, sender)
                        perm = torch.argsort(receiver * n + sender)
                        rs, ss = receiver[perm], sender[perm]
                        tperm = torch.argsort(ss * n + rs)
                        cd = oeq.TensorProductConv(prob, torch_op=True, deterministic=True)
                        impls["oeq_det"] = lambda cd=cd: cd.forward(x, y, w, rs, ss, tperm)
                    except Exception as exc:
                        r["oeq_fail"] = repr(exc)[:200]
                if "cueq" in found:
                    try:
                        sp, poly = cueq_channelwise(found, i1, i2, io, dtype)
                        wc = torch.randn(e, poly.inputs[0].size, device="cuda", dtype=dtype, requires_grad=True)
                        xc = torch.randn(n, poly.inputs[1].size, device="cuda", dtype=dtype, requires_grad=True)
                        oc = torch.empty(n, poly.outputs[0].size, device="cuda", dtype=dtype)
                        impls["cueq"] = lambda sp=sp, wc=wc, xc=xc, oc=oc: sp([wc, xc, y], {1: sender}, {0: oc},
                                                                             {0: receiver})[0]
                    except Exception as exc:
                        r["cueq_fail"] = repr(exc)[:200]
                for tag, fn in impls.items():
                    try:
                        out = fn()
                        g = torch.randn_like(out)
                        leaves = [t for t in (x, y, w) if t.requires_grad]
                        if tag == "cueq":
                            leaves = [xc, y, wc]  # noqa: F821 - defined when cueq ran
                        r[f"{tag}_fwd"] = cuda_time(fn, iters=10, warmup=3)
                        r[f"{tag}_fb"] = cuda_time(lambda fn=fn, g=g, leaves=leaves:
                                                   torch.autograd.grad(fn(), leaves, g), iters=10, warmup=3)
                        if double and tag != "e3nn":
                            r[f"{tag}_dbl"] = cuda_time(lambda fn=fn, g=g, leaves=leaves: double_backward(fn, g, leaves),
                                                        iters=5, warmup=2)
                        del out, g
                    except torch.OutOfMemoryError:
                        r[f"{tag}_fail"] = "out of memory"
                    except Exception as exc:
                        r[f"{tag}_fail"] = repr(exc)[:200]
                    torch.cuda.empty_cache()
                r["peak_GB"] = torch.cuda.max_memory_allocated() / 1e9
                torch.cuda.reset_peak_memory_stats()
                rows.append(r)
                print(r, flush=True)
                torch.cuda.empty_cache()
    env = environment()
    path = write_json("conv", {"env": env, "bandwidth_GBps": bandwidth / 1e9, "rows": rows})
    print(f"\n{env}\ncopy bandwidth {bandwidth / 1e9:.0f} GB/s; JSON: {path}")
    print(f"{'system':6s} {'problem':15s} {'dtype':7s} | {'det':>8s} {'atomic':>8s} {'e3nn':>8s} {'oeqA':>8s} "
          f"{'oeqD':>8s} {'cueq':>8s} {'floor':>8s} | {'det':>8s} {'atomic':>8s} {'oeqA':>8s} {'oeqD':>8s} "
          f"{'cueq':>8s} {'floor':>8s} | {'det':>8s} {'oeqA':>8s} {'oeqD':>8s} {'cueq':>8s}  (ms: fwd | fwd+bwd | dbl)")
    for r in rows:
        f = [fmt(r.get(f"{t}_fwd")) for t in ("det", "atomic", "e3nn", "oeq_atomic", "oeq_det", "cueq")]
        b = [fmt(r.get(f"{t}_fb")) for t in ("det", "atomic", "oeq_atomic", "oeq_det", "cueq")]
        d = [fmt(r.get(f"{t}_dbl")) for t in ("det", "oeq_atomic", "oeq_det", "cueq")]
        print(f"{r['system']:6s} {r['problem']:15s} {r['dtype']:7s} | {' '.join(f)} {fmt(r['floor_fwd'])} | "
              f"{' '.join(b)} {fmt(r['floor_fb'])} | {' '.join(d)}")


if __name__ == "__main__":
    main()
