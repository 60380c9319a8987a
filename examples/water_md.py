"""Water-box molecular dynamics with a MACE (or NequIP) model on cgforge's kernels.

    python examples/water_md.py                       # bundled MACE water model, NVT at 300 K
    python examples/water_md.py --model nequip --ensemble nve --steps 200
    python examples/water_md.py --model my.model --molecules 512 --device cuda --dtype float32
    python examples/water_md.py --structure my.xyz --model my.nequip.zip

GPU when present (a 1728-molecule, 5184-atom box), else CPU (a 32-molecule box that runs in seconds).
Prints progress (step, ps, ns/day, temperature, energy drift) and writes a trajectory to a new file.
``cgforge md`` takes the same arguments.
"""

from __future__ import annotations

import argparse
import sys
import time

from cgforge.plugin.calculator import Calculator, resolve_device
from cgforge.plugin.md import (
    CPU_MOLECULES,
    GPU_MOLECULES,
    add_md_arguments,
    check_new_path,
    default_trajectory_path,
    relax_steps,
    relax_structure,
    run_md,
)
from cgforge.plugin.water import water_box


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_md_arguments(parser)
    args = parser.parse_args(argv)

    relax = relax_steps(args)  # FIRE steps before MD, checked before anything is loaded
    device = resolve_device(args.device)  # cuda when available
    trajectory = (check_new_path(args.trajectory, args.force) if args.trajectory
                  else default_trajectory_path("water-md"))

    # 1. The system: a periodic box of randomly oriented water molecules at 1 g/cm^3 (or a file).
    if args.structure:
        from ase.io import read

        atoms = read(args.structure)
    else:
        n = args.molecules or (GPU_MOLECULES if device.type == "cuda" else CPU_MOLECULES)
        atoms = water_box(n, seed=args.seed)

    # 2. The calculator: loads and patches the model, compiles its kernels now (not in the first step).
    start = time.perf_counter()
    atoms.calc = Calculator(args.model, device=device, dtype=args.dtype, skin=args.skin)
    calc = atoms.calc
    print(f"{len(atoms)} atoms; model {args.model} ({calc.adapter.kind}, cutoff {calc.cutoff:g} Å) on {device}, "
          f"{calc.dtype}; ready in {time.perf_counter() - start:.1f} s", flush=True)

    # 3. A few FIRE steps first (a generated box is far from the model's equilibrium; --relax 0 skips them).
    if relax:
        relax_structure(atoms, calc, relax)

    # 4. MD: Langevin NVT or velocity-Verlet NVE, progress every --log-interval steps.
    summary = run_md(atoms, ensemble=args.ensemble, temperature_K=args.temperature, timestep_fs=args.timestep,
                     steps=args.steps, friction=args.friction, trajectory=trajectory,
                     trajectory_interval=args.traj_interval, log_interval=args.log_interval, seed=args.seed,
                     force=args.force)
    print(f"final temperature {summary.temperature_K:.1f} K, energy drift "
          f"{summary.energy_drift_meV_per_atom:+.3f} meV/atom, {calc.neighbours.n_builds} neighbour-list builds")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (ValueError, TypeError, OSError) as err:
        print(f"water_md: error: {err}", file=sys.stderr)
        sys.exit(1)
