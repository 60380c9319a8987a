"""FastMACE 1.0 as a peer in bench_md.py: one MD run in this process (FastMACE patches MACE's modules when it is
imported, so it never shares a process with cgforge), one JSON line on stdout.

    python benchmarks/fastmace_md.py MODEL.model ATOMS.traj --ensemble nvt --steps 200 --warmup 20

Public API only (``fm.load``, ``fm.Simulation``, ``fm.integrators``, ``fm.Workload``), read from the wheel's
docstrings. NVT: ``fm.integrators.Langevin`` (ASE's Langevin); NPT: ``fm.integrators.LangevinBAOAB``
(hydrostatic). FastMACE plans its own backend (on torch 2.11 with cuEquivariance 0.13: plain cuEquivariance; its
OEq hybrid needs a torch 2.14 extension). Setup (load, plan, build, capture) is timed apart from the steps.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("atoms")
    parser.add_argument("--ensemble", choices=("nvt", "npt"), default="nvt")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--timestep", type=float, default=0.5)
    parser.add_argument("--temperature", type=float, default=300.0)
    parser.add_argument("--friction", type=float, default=0.01, help="1/fs")
    args = parser.parse_args()
    row: dict = {"backend": "fastmace", "ensemble": args.ensemble}
    try:
        import fastmace as fm
        import torch
        from ase.io import read

        row["fastmace"] = fm.__version__
        atoms = read(args.atoms)
        start = time.perf_counter()
        model = fm.load(args.model, trusted=True)
        if args.ensemble == "nvt":
            integrator = fm.integrators.Langevin(timestep_fs=args.timestep, temperature_K=args.temperature,
                                                 friction_per_fs=args.friction)
        else:
            integrator = fm.integrators.LangevinBAOAB(timestep_fs=args.timestep, temperature_K=args.temperature,
                                                      friction_per_fs=args.friction, pressure_GPa=1e-4,
                                                      cell_mode="hydrostatic")
        sim = fm.Simulation(atoms, model, integrator=integrator, seed=1,
                            workload=fm.Workload(max_temperature_K=2 * args.temperature))
        sim.run(args.warmup)
        torch.cuda.synchronize()
        row["setup_s"] = time.perf_counter() - start
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        sim.run(args.steps)
        torch.cuda.synchronize()
        row["s_per_step"] = (time.perf_counter() - start) / args.steps
        row["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
        try:
            row["plan"] = str(getattr(sim.plan, "engine", ""))[:200]
        except Exception:  # noqa: BLE001 - the plan's text is informative only
            pass
    except Exception as err:  # noqa: BLE001 - report any failure as the row's error
        row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
    print(json.dumps(row), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
