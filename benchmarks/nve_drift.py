"""Energy conservation of the device engine: NVE of a water box, the total energy's drift printed per model.

    python3 benchmarks/nve_drift.py [--models bundled-mace,bundled-nequip] [--molecules 512] [--ps 50]
        [--equilibrate-ps 10] [--timestep 1.0] [--dtype float32] [--every 100] [--device cuda]

Issue 62's conservation check: a ~1,500-atom water box (512 molecules), velocity Verlet at 1 fs for 50 ps on
cgforge's device engine (the step a user's `cgforge md --ensemble nve` takes, CUDA graph and all), FP32 unless
said. Per model: bench_md's MD box (``md_atoms``: relaxed by 50 FIRE steps of the bundled MACE, Maxwell-Boltzmann
momenta at 300 K, seed 0, zero total momentum), then ``--equilibrate-ps`` of Langevin dynamics at 300 K on the same
engine's step (50 FIRE steps leave the box far enough from the model's equilibrium that NVE from it heats to
500-900 K), then NVE from where that ended, its total energy (kinetic + potential) read every ``--every`` steps.
Printed and written as JSON (benchmarks/results/ or $OUT): the largest |E(t) - E(0)| per atom, the drift rate (the slope of a least-
squares line through E(t), meV per atom and ps), E's spread about that line, the mean temperature and the ms a
step. A force that is not the energy's gradient drifts linearly; rounding in FP32 adds a random walk. ``--device
cpu`` is a smoke run of the script (use a few molecules and ``--ps 0.01``), not a measurement.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_md  # noqa: E402
from common import environment, write_json  # noqa: E402

from cgforge.plugin import Calculator  # noqa: E402
from cgforge.plugin.md.engine import Engine  # noqa: E402
from cgforge.plugin.md.integrators import Langevin, VelocityVerlet  # noqa: E402
from cgforge.plugin.water import water_box  # noqa: E402

MODELS = ("bundled-mace", "bundled-nequip", "mace-mp-medium", "nequip-M")


def drift_stats(times_ps: np.ndarray, totals_ev: np.ndarray, n_atoms: int) -> dict[str, float]:
    """From the total energy ``totals_ev`` at ``times_ps`` (the first is E(0)): the largest |E - E(0)| (meV/atom),
    the least-squares slope (meV/atom/ps) and the spread about that line (RMS, meV/atom)."""
    per_atom = (totals_ev - totals_ev[0]) * 1e3 / n_atoms
    if len(times_ps) > 1:
        slope, intercept = np.polyfit(times_ps, per_atom, 1)
        spread = float(np.sqrt(np.mean((per_atom - (slope * times_ps + intercept)) ** 2)))
    else:
        slope, spread = 0.0, 0.0
    return {"max_abs_mev_per_atom": float(np.abs(per_atom).max()), "slope_mev_per_atom_per_ps": float(slope),
            "spread_mev_per_atom": spread}


def run_model(model: str, args: argparse.Namespace, folder: Path) -> dict:
    dtype = None if "nequip" in model else args.dtype  # NequIP models run in the dtype they were built in (FP32)
    source = bench_md.fp32_source(model, folder) if args.dtype == "float32" else bench_md.bundled(model.split("-")[1])
    calc = Calculator(source, device=args.device, dtype=dtype, skin=bench_md.SKIN)
    atoms = bench_md.md_atoms(water_box(args.molecules), args.dtype)
    block = 50 if args.device == "cuda" else 10
    settle = round(args.equilibrate_ps * 1000 / args.timestep)
    if settle:
        thermostat = Langevin(timestep_fs=args.timestep, temperature_K=bench_md.MD["temperature_K"],
                              friction_per_fs=bench_md.MD["friction_per_fs"])
        equilibration = Engine(calc, atoms, thermostat, seed=0, block=block)
        equilibration.run(settle)
        atoms = equilibration.sync_atoms().copy()  # positions and momenta where the thermostat left them
    steps = max(1, round(args.ps * 1000 / args.timestep))
    every = min(args.every, steps)
    engine = Engine(calc, atoms, VelocityVerlet(timestep_fs=args.timestep), seed=0, block=block)
    times, totals, temperatures = [0.0], [engine.conserved_energy()], [engine.temperature()]

    def record(e: Engine) -> None:
        times.append(e.step * args.timestep / 1000)
        totals.append(e.conserved_energy())
        temperatures.append(e.temperature())

    start = time.perf_counter()
    engine.run(steps, every=every, callback=record)
    wall = time.perf_counter() - start
    row = {"model": model, "dtype": args.dtype, "atoms": len(atoms), "timestep_fs": args.timestep,
           "equilibration_steps": settle, "steps": steps,
           "ps": steps * args.timestep / 1000, "ms_per_step": wall * 1e3 / steps,
           "mean_temperature_K": float(np.mean(temperatures)), "stats": dict(engine.stats),
           **drift_stats(np.array(times), np.array(totals), len(atoms)),
           "series": {"ps": times, "total_ev": totals}}
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="bundled-mace,bundled-nequip")
    parser.add_argument("--molecules", type=int, default=512)
    parser.add_argument("--ps", type=float, default=50.0)
    parser.add_argument("--equilibrate-ps", type=float, default=10.0, help="Langevin at 300 K before the NVE")
    parser.add_argument("--timestep", type=float, default=1.0, help="fs")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    parser.add_argument("--every", type=int, default=100, help="steps between energy reads")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = parser.parse_args(argv)
    models = args.models.split(",")
    if unknown := [m for m in models if m not in MODELS]:
        parser.error(f"--models: unknown {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    if args.dtype == "float64" and models != ["bundled-mace"]:
        parser.error("--dtype float64: the bundled MACE only (the NequIP models and the shapes are built in FP32)")
    if args.molecules < 1 or not args.ps > 0 or not args.timestep > 0 or args.every < 1:
        parser.error("--molecules, --ps, --timestep and --every must be positive")
    if not args.equilibrate_ps >= 0:
        parser.error("--equilibrate-ps must be zero or positive")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("nve_drift.py: no CUDA GPU (--device cpu runs a smoke test of the script)")
    bench_md.DEVICE = args.device
    env, rows, path = environment(), [], None
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            rows.append(run_model(model, args, Path(tmp)))
            path = write_json("nve-drift", {"environment": env, "args": vars(args), "results": rows}, path)
    print(f"NVE, velocity Verlet at {args.timestep:g} fs after {args.equilibrate_ps:g} ps of Langevin at "
          f"{bench_md.MD['temperature_K']:g} K, {args.dtype}, device engine on {env.get('device', args.device)}; "
          f"JSON: {path}")
    print(f"{'model':<16} {'atoms':>6} {'ps':>6} {'ms/step':>8} {'T mean K':>9} {'max|dE| meV/at':>15} "
          f"{'slope meV/at/ps':>16} {'spread meV/at':>14}")
    for r in rows:
        print(f"{r['model']:<16} {r['atoms']:>6} {r['ps']:>6.2f} {r['ms_per_step']:>8.3f} "
              f"{r['mean_temperature_K']:>9.1f} {r['max_abs_mev_per_atom']:>15.4f} "
              f"{r['slope_mev_per_atom_per_ps']:>16.5f} {r['spread_mev_per_atom']:>14.4f}")


if __name__ == "__main__":
    main()
