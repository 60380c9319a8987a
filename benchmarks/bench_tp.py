"""Tensor product alone: cgforge vs e3nn, cuEquivariance (mul_ir, ir_mul) and OpenEquivariance,
batch 50000, forward / forward+backward / double backward, in one process on one GPU.

    python benchmarks/bench_tp.py [problem ...]      (BATCH=50000 DTYPES=float32,float64)
"""

from __future__ import annotations

import os
import sys

import torch
from e3nn import o3

sys.path.insert(0, os.path.dirname(__file__))
from common import NP_DTYPE, copy_bandwidth, cuda_time, environment, fmt, peers, write_json  # noqa: E402

from cgforge.kernels import TensorProduct  # noqa: E402
from cgforge.kernels.problem_set import PROBLEMS  # noqa: E402


def passes(module, x, y, w, g):
    def fwd():
        return module(x, y, w)

    def fwd_bwd():
        torch.autograd.grad(module(x, y, w), (x, y, w), g)

    def double():
        gx, gy, gw = torch.autograd.grad(module(x, y, w), (x, y, w), g, create_graph=True)
        torch.autograd.grad((gx.square().sum() + gy.square().sum() + gw.square().sum()), (x, y, w))

    return {"fwd": fwd, "fb": fwd_bwd, "dbl": double}


def main() -> None:
    batch = int(os.environ.get("BATCH", "50000"))
    dtypes = [getattr(torch, d) for d in os.environ.get("DTYPES", "float32,float64").split(",")]
    names = sys.argv[1:] or list(PROBLEMS)
    found = peers()
    bandwidth = copy_bandwidth()
    rows = []
    for dtype in dtypes:
        for name in names:
            i1, i2, io, ins = PROBLEMS[name]
            e3 = o3.TensorProduct(i1, i2, io, ins, shared_weights=False, internal_weights=False).to("cuda", dtype)
            ours = TensorProduct.from_e3nn(e3)
            x = torch.randn(batch, i1.dim, device="cuda", dtype=dtype, requires_grad=True)
            y = torch.randn(batch, i2.dim, device="cuda", dtype=dtype, requires_grad=True)
            w = torch.randn(batch, e3.weight_numel, device="cuda", dtype=dtype, requires_grad=True)
            ref = e3(x, y, w)
            g = torch.randn_like(ref)
            r = {"problem": name, "dtype": str(dtype).split(".")[-1], "batch": batch}
            r["err"] = float((ours(x, y, w) - ref).norm() / ref.norm())
            nbytes = (x.numel() + y.numel() + w.numel() + ref.numel()) * x.element_size()
            r["floor_fwd"] = nbytes / bandwidth * 1e3
            impls = {"cgforge": ours, "e3nn": e3}
            is_uvu = all(i[3] == "uvu" for i in ins)
            if "oeq" in found:
                try:
                    oeq = found["oeq"]
                    prob = oeq.TPProblem(i1, i2, io, ins, shared_weights=False, internal_weights=False,
                                         irrep_dtype=NP_DTYPE[dtype], weight_dtype=NP_DTYPE[dtype])
                    impls["oeq"] = oeq.TensorProduct(prob, torch_op=True)
                except Exception as exc:
                    r["oeq_fail"] = repr(exc)[:200]
            if "cueq" in found and is_uvu:
                cue, cuet = found["cueq"]
                for tag, layout in (("cueq", cue.mul_ir), ("cueq_ir", cue.ir_mul)):
                    try:
                        m = cuet.ChannelWiseTensorProduct(
                            cue.Irreps("O3", str(i1)), cue.Irreps("O3", str(i2)),
                            filter_irreps_out=cue.Irreps("O3", str(io)), layout=layout, shared_weights=False,
                            internal_weights=False, device="cuda", dtype=dtype)
                        wc = torch.randn(batch, m.weight_numel, device="cuda", dtype=dtype, requires_grad=True)
                        gc = torch.randn_like(m(x, y, wc))
                        impls[tag] = (m, wc, gc)
                    except Exception as exc:
                        r[f"{tag}_fail"] = repr(exc)[:200]
            for tag, impl in impls.items():
                m, wi, gi = impl if isinstance(impl, tuple) else (impl, w, g)
                for pas, fn in passes(m, x, y, wi, gi).items():
                    if tag == "e3nn" and pas == "dbl" and name.startswith(("mace-large", "nequip-benzene")):
                        continue  # e3nn's double backward of the largest problems takes minutes
                    try:
                        r[f"{tag}_{pas}"] = cuda_time(fn, iters=10, warmup=3)
                    except Exception as exc:
                        r[f"{tag}_{pas}_fail"] = repr(exc)[:200]
                        torch.cuda.empty_cache()
            rows.append(r)
            print(r, flush=True)
            torch.cuda.empty_cache()
    env = environment()
    path = write_json("tp", {"env": env, "bandwidth_GBps": bandwidth / 1e9, "rows": rows})
    print(f"\n{env}\ncopy bandwidth {bandwidth / 1e9:.0f} GB/s; JSON: {path}")
    print(f"{'problem':16s} {'dtype':7s} | {'ours':>8s} {'e3nn':>8s} {'cueq':>8s} {'cueq_ir':>8s} {'oeq':>8s} "
          f"{'floor':>8s} | {'ours':>8s} {'cueq_ir':>8s} {'oeq':>8s} | {'ours':>8s} {'oeq':>8s}   (ms: fwd | f+b | dbl)")
    for r in rows:
        print(f"{r['problem']:16s} {r['dtype']:7s} | {fmt(r.get('cgforge_fwd'))} {fmt(r.get('e3nn_fwd'))} "
              f"{fmt(r.get('cueq_fwd'))} {fmt(r.get('cueq_ir_fwd'))} {fmt(r.get('oeq_fwd'))} {fmt(r['floor_fwd'])} | "
              f"{fmt(r.get('cgforge_fb'))} {fmt(r.get('cueq_ir_fb'))} {fmt(r.get('oeq_fb'))} | "
              f"{fmt(r.get('cgforge_dbl'))} {fmt(r.get('oeq_dbl'))}")


if __name__ == "__main__":
    main()
