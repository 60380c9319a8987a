"""Where NPT's extra time per engine step goes (one GPU): the eager kernels of an NVT (Langevin) and an NPT
(stochastic cell rescaling) step side by side, by kernel name, and ms per step of both captured.

    python benchmarks/profile_npt.py [--molecules 1728] [--skin 2.0]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from profile_engine import kernel_table, make  # noqa: E402

from cgforge.plugin.calculator import Calculator  # noqa: E402
from cgforge.plugin.engine import Engine  # noqa: E402
from cgforge.plugin.integrators import Langevin, StochasticCellRescaling  # noqa: E402


def kernels(calc, atoms, integrator) -> dict[str, tuple[float, int]]:
    rows, _ = kernel_table(calc, atoms, integrator=integrator)
    return {name: (ms, calls) for name, ms, calls in rows}


def captured_ms(calc, atoms, integrator, steps: int = 200) -> float:
    engine = Engine(calc, atoms.copy(), integrator, seed=1, max_temperature_K=float("inf"))
    engine.run(30)
    torch.cuda.synchronize()
    t = time.perf_counter()
    engine.run(steps)
    torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - t) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--molecules", type=int, default=1728)
    parser.add_argument("--skin", type=float, default=2.0)
    args = parser.parse_args()
    atoms = make("bundled-mace", args.molecules)
    nvt = Langevin(0.5, 300.0, 0.01)
    npt = StochasticCellRescaling(0.5, 300.0, 1e-4, tau_p_fs=1000.0)
    calc = Calculator("mace", device="cuda", dtype="float32", skin=args.skin)
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
