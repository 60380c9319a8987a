"""How far apart two correct relaxations of the same structure end at one force criterion (issue 64's 1e-4 eV/atom).

    python benchmarks/investigations/relax_endpoints.py [--structures 8] [--fmax 0.05] [--tight-fmax 0.005]
        [--steps 3000] [--device cpu] [--dtype float64]

bench_batch's rattled water structures (``structures(n, seed=1, rattle=0.05)``), the bundled MACE. Each structure is
relaxed three ways: cgforge's batched FIRE (``relax_batch``, ASE's FIRE step for step) to ``--fmax``, ASE's LBFGS over
the Calculator to ``--fmax``, and the batched FIRE to ``--tight-fmax``. Printed per structure: the energy per atom of
each, and the differences FIRE vs LBFGS at ``--fmax`` (two optimizers, one criterion: what the issue's TorchSim
comparison measures) and FIRE at ``--fmax`` vs ``--tight-fmax`` (how far the criterion itself leaves a structure
from its minimum). Writes JSON to $OUT (``common.write_json``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_batch import structures  # noqa: E402
from common import environment, write_json  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--structures", type=int, default=8)
    parser.add_argument("--fmax", type=float, default=0.05)
    parser.add_argument("--tight-fmax", type=float, default=0.005)
    parser.add_argument("--steps", type=int, default=3000, help="optimizer steps at most")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float64")
    args = parser.parse_args()
    if args.structures < 1 or args.steps < 1 or not 0 < args.tight_fmax < args.fmax:
        parser.error("expected --structures >= 1, --steps >= 1 and 0 < --tight-fmax < --fmax")
    from ase.optimize import LBFGS

    from cgforge.plugin import Calculator, relax_batch

    calc = Calculator("mace", device=args.device, dtype=args.dtype)
    systems = structures(args.structures, seed=1, rattle=0.05)

    def fire(fmax: float) -> dict[int, float]:
        done = relax_batch(calc, systems, fmax=fmax, steps=args.steps, batch_size=len(systems))
        return {d.index: d.energy / len(d.atoms) for d in done if d.status == "converged"}

    def lbfgs(i: int) -> float | None:
        atoms = systems[i].copy()
        atoms.calc = calc
        converged = LBFGS(atoms, logfile=None).run(fmax=args.fmax, steps=args.steps)
        return atoms.get_potential_energy() / len(atoms) if converged else None

    loose, tight = fire(args.fmax), fire(args.tight_fmax)
    rows = []
    print(f"{'structure':>9} {'atoms':>5} {'pbc':>5} {'FIRE eV/atom':>14} {'LBFGS - FIRE':>13} {'tight - FIRE':>13}")
    for i, atoms in enumerate(systems):
        other = lbfgs(i)
        row = {"index": i, "atoms": len(atoms), "pbc": bool(atoms.pbc.any()), "fire": loose.get(i),
               "lbfgs": other, "fire_tight": tight.get(i)}
        rows.append(row)
        diff = lambda a, b: "-" if a is None or b is None else f"{a - b:+.2e}"  # noqa: E731
        fire_e = "unconverged" if row["fire"] is None else f"{row['fire']:.6f}"
        print(f"{i:9d} {len(atoms):5d} {str(row['pbc']):>5} {fire_e:>14} {diff(other, row['fire']):>13} "
              f"{diff(row['fire_tight'], row['fire']):>13}", flush=True)
    summary = {}
    for name, key in (("lbfgs_vs_fire", "lbfgs"), ("tight_vs_fire", "fire_tight")):
        gaps = [abs(r[key] - r["fire"]) for r in rows if r[key] is not None and r["fire"] is not None]
        summary[name] = {"structures": len(gaps), "max": max(gaps, default=None),
                         "median": float(np.median(gaps)) if gaps else None, "within_1e-4": sum(g <= 1e-4 for g in gaps)}
        print(f"{name}: {summary[name]}")
    path = write_json("relax_endpoints", {"args": vars(args), "environment": environment(), "rows": rows,
                                          "summary": summary})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
