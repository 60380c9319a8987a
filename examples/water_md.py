"""Water-box molecular dynamics with a MACE (or NequIP) model on cgforge's kernels.

    python examples/water_md.py                       # bundled MACE water model, NVT at 300 K
    python examples/water_md.py --model nequip --ensemble nve --steps 200
    python examples/water_md.py --ensemble npt --pressure 1000 --steps 2000 --log npt.log
    python examples/water_md.py --model my.model --molecules 512 --device cuda --dtype float32
    python examples/water_md.py --structure my.xyz --model my.nequip.zip
    python examples/water_md.py --restart water-md-....traj --steps 1000   # continue a run

GPU when present (a 1728-molecule, 5184-atom box), else CPU (a 32-molecule box that runs in seconds).
Prints progress (step, ps, ns/day, temperature, energy drift) and writes a trajectory to a new file.
``cgforge md`` takes the same arguments and returns the same exit codes (0 done, 1 error, 2 usage,
3 the run blew up, 130 Ctrl-C).
"""

from __future__ import annotations

import argparse
import sys
import time

from cgforge.cli import run_guarded
from cgforge.cli.md import add_md_arguments, model_banner, prepare_md, relax_structure
from cgforge.plugin.calculator import Calculator
from cgforge.plugin.md import run_md


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_md_arguments(parser)
    args = parser.parse_args(argv)

    # 1. Every flag and file checked first; the system: a periodic box of randomly oriented water molecules
    #    at 1 g/cm^3, a structure file, or the last frame of a trajectory (--restart). No model loaded yet.
    setup = prepare_md(args, stem="water-md")
    atoms = setup.atoms

    # 2. The calculator: loads and patches the model, compiles its kernels now (not in the first step).
    start = time.perf_counter()
    calc = Calculator(args.model, device=setup.device, dtype=args.dtype, skin=args.skin,
                      stress_with_forces=args.ensemble == "npt")  # NPT asks for the stress every step
    print(f"{len(atoms)} atoms; {model_banner(args.model, calc, time.perf_counter() - start)}", flush=True)

    # 3. A few FIRE steps first (a generated box is far from the model's equilibrium; --relax 0 skips them).
    if setup.relax:
        relax_structure(atoms, calc, setup.relax)

    # 4. MD: Langevin (or --thermostat csvr) NVT, velocity-Verlet NVE or NPT, progress every --log-interval
    #    steps; on a GPU cgforge's device engine runs the integrator next to the model (--engine ase: ASE's
    #    dynamics). The run stops with MDInstabilityError if it blows up, and Ctrl-C stops it after the
    #    current step; --plot draws the run at the end.
    summary = run_md(atoms, calc, log=[print, setup.log] if setup.log else print, **setup.run_md_kwargs)
    print(f"final temperature {summary.temperature_K:.1f} K, energy drift "
          f"{summary.energy_drift_meV_per_atom:+.3f} meV/atom, {calc.neighbours.n_builds} neighbour-list builds")
    return 0


if __name__ == "__main__":
    sys.exit(run_guarded(main, "water_md"))  # one-line errors and cgforge md's exit codes
