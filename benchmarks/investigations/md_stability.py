"""Long NVT run of a water model on a water box, then checks that the water is still water.

    python3 benchmarks/investigations/md_stability.py --model mace --molecules 1728 --ps 10

Runs Langevin NVT at 300 K (0.5 fs) with cgforge's Calculator and reports, every --report-ps, the
temperature and three structural checks on the current frame: the shortest interatomic distance, the
largest O-H distance from each H to its nearest O (a broken molecule shows as > 1.3 Å) and the number of
molecules whose H-O-H angle left 80-130 degrees. Stable means: finite energies, temperature within
250-350 K after the first picosecond, every H within 1.3 Å of an O, no two atoms closer than 0.75 Å.
Prints a table and writes JSON (benchmarks/results/ or $OUT).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
from ase import Atoms
from ase.neighborlist import neighbor_list

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
from common import environment, write_json

from cgforge.plugin import Calculator, run_md
from cgforge.plugin.water import water_box


def water_checks(atoms: Atoms, cutoff: float = 1.6) -> dict[str, float]:
    """Shortest distance, worst H-to-nearest-O distance and count of bent or broken molecules.

    From a neighbour list within ``cutoff`` (linear in the number of atoms): an H with no O inside the
    cutoff counts as ``max_oh = inf``; pairs closer than 0.75 Å are what the check is for, so the shortest
    distance is always inside it.
    """
    i, j, d, vec = neighbor_list("ijdD", atoms, cutoff)
    min_distance = float(d.min()) if len(d) else cutoff
    symbols = np.array(atoms.get_chemical_symbols())
    oxygens, hydrogens = np.flatnonzero(symbols == "O"), np.flatnonzero(symbols == "H")
    h_o = (symbols[i] == "H") & (symbols[j] == "O")
    i, j, d, vec = i[h_o], j[h_o], d[h_o], vec[h_o]
    order = np.lexsort((d, i))  # by H, then by distance: the first row of each H is its nearest O
    i, j, d, vec = i[order], j[order], d[order], vec[order]
    first = np.flatnonzero(np.r_[True, i[1:] != i[:-1]]) if len(i) else np.zeros(0, int)
    max_oh = float(d[first].max()) if len(first) == len(hydrogens) else float("inf")
    nearest_o, o_to_h = j[first], -vec[first]  # vec points from the H to its O
    bad = 0
    for o in oxygens:
        bonds = o_to_h[nearest_o == o]
        if len(bonds) != 2:
            bad += 1
            continue
        cosine = bonds[0] @ bonds[1] / (np.linalg.norm(bonds[0]) * np.linalg.norm(bonds[1]))
        bad += not 80.0 <= np.degrees(np.arccos(np.clip(cosine, -1.0, 1.0))) <= 130.0
    return {"min_distance": min_distance, "max_oh": max_oh, "bad_molecules": int(bad)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mace", help="mace, nequip (bundled) or a model file")
    parser.add_argument("--molecules", type=int, default=1728)
    parser.add_argument("--ps", type=float, default=10.0)
    parser.add_argument("--report-ps", type=float, default=1.0)
    parser.add_argument("--timestep", type=float, default=0.5)
    parser.add_argument("--device", default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    atoms = water_box(args.molecules, seed=args.seed)
    calc = Calculator(args.model, device=args.device)
    chunk = max(1, round(args.report_ps * 1000 / args.timestep))
    reports, start = [], time.perf_counter()
    for block in range(max(1, round(args.ps / args.report_ps))):
        summary = run_md(atoms, calc, ensemble="nvt", temperature_K=300.0, timestep_fs=args.timestep,
                         steps=chunk, seed=args.seed + block, init_velocities=block == 0, log=None)
        energy = float(atoms.get_potential_energy())
        reports.append({"ps": (block + 1) * args.report_ps, "temperature_K": float(summary.temperature_K),
                        "energy_eV": energy, "ns_per_day": float(summary.ns_per_day), **water_checks(atoms)})
    wall = time.perf_counter() - start
    late = [r for r in reports if r["ps"] > 1.0] or reports
    stable = (all(np.isfinite(r["energy_eV"]) for r in reports)
              and all(250.0 <= r["temperature_K"] <= 350.0 for r in late)
              and all(r["max_oh"] < 1.3 and r["min_distance"] > 0.75 for r in reports))

    print(f"{args.model}: {len(atoms)} atoms, {args.ps:g} ps NVT at 300 K, {args.timestep:g} fs, "
          f"{calc.device} {calc.dtype}, {wall:.0f} s wall")
    print(f"{'ps':>6} {'T[K]':>7} {'E[eV]':>12} {'min d':>6} {'max OH':>7} {'bent':>5} {'ns/day':>7}")
    for r in reports:
        print(f"{r['ps']:6.2f} {r['temperature_K']:7.1f} {r['energy_eV']:12.3f} {r['min_distance']:6.3f} "
              f"{r['max_oh']:7.3f} {r['bad_molecules']:5d} {r['ns_per_day']:7.2f}")
    print(f"stable: {stable}")
    write_json("md-stability", {"environment": environment(), "args": vars(args), "stable": stable,
                               "wall_s": wall, "reports": reports})


if __name__ == "__main__":
    main()
