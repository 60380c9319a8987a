"""Many small structures at once (issue 64): batched evaluation and batched FIRE against the loops, one run.

    python benchmarks/bench_batch.py                                  # GPU: both models, 1,024 structures
    python benchmarks/bench_batch.py --models bundled --structures 64 --relax-structures 16 --device cpu  # a check

The structures (built here, seeded): water clusters (no cell, no pbc) and periodic water cells, 8 to 100
molecules (24 to 300 atoms), half each. Models: the bundled water MACE ("bundled") and the MACE-MP-medium shape
(random weights, ``shapes.mace_mp_shape``), FP32 by default. Rows, each in atoms per second and structures per
second:

- ``eval-loop``: cgforge's Calculator, one structure after another (energy, forces, stress): the baseline.
- ``eval-batch``: ``evaluate_batch`` over batches of ``--batch-size`` structures.
- ``eval-mace-cueq``: MACE's own calculator with cuEquivariance, one structure after another (where mace-torch and
  cuEquivariance import; the bundled model only: its file).
- ``eval-torchsim``: TorchSim's MaceModel on the whole set as one batched state (where torch_sim imports).
- ``relax-loop``: ASE's FIRE with cgforge's Calculator per structure, on the first ``--loop-relax`` structures
  (the loop is slow: its rate, not its total, is what compares).
- ``relax-batch``: ``relax_batch`` over ``--relax-structures`` rattled structures, FIRE to ``--fmax``, with the
  final energies compared to the loop's on the structures both relaxed (largest difference per atom).
- ``relax-torchsim``: TorchSim's batched FIRE with its MACE model (where torch_sim imports), same criterion.
- ``md-loop-nve``: ASE's velocity Verlet with cgforge's Calculator per structure, ``--md-steps`` steps, on the first
  ``--loop-md`` structures; ``md-batch-nve``: ``run_nve_batch`` over every structure in batches of
  ``--batch-size`` (atom-steps per second). The issue's NVT rows and the engine's batched MD are not built yet.

The JSON goes to $OUT (``common.write_json``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, write_json  # noqa: E402
from shapes import mace_mp_file  # noqa: E402

# cgforge is imported where it is used: a bad flag is named before any of it loads.


def structures(count: int, seed: int = 0, rattle: float = 0.0) -> list:
    """``count`` water systems of 8..100 molecules: even indices periodic cells, odd ones clusters."""
    from cgforge.plugin.water import water_box

    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        atoms = water_box(int(rng.integers(8, 101)), seed=seed * 100_003 + i)
        if i % 2:
            atoms.pbc, atoms.cell = False, None
        if rattle:
            atoms.rattle(rattle, seed=seed + i)
        out.append(atoms)
    return out


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def rate(seconds: float, systems: list, steps: int | None = None) -> dict:
    atoms = sum(len(a) for a in systems)
    return {"seconds": seconds, "structures_per_s": len(systems) / seconds, "atoms_per_s": atoms / seconds,
            **({} if steps is None else {"atom_steps_per_s": steps / seconds})}


def eval_loop(calc, systems: list, device: str) -> dict:
    for atoms in systems[:4]:  # warm: every size class compiles/allocates once
        atoms.calc = calc
        atoms.get_forces()
    sync(device)
    start = time.perf_counter()
    for atoms in systems:
        atoms.calc = calc
        atoms.get_forces()
        if atoms.cell.volume > 0:
            atoms.get_stress()
    sync(device)
    return rate(time.perf_counter() - start, systems)


def eval_batch(calc, systems: list, batch: int, device: str) -> dict:
    from cgforge.plugin import evaluate_batch

    evaluate_batch(calc, systems[:batch])
    sync(device)
    start = time.perf_counter()
    for first in range(0, len(systems), batch):
        evaluate_batch(calc, systems[first:first + batch])
    sync(device)
    return rate(time.perf_counter() - start, systems)


def mace_cueq(path: Path, systems: list, device: str, dtype: str) -> dict:
    try:
        from mace.calculators import MACECalculator

        calc = MACECalculator(model_paths=str(path), device=device, default_dtype=dtype, enable_cueq=True)
    except Exception as err:  # a peer that cannot run here is reported, not fatal
        return {"error": f"{type(err).__name__}: {err}"[:300]}
    return eval_loop(calc, systems, device)


def torchsim_model(raw: torch.nn.Module, device: str, dtype: torch.dtype):
    import torch_sim as ts
    from torch_sim.models.mace import MaceModel

    return ts, MaceModel(model=raw, device=torch.device(device), dtype=dtype, compute_forces=True,
                         compute_stress=False)


def torchsim_eval(raw, systems: list, device: str, dtype: torch.dtype) -> dict:
    try:
        ts, model = torchsim_model(raw, device, dtype)
        state = ts.io.atoms_to_state(systems, device=torch.device(device), dtype=dtype)
        model(state)
        sync(device)
        start = time.perf_counter()
        model(state)
        sync(device)
    except Exception as err:
        return {"error": f"{type(err).__name__}: {err}"[:300]}
    return rate(time.perf_counter() - start, systems)


def torchsim_relax(raw, systems: list, device: str, dtype: torch.dtype, fmax: float, steps: int) -> dict:
    try:
        ts, model = torchsim_model(raw, device, dtype)
        optimizer = getattr(getattr(ts, "Optimizer", None), "fire", None) or ts.optimizers.fire
        sync(device)
        start = time.perf_counter()
        final = ts.optimize(system=systems, model=model, optimizer=optimizer, max_steps=steps, autobatcher=True,
                            convergence_fn=ts.generate_force_convergence_fn(force_tol=fmax))
        sync(device)
        seconds = time.perf_counter() - start
        energies = final.energy.detach().cpu().double().numpy() if hasattr(final, "energy") else None
    except Exception as err:
        return {"error": f"{type(err).__name__}: {err}"[:300]}
    row = rate(seconds, systems)
    if energies is not None:
        row["energies"] = energies.tolist()
    return row


def relax_loop(calc, systems: list, fmax: float, steps: int, device: str) -> tuple[dict, dict]:
    from ase.optimize import FIRE

    energies, total_steps = {}, 0
    sync(device)
    start = time.perf_counter()
    for i, atoms in enumerate(systems):
        atoms = atoms.copy()
        atoms.calc = calc
        optimizer = FIRE(atoms, logfile=None)
        optimizer.run(fmax=fmax, steps=steps)
        energies[i] = atoms.get_potential_energy()
        total_steps += optimizer.nsteps * len(atoms)
    sync(device)
    return rate(time.perf_counter() - start, systems, total_steps), energies


def relax_rows(calc, systems: list, args, device: str) -> dict:
    from cgforge.plugin import relax_batch

    loop, loop_energies = relax_loop(calc, systems[:args.loop_relax], args.fmax, args.steps, device)
    sync(device)
    start = time.perf_counter()
    done = list(relax_batch(calc, systems, fmax=args.fmax, steps=args.steps, batch_size=args.batch_size))
    sync(device)
    batch = rate(time.perf_counter() - start, systems, sum(d.steps * len(d.atoms) for d in done))
    batch["statuses"] = {s: sum(d.status == s for d in done) for s in ("converged", "unconverged", "failed")}
    by_index = {d.index: d for d in done}
    differences = [abs(by_index[i].energy - e) / len(systems[i]) for i, e in loop_energies.items()
                   if by_index[i].energy is not None]
    batch["max_energy_difference_per_atom_vs_loop"] = max(differences) if differences else None
    return {"relax-loop": loop, "relax-batch": batch}


def md_rows(calc, systems: list, args, device: str) -> dict:
    from ase import units
    from ase.md.verlet import VelocityVerlet

    from cgforge.plugin import run_nve_batch

    loop = systems[:args.loop_md]
    sync(device)
    start = time.perf_counter()
    for atoms in loop:
        atoms = atoms.copy()
        atoms.calc = calc
        VelocityVerlet(atoms, timestep=0.5 * units.fs).run(args.md_steps)
    sync(device)
    rows = {"md-loop-nve": rate(time.perf_counter() - start, loop, args.md_steps * sum(len(a) for a in loop))}
    start = time.perf_counter()
    for first in range(0, len(systems), args.batch_size):
        run_nve_batch(calc, systems[first:first + args.batch_size], timestep_fs=0.5, steps=args.md_steps)
    sync(device)
    rows["md-batch-nve"] = rate(time.perf_counter() - start, systems, args.md_steps * sum(len(a) for a in systems))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=("bundled", "mace-mp-medium"),
                        default=["bundled", "mace-mp-medium"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--structures", type=int, default=1024)
    parser.add_argument("--relax-structures", type=int, default=1024)
    parser.add_argument("--loop-relax", type=int, default=32, help="structures the ASE FIRE loop relaxes")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--fmax", type=float, default=0.05)
    parser.add_argument("--steps", type=int, default=500, help="FIRE steps at most")
    parser.add_argument("--md-steps", type=int, default=200, help="NVE steps of the MD rows (0: no MD rows)")
    parser.add_argument("--loop-md", type=int, default=8, help="structures the velocity-Verlet loop runs")
    args = parser.parse_args()
    for flag, value, least in (("--structures", args.structures, 1), ("--relax-structures", args.relax_structures, 0),
                               ("--loop-relax", args.loop_relax, 0), ("--batch-size", args.batch_size, 1),
                               ("--steps", args.steps, 0), ("--md-steps", args.md_steps, 0),
                               ("--loop-md", args.loop_md, 0)):
        if value < least:
            parser.error(f"{flag}: expected an integer >= {least}, got {value}")
    if not args.fmax > 0:
        parser.error(f"--fmax: expected a number > 0, got {args.fmax}")
    from cgforge.plugin import Calculator
    from cgforge.plugin.runtime.bundled import model_path

    dtype = {"float32": torch.float32, "float64": torch.float64}[args.dtype]
    systems = structures(args.structures)
    rattled = structures(args.relax_structures, seed=1, rattle=0.05)
    payload = {"args": vars(args), "environment": environment(),
               "atoms": sum(len(a) for a in systems), "rows": {}}
    path = None
    with tempfile.TemporaryDirectory() as folder:
        for name in args.models:
            file = model_path("mace") if name == "bundled" else mace_mp_file(Path(folder), args.dtype)
            calc = Calculator(str(file), device=args.device, dtype=args.dtype)
            rows = {"eval-loop": eval_loop(calc, systems, args.device),
                    "eval-batch": eval_batch(calc, systems, args.batch_size, args.device)}
            rows.update(relax_rows(calc, rattled, args, args.device))
            if args.md_steps:
                rows.update(md_rows(calc, systems, args, args.device))
            rows["eval-mace-cueq"] = mace_cueq(file, systems, args.device, args.dtype)
            raw = torch.load(file, map_location=args.device, weights_only=False).to(dtype)
            rows["eval-torchsim"] = torchsim_eval(raw, systems, args.device, dtype)
            rows["relax-torchsim"] = torchsim_relax(raw, rattled, args.device, dtype, args.fmax, args.steps)
            payload["rows"][name] = rows
            for row, values in rows.items():
                shown = {k: v for k, v in values.items() if k != "energies"}
                print(f"{name:15s} {row:15s} {shown}", flush=True)
            path = write_json("bench_batch", payload, path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
