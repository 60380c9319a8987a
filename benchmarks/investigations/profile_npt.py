"""Where NPT's extra time per engine step goes (one GPU): the eager kernels of an NVT (Langevin) and an NPT
(stochastic cell rescaling) step side by side, by kernel name, and ms per step of both captured.

    python3 benchmarks/investigations/profile_npt.py [--molecules 1728] [--skin 2.0] [--compile]

--compile: the calculator's model compiled (``Calculator(compile=True)``), which also fuses the engine's
integrator arithmetic (``Engine(fuse_integrator=None)``); the eager kernel table is then that of the compiled step.
The captured times include NVT with the CSVR thermostat (NPT's thermostat) to tell thermostat from barostat.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
from profile_engine import kernel_table, make  # noqa: E402

from cgforge.plugin.calculator import Calculator  # noqa: E402
from cgforge.plugin.md.engine import Engine  # noqa: E402
from cgforge.plugin.md.integrators import CSVR, Langevin, StochasticCellRescaling  # noqa: E402


def kernels(calc, atoms, integrator) -> dict[str, tuple[float, int]]:
    rows, _ = kernel_table(calc, atoms, integrator=integrator)
    return {name: (ms, calls) for name, ms, calls in rows}


def captured_ms(calc, atoms, integrator, steps: int = 200, fuse: bool | None = None) -> float:
    engine = Engine(calc, atoms.copy(), integrator, seed=1, max_temperature_K=float("inf"), fuse_integrator=fuse)
    engine.run(30)
    torch.cuda.synchronize()
    captures, t = engine.stats["captures"], time.perf_counter()
    engine.run(steps)
    torch.cuda.synchronize()
    ms = 1000 * (time.perf_counter() - t) / steps
    print(f"  {integrator.name}: {ms:.3f} ms/step captured, {engine.stats['captures'] - captures} captures in the "
          f"timed steps, fused integrator {engine.fuse_integrator}", flush=True)
    return ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--molecules", type=int, default=1728)
    parser.add_argument("--skin", type=float, default=2.0)
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()
    atoms = make("bundled-mace", args.molecules)
    nvt = Langevin(0.5, 300.0, 0.01)
    npt = StochasticCellRescaling(0.5, 300.0, 1e-4, tau_p_fs=1000.0)
    calc = Calculator("mace", device="cuda", dtype="float32", skin=args.skin, compile=args.compile)
    if args.compile:  # the same run with the integrator's arithmetic unfused, for an A/B
        for integ in (Langevin(0.5, 300.0, 0.01), CSVR(0.5, 300.0), StochasticCellRescaling(0.5, 300.0, 1e-4)):
            captured_ms(calc, atoms, integ, fuse=False)
    captured_ms(calc, atoms, CSVR(0.5, 300.0))
    ms = {name: captured_ms(calc, atoms, integ) for name, integ in (("nvt", nvt), ("npt", npt))}
    tables = {name: kernels(calc, atoms, integ) for name, integ in (("nvt", nvt), ("npt", npt))}
    names = set(tables["nvt"]) | set(tables["npt"])
    rows = sorted(names, key=lambda n: -(tables["npt"].get(n, (0, 0))[0] - tables["nvt"].get(n, (0, 0))[0]))
    total = {k: sum(v[0] for v in t.values()) for k, t in tables.items()}
    print(f"captured ms/step: NVT {ms['nvt']:.3f}, NPT {ms['npt']:.3f}; eager kernel ms/step: NVT {total['nvt']:.3f}, "
          f"NPT {total['npt']:.3f}; kernels/step NVT {sum(v[1] for v in tables['nvt'].values())}, "
          f"NPT {sum(v[1] for v in tables['npt'].values())}")
    print("  NPT-NVT ms   NVT ms  NPT ms  calls NVT/NPT  kernel")
    for n in rows[:25]:
        a, b = tables["nvt"].get(n, (0.0, 0)), tables["npt"].get(n, (0.0, 0))
        print(f"  {b[0] - a[0]:9.3f} {a[0]:8.3f} {b[0]:7.3f} {a[1]:6d}/{b[1]:<6d}  {n[:100]}")


if __name__ == "__main__":
    main()
