"""NequIP on a water box: model call and calculator step, cgforge vs NequIP with e3nn, with the
OpenEquivariance modifier and with the cuEquivariance modifier, in one process (issue 6).

Every backend runs through nequip's own NequIPCalculator (matscipy neighbour list), as in
../shared/anchors.md; the cgforge Calculator (GPU neighbour list, no stress unless asked) is
timed as one more row when it is importable.

    python benchmarks/bench_nequip.py [n_side=12] [config=l1|M] [backends=e3nn,cgforge,oeq,cueq,cgforge-calc]
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import environment, write_json  # noqa: E402
from shapes import nequip_shape  # noqa: E402

from cgforge.plugin.water import water_box  # noqa: E402

MODIFIERS = {"oeq": "enable_OpenEquivariance", "cueq": "enable_CuEquivariance"}


def median_seconds(fn, n: int) -> float:
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def nequip_calculator(model: torch.nn.Module):
    from nequip.data.transforms import ChemicalSpeciesToAtomTypeMapper, NeighborListTransform
    from nequip.integrations.ase import NequIPCalculator

    return NequIPCalculator(model, device="cuda", transforms=[
        ChemicalSpeciesToAtomTypeMapper(model_type_names=["H", "O"],
                                        chemical_species_to_atom_type_map={"H": "H", "O": "O"}),
        NeighborListTransform(r_max=5.0)])


def run_backend(backend: str, config: str, atoms) -> dict:
    from nequip.data import AtomicDataDict
    from nequip.model.modify_utils import modify

    from cgforge.patches import nequip as cgforge_nequip

    model = nequip_shape(config)
    if backend.startswith("cgforge"):
        # what the enable_cgforge modifier does (the direct call: on the GPU machine cgforge is on
        # PYTHONPATH, not installed, so nequip's entry-point lookup does not see it)
        model = cgforge_nequip.patch(model)
    elif backend in MODIFIERS:
        model = modify(model, [{"modifier": MODIFIERS[backend]}])
    if backend == "cgforge-calc":
        from cgforge.plugin import Calculator

        calc = Calculator(model, device="cuda")
    else:
        calc = nequip_calculator(model.to("cuda").eval())
    a = atoms.copy()
    a.calc = calc
    rng = np.random.default_rng(1)
    p0 = a.get_positions().copy()

    def step() -> None:  # what an MD step asks of the calculator: new positions, forces
        a.set_positions(p0 + 0.01 * rng.normal(size=p0.shape))
        a.get_forces()

    for _ in range(3):
        step()
    r = {"calculator_s": median_seconds(step, 10)}
    if backend != "cgforge-calc":
        data = calc.atoms_to_data(a)
        r["model_s"] = median_seconds(lambda: calc.call_model(dict(data)), 10)
        r["energy"] = float(calc.call_model(dict(data))[AtomicDataDict.TOTAL_ENERGY_KEY].sum())
    a.set_positions(p0)
    r["energy_p0"] = float(a.get_potential_energy())
    r["peak_GB"] = torch.cuda.max_memory_allocated() / 1e9
    return r


def main() -> None:
    n_side = int(sys.argv[1]) if len(sys.argv) > 1 else 12
    config = sys.argv[2] if len(sys.argv) > 2 else "l1"
    backends = (sys.argv[3] if len(sys.argv) > 3 else "e3nn,cgforge,oeq,cueq,cgforge-calc").split(",")
    atoms = water_box(n_side=n_side)
    rows = {}
    for backend in backends:
        try:
            rows[backend] = run_backend(backend, config, atoms)
        except Exception as exc:
            rows[backend] = {"fail": repr(exc)[:300]}
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        print(backend, rows[backend], flush=True)
    env = environment()
    path = write_json(f"nequip-{config}", {"env": env, "atoms": len(atoms), "config": config, "rows": rows})
    print(f"\n{env}\nNequIP {config}, {len(atoms)} atoms water, float32, r_max 5; JSON: {path}")
    print(f"{'backend':13s} {'calc step s':>12s} {'model s':>9s} {'peak GB':>8s} {'energy':>14s}")
    for b, r in rows.items():
        if "fail" in r:
            print(f"{b:13s} FAIL {r['fail']}")
        else:
            model_s = f"{r['model_s']:9.4f}" if "model_s" in r else f"{'-':>9s}"
            print(f"{b:13s} {r['calculator_s']:12.4f} {model_s} {r['peak_GB']:8.2f} {r['energy_p0']:14.6f}")


if __name__ == "__main__":
    main()
