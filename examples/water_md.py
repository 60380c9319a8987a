"""Water-box molecular dynamics with a MACE or NequIP model (cgforge's kernels on a GPU, its own code on a CPU).

    python examples/water_md.py                       # bundled MACE water model, NVT at 300 K
    python examples/water_md.py --model nequip --ensemble nve --steps 200
    python examples/water_md.py --ensemble npt --pressure 1000 --steps 2000 --log npt.log
    python examples/water_md.py --model my.model --molecules 512 --device cuda --dtype float32
    python examples/water_md.py --structure my.xyz --model my.nequip.zip
    python examples/water_md.py --restart water-md-....traj --steps 1000   # continue a run

GPU when present (a 1728-molecule, 5184-atom box), else CPU (a 32-molecule box that runs in seconds).
Prints progress (step, ps, ns/day, temperature, energy drift) and writes a trajectory to a new file.
``cgforge md`` takes the same arguments and returns the same exit codes (0 done, 1 error, 2 usage,
3 the run blew up, 130 Ctrl-C, 143 SIGTERM).
"""

from __future__ import annotations

import argparse
import sys
import time

from cgforge.plugin.calculator import Calculator
from cgforge.plugin.cli import run_guarded
from cgforge.plugin.cli.md import add_md_arguments, prepare_md


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_md_arguments(parser)
    args = parser.parse_args(argv)

    # 1. Every flag, file and the system checked first (no model loaded yet): a periodic box of randomly
    #    oriented water molecules at 1 g/cm^3, a structure file, or the last frame of a trajectory (--restart,
    #    whose saved ensemble and options the run continues). `plan` holds the checked run and the log.
    setup = prepare_md(args, stem="water-md")
    plan = setup.plan
    try:
        # 2. The calculator: loads the model (on CUDA patched with cgforge's kernels, compiled now, not in the
        #    first step; on a CPU the model's own code).
        start = time.perf_counter()
        calc = Calculator(plan.model, device=setup.device, dtype=args.dtype, skin=args.skin,
                          stress_with_forces=plan.o["ensemble"] == "npt")  # NPT asks for the stress every step

        # 3. The run: the model checked against the structure's elements, a few FIRE steps first (a generated box
        #    is far from the model's equilibrium; --relax 0 skips them), --compile auto decided, then MD:
        #    Langevin (or --thermostat csvr) NVT, velocity-Verlet NVE or NPT, progress every --log-interval
        #    steps; on a GPU cgforge's device engine runs the integrator next to the model (--engine ase: ASE's
        #    dynamics). The run stops with MDInstabilityError if it blows up, and Ctrl-C stops it after the
        #    current step; --plot draws the run at the end.
        summary = plan.run(calc, seconds=time.perf_counter() - start, close=False)
        plan.out(f"final temperature {summary.temperature_K:.1f} K, energy drift "
                 f"{summary.energy_drift_meV_per_atom:+.3f} meV/atom, {calc.neighbours.n_builds} neighbour-list builds")
    finally:
        plan.close()
    return 0


if __name__ == "__main__":
    sys.exit(run_guarded(main, "water_md"))  # one-line errors and cgforge md's exit codes
