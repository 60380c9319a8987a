"""How far apart two correct relaxations of the same structure end at one force criterion (issue 64's 1e-4 eV/atom).

    python benchmarks/investigations/relax_endpoints.py [--structures 8] [--fmax 0.05] [--tight-fmax 0.005]
        [--steps 3000] [--device cpu] [--dtype float64] [--compare lbfgs,tight | --compare ase-fire,alpha-first]

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


def alpha_first_fire(atoms, **kwargs):
    """ASE's FIRE on ``atoms`` with alpha decayed before the mixing it weighs (TorchSim's order, see the module doc)."""
    from ase.optimize import FIRE

    class AlphaFirst(FIRE):
        def step(self, f=None):
            # ASE mixes with alpha, then decays it when the power is positive past Nmin steps: decay it first here
            # (so the mixing uses the decayed value) and undo ASE's own decay after.
            early = (self.vel is not None and self.Nsteps > self.Nmin
                     and np.vdot(atoms.get_forces().ravel(), np.ravel(self.vel)) > 0.0)
            if early:
                self.a *= self.fa
            super().step(f)
            if early:
                self.a /= self.fa

    return AlphaFirst(atoms, **kwargs)


COMPARE = {"lbfgs": "LBFGS", "tight": "FIRE at --tight-fmax", "ase-fire": "ASE's FIRE",
           "alpha-first": "FIRE, alpha decayed first"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--structures", type=int, default=8)
    parser.add_argument("--fmax", type=float, default=0.05)
    parser.add_argument("--tight-fmax", type=float, default=0.005)
    parser.add_argument("--steps", type=int, default=3000, help="optimizer steps at most")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float64")
    parser.add_argument("--compare", default="lbfgs,tight", help=f"relaxations set beside the batched FIRE, of "
                        f"{', '.join(COMPARE)}")
    args = parser.parse_args()
    if args.structures < 1 or args.steps < 1 or not 0 < args.tight_fmax < args.fmax:
        parser.error("expected --structures >= 1, --steps >= 1 and 0 < --tight-fmax < --fmax")
    compare = args.compare.split(",")
    unknown = [c for c in compare if c not in COMPARE]
    if unknown:
        parser.error(f"--compare: unknown {unknown}; choose from {', '.join(COMPARE)}")
    from ase.optimize import FIRE, LBFGS

    from cgforge.plugin import Calculator, relax_batch

    calc = Calculator("mace", device=args.device, dtype=args.dtype)
    systems = structures(args.structures, seed=1, rattle=0.05)

    def fire(fmax: float) -> dict[int, float]:
        done = relax_batch(calc, systems, fmax=fmax, steps=args.steps, batch_size=len(systems))
        return {d.index: d.energy / len(d.atoms) for d in done if d.status == "converged"}

    def loop(i: int, optimizer) -> float | None:
        atoms = systems[i].copy()
        atoms.calc = calc
        converged = optimizer(atoms, logfile=None).run(fmax=args.fmax, steps=args.steps)
        return atoms.get_potential_energy() / len(atoms) if converged else None

    loose = fire(args.fmax)
    others = {"tight": fire(args.tight_fmax)} if "tight" in compare else {}
    loops = {"lbfgs": LBFGS, "ase-fire": FIRE, "alpha-first": alpha_first_fire}
    rows = []
    print(f"{'structure':>9} {'atoms':>5} {'pbc':>5} {'FIRE eV/atom':>14} "
          + " ".join(f"{c + ' - FIRE':>20}" for c in compare))
    for i, atoms in enumerate(systems):
        row = {"index": i, "atoms": len(atoms), "pbc": bool(atoms.pbc.any()), "fire": loose.get(i)}
        for c in compare:
            row[c] = others[c].get(i) if c in others else loop(i, loops[c])
        rows.append(row)
        diff = lambda a, b: "-" if a is None or b is None else f"{a - b:+.2e}"  # noqa: E731
        fire_e = "unconverged" if row["fire"] is None else f"{row['fire']:.6f}"
        print(f"{i:9d} {len(atoms):5d} {str(row['pbc']):>5} {fire_e:>14} "
              + " ".join(f"{diff(row[c], row['fire']):>20}" for c in compare), flush=True)
    summary = {}
    for key in compare:
        gaps = [abs(r[key] - r["fire"]) for r in rows if r[key] is not None and r["fire"] is not None]
        summary[f"{key}_vs_fire"] = {"what": COMPARE[key], "structures": len(gaps), "max": max(gaps, default=None),
                                     "median": float(np.median(gaps)) if gaps else None,
                                     "within_1e-4": sum(g <= 1e-4 for g in gaps)}
        print(f"{key} vs FIRE: {summary[f'{key}_vs_fire']}")
    path = write_json("relax_endpoints", {"args": vars(args), "environment": environment(), "rows": rows,
                                          "summary": summary})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
