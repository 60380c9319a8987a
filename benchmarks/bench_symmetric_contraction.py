"""MACE's product basis (symmetric contraction) alone: cgforge vs MACE's e3nn module, cuEquivariance's
SymmetricContraction (through MACE's own wrapper) and OpenEquivariance's (if importable), in one process.

MACE-MP shapes: node features 128x(0e+1o+2e+3o) (max_ell 3), correlation 3, 89 species, outputs
128x(0e+1o) (medium) and 128x(0e+1o+2e) (large); nodes are water-like (O, H, H, ...). forward, and
forward+backward as an MD step needs it (grad x only, weights frozen).

    python benchmarks/bench_symmetric_contraction.py [--nodes 5184,23558] [--shapes medium,large]
        [--dtypes float32,float64] [--peers e3nn,cueq,cueq_reduced,oeq] [--iters 30]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from e3nn import o3

sys.path.insert(0, os.path.dirname(__file__))
from common import RESULTS, copy_bandwidth, cuda_time, environment, write_json  # noqa: E402

from cgforge.patches.mace import SymmetricContraction  # noqa: E402

HIDDEN = "0e+1o+2e+3o"
OUTPUTS = {"small": "0e", "medium": "0e+1o", "large": "0e+1o+2e"}
CHANNELS, SPECIES, CORRELATION = 128, 89, 3
H, O = 0, 7  # MACE-MP's element table starts at Z = 1


def irreps(irs: str) -> o3.Irreps:
    return o3.Irreps("+".join(f"{CHANNELS}x{ir}" for ir in irs.split("+")))


class default_dtype:
    def __init__(self, dtype):
        self.dtype = dtype

    def __enter__(self):
        self.previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)

    def __exit__(self, *exc):
        torch.set_default_dtype(self.previous)


def frozen(module: torch.nn.Module) -> torch.nn.Module:
    for p in module.parameters():
        p.requires_grad_(False)
    return module


def build_peers(shape: str, dtype: torch.dtype, wanted: list[str]) -> dict:
    """name -> (module, input layout); each built in `dtype` on the GPU."""
    from mace.modules.symmetric_contraction import SymmetricContraction as MaceSC

    built = {}
    with default_dtype(dtype):
        torch.manual_seed(0)
        mace = MaceSC(irreps(HIDDEN), irreps(OUTPUTS[shape]), correlation=CORRELATION, num_elements=SPECIES)
        built["cgforge"] = (frozen(SymmetricContraction.from_mace(mace).cuda()), "index")
        if "e3nn" in wanted:
            built["e3nn"] = (frozen(mace.cuda()), "one_hot")
        for name, reduced in (("cueq", False), ("cueq_reduced", True)):
            if name not in wanted:
                continue
            try:
                from mace.modules.wrapper_ops import CuEquivarianceConfig, SymmetricContractionWrapper

                cfg = CuEquivarianceConfig(enabled=True, layout="mul_ir", group="O3_e3nn", optimize_all=True)
                if not cfg.enabled:
                    raise ImportError("cuequivariance is not importable")
                module = SymmetricContractionWrapper(irreps(HIDDEN), irreps(OUTPUTS[shape]), CORRELATION,
                                                     num_elements=SPECIES, cueq_config=cfg, use_reduced_cg=reduced)
                built[name] = (frozen(module.cuda()), "ir_mul")
            except Exception as exc:  # peers are optional: report, do not fail
                print(f"{name}: not available ({repr(exc)[:200]})")
        if "oeq" in wanted:
            try:
                from openequivariance._torch.symmetric_contraction import SymmetricContraction as OeqSC

                module = OeqSC(irreps(HIDDEN), irreps(OUTPUTS[shape]), CORRELATION, num_elements=SPECIES,
                               dtype=dtype)
                built["oeq"] = (frozen(module.cuda()), "one_hot")
            except Exception as exc:
                print(f"oeq: not available ({repr(exc)[:200]})")
    return built


def inputs(n: int, dtype: torch.dtype) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(n)
    x = torch.randn(n, CHANNELS, 16, device="cuda", dtype=dtype, generator=gen)
    species = torch.full((n,), H, dtype=torch.int32, device="cuda")
    species[::3] = O
    return {"x": x, "index": species, "one_hot": torch.nn.functional.one_hot(species.long(), SPECIES).to(dtype),
            "ir_mul": x.transpose(1, 2).contiguous().flatten(1)}


def calls(module, layout: str, data: dict, grad_out: torch.Tensor):
    x = data["ir_mul" if layout == "ir_mul" else "x"]
    species = data["index" if layout in ("index", "ir_mul") else "one_hot"]
    xg = x.detach().clone().requires_grad_(True)

    def fwd():
        return module(x, species)

    def fwd_bwd():
        torch.autograd.grad(module(xg, species), xg, grad_out)

    return fwd, fwd_bwd


def graph_time(fn, iters: int) -> float:
    """Median ms of replays of a CUDA graph holding one fn() call: the GPU's time without launch overhead."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return cuda_time(graph.replay, iters=iters, warmup=3)


def floors(module: SymmetricContraction, n: int, dtype: torch.dtype, bandwidth: float) -> dict:
    """Milliseconds to move the bytes (read x, write out; backward: read x and grad, write grad x)."""
    size = torch.empty((), dtype=dtype).element_size()
    p = module.problem
    x_bytes, out_bytes = n * p.channels * p.in_dim * size, n * p.out_dim * size
    fwd = (x_bytes + out_bytes) / bandwidth * 1e3
    bwd = (2 * x_bytes + out_bytes) / bandwidth * 1e3
    flops = 2 * n * p.channels * module.schedule.forward_cost()["total"]
    return {"floor_fwd": fwd, "floor_fb": fwd + bwd, "gflop_fwd": flops / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", default="5184,23558")
    ap.add_argument("--shapes", default="medium,large")
    ap.add_argument("--dtypes", default="float32,float64")
    ap.add_argument("--peers", default="e3nn,cueq,cueq_reduced,oeq")
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()
    wanted = args.peers.split(",") if args.peers else []
    if "oeq" not in wanted:
        # importing OpenEquivariance JIT-builds its extension (minutes on a fresh machine), and both mace and
        # environment() import it when they can: make it unimportable unless it is measured
        sys.modules.setdefault("openequivariance", None)
    env = environment()
    print(env)
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    rows, names, graphable = [], ["cgforge"], []
    for dtype in [getattr(torch, d) for d in args.dtypes.split(",")]:
        for shape in args.shapes.split(","):
            t0 = time.time()
            built = build_peers(shape, dtype, wanted)
            names += [k for k in built if k not in names]
            torch.cuda.synchronize()
            print(f"built {shape} {dtype}: {sorted(built)} in {time.time() - t0:.1f} s")
            ours = built["cgforge"][0]
            for n in [int(v) for v in args.nodes.split(",")]:
                data = inputs(n, dtype)
                r = {"shape": shape, "dtype": str(dtype).split(".")[-1], "nodes": n,
                     **floors(ours, n, dtype, bandwidth)}
                ref = ours(data["x"], data["index"])
                grad_out = torch.randn_like(ref)
                for name, (module, layout) in built.items():
                    fwd, fwd_bwd = calls(module, layout, data, grad_out)
                    try:
                        out = fwd()
                        if name == "e3nn":  # same weights: the check of our numbers on the GPU
                            r["err_vs_e3nn"] = float((ref - out).norm() / out.norm())
                        # e3nn is 100x slower: a few calls measure it well enough
                        iters, warmup = (args.iters, 3) if name != "e3nn" else (3, 1)
                        r[f"{name}_fwd"] = cuda_time(fwd, iters=iters, warmup=warmup)
                        r[f"{name}_fb"] = cuda_time(fwd_bwd, iters=iters, warmup=warmup)
                        if name in ("cgforge", "cueq", "cueq_reduced"):  # OEQ syncs (bincount on the host)
                            graphable.append((r, name, fwd, fwd_bwd))
                    except torch.OutOfMemoryError:
                        r[f"{name}_fwd"] = r.get(f"{name}_fwd", "OOM")
                        r[f"{name}_fb"] = "OOM"
                    except Exception as exc:
                        print(f"{name} failed on {shape} {dtype} {n}: {repr(exc)[:300]}")
                    finally:
                        torch.cuda.empty_cache()
                print(r)
                rows.append(r)
            del built
            partial = Path(os.environ.get("OUT", RESULTS)) / "symmetric-contraction-partial.json"
            partial.parent.mkdir(parents=True, exist_ok=True)
            partial.write_text(json.dumps({"env": env, "rows": rows}, indent=1))  # kept if the run is cut
    # CUDA-graph replays last, ours first: a peer whose capture fails cannot spoil the eager numbers
    graphable.sort(key=lambda item: item[1] != "cgforge")
    for r, name, fwd, fwd_bwd in graphable:
        try:
            r[f"{name}_fwd_graph"] = graph_time(fwd, args.iters)
            r[f"{name}_fb_graph"] = graph_time(fwd_bwd, args.iters)
        except Exception as exc:
            print(f"{name}: no CUDA graph on {r['shape']} {r['dtype']} {r['nodes']} ({repr(exc)[:160]})")
            torch.cuda.synchronize()
    del graphable
    path = write_json("symmetric-contraction", {"env": env, "bandwidth": bandwidth, "rows": rows})
    print(f"JSON: {path}")
    print(f"device: {env.get('device')}; ms, medians of CUDA-event timings; fb = forward + backward (grad x)")
    head = f"{'shape':7s} {'dtype':7s} {'nodes':>6s} {'floor':>7s} |" + "".join(f" {n[:12]:>12s}" for n in names)
    for mode in ("fwd", "fb", "fwd_graph", "fb_graph"):
        print(f"\n{mode}" + ("  (CUDA graph replays: GPU time without launch overhead)" if "graph" in mode else ""))
        print(head)
        for r in rows:
            cells = "".join(f" {_fmt(r.get(f'{n}_{mode}')):>12s}" for n in names)
            floor = r[f"floor_{mode.split('_')[0]}"]
            print(f"{r['shape']:7s} {r['dtype']:7s} {r['nodes']:6d} {floor:7.3f} |{cells}")


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3f}"
    return "n/a" if v is None else str(v)


if __name__ == "__main__":
    main()
