"""MACE model call and calculator call on a water box: cgforge-patched vs MACE with e3nn, with
cuEquivariance, OpenEquivariance and hybrid (cueq + OEQ) when importable, in one process, plus a
torch.profiler summary of the patched model call.

    python benchmarks/bench_mace.py [n_side=12] [float32|float64] [backends=e3nn,cgforge,cueq,oeq,hybrid]
                                    [shape=small|medium|large]
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import environment, write_json  # noqa: E402
from shapes import mace_mp_shape  # noqa: E402

from cgforge.patches import patch, save_patched  # noqa: E402
from cgforge.plugin.water import water_box  # noqa: E402


def median_seconds(fn, n: int) -> float:
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def main() -> None:
    n_side = int(sys.argv[1]) if len(sys.argv) > 1 else 12
    dname = sys.argv[2] if len(sys.argv) > 2 else "float32"
    backends = (sys.argv[3] if len(sys.argv) > 3 else "e3nn,cgforge,cueq,oeq,hybrid").split(",")
    shape = sys.argv[4] if len(sys.argv) > 4 else "medium"
    dtype = getattr(torch, dname)
    from mace.calculators import MACECalculator

    atoms = water_box(n_side=n_side)
    torch.manual_seed(0)
    tmp = tempfile.mkdtemp()
    plain = os.path.join(tmp, "mace.model")
    torch.save(mace_mp_shape(dtype, shape), plain)
    patched = os.path.join(tmp, "mace-cgforge.model")
    save_patched(patch(torch.load(plain, weights_only=False)), patched)
    rows, energies = {}, {}
    for backend in backends:
        try:
            kw = {"enable_cueq": backend in ("cueq", "hybrid"), "enable_oeq": backend in ("oeq", "hybrid")}
            path = patched if backend == "cgforge" else plain
            calc = MACECalculator(model_paths=path, device="cuda", default_dtype=dname, **kw)
            a = atoms.copy()
            a.calc = calc
            rng = np.random.default_rng(1)
            p0 = a.get_positions().copy()

            def step(a=a, p0=p0, rng=rng):
                a.set_positions(p0 + 0.01 * rng.normal(size=p0.shape))
                a.get_forces()

            for _ in range(3):
                step()
            r = {"calculator_s": median_seconds(step, 8)}
            model = calc.models[0]
            batch = calc._atoms_to_batch(a)
            data = calc._clone_batch(batch).to_dict()
            for stress in (True, False):
                r[f"model_{'stress' if stress else 'nostress'}_s"] = median_seconds(
                    lambda stress=stress: model(calc._clone_batch(batch).to_dict(), compute_stress=stress,
                                                training=False), 5)
            out = model(data, compute_stress=False, training=False)
            energies[backend] = float(out["energy"].sum())
            r["energy"] = energies[backend]
            r["peak_GB"] = torch.cuda.max_memory_allocated() / 1e9
            if backend == "cgforge":
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    model(calc._clone_batch(batch).to_dict(), compute_stress=False, training=False)
                    torch.cuda.synchronize()
                table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=12)
                r["profile"] = table
                print(table)
            rows[backend] = r
            calc = a = model = None  # free GPU memory before the next backend
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        except Exception as exc:
            rows[backend] = {"fail": repr(exc)[:300]}
        print(backend, {k: v for k, v in rows[backend].items() if k != "profile"}, flush=True)
    env = environment()
    path = write_json(f"mace-{shape}-{dname}", {"env": env, "atoms": len(atoms), "dtype": dname, "shape": shape,
                                                "rows": rows})
    print(f"\n{env}\nMACE-MP-{shape} shape, {len(atoms)} atoms, {dname}; JSON: {path}")
    print(f"{'backend':8s} {'calc step':>10s} {'model+stress':>13s} {'model':>8s} {'peak GB':>8s} {'energy':>14s}")
    for b, r in rows.items():
        if "fail" in r:
            print(f"{b:8s} FAIL {r['fail']}")
        else:
            print(f"{b:8s} {r['calculator_s']:10.4f} {r['model_stress_s']:13.4f} {r['model_nostress_s']:8.4f} "
                  f"{r['peak_GB']:8.2f} {r['energy']:14.6f}")


if __name__ == "__main__":
    main()
