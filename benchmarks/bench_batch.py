"""Many small structures at once (issue 64): cgforge's batched paths against the loops and the batched peers, one run.

    python benchmarks/bench_batch.py                                  # GPU: both models, 1,024 structures
    python benchmarks/bench_batch.py --models bundled --structures 8 --relax-structures 4 --loop-relax 2 \\
        --md-steps 3 --loop-md 2 --loop-eval 4 --device cpu --dtype float64                # a check on a CPU

The structures (built here, seeded): water clusters (no cell, no pbc) and periodic water cells, 8 to 100
molecules (24 to 300 atoms), half each. Models: the bundled water MACE ("bundled") and the MACE-MP-medium shape
(random weights, ``shapes.mace_mp_shape``), FP32 by default. Rows (``--peers`` picks them), each in atoms and
structures per second (atom-steps per second for MD and relaxation):

- ``loop``: cgforge's Calculator, one structure after another: ``eval-loop`` (energy, forces, stress; the first
  ``--loop-eval`` structures), ``relax-loop`` (ASE's FIRE, the first ``--loop-relax``), ``md-loop-nve`` (ASE's
  velocity Verlet, ``--loop-md-steps`` steps of the first ``--loop-md``). Loops are slow: their rate compares.
- ``batch``: cgforge's batched paths: ``eval-batch`` (``evaluate_batch``, ``--batch-size`` structures a call),
  ``relax-batch`` (``relax_batch``: FIRE to ``--fmax``, ASE's step or with ``--fire-variant torchsim`` TorchSim's
  order), ``md-batch-nvt`` (``run_md_batch``: NVT Langevin at ``--temperature``, ``--md-steps``).
- ``mace-cueq``: ``eval-mace-cueq``, MACE's own calculator with cuEquivariance over the ``--loop-eval`` structures.
- ``torchsim-mace``: TorchSim with its MACE model (cuEquivariance): ``eval-``, ``relax-`` (its batched FIRE, same
  ``--fmax``) and ``md-torchsim-mace-nvt`` (``--md-steps`` of NVT Langevin at ``--temperature``).
- ``torchsim-cgforge``: the same TorchSim runs over cgforge's model (``cgforge.plugin.torchsim``).
- ``--peer-md-steps`` and ``--peer-relax-structures`` shorten both TorchSim sets of rows (a slow peer's rate compares
  as well over fewer steps or structures; the final energies compare over the structures both relaxed).
- ``--peer-check-every``: TorchSim's ``optimize`` checks convergence every ``steps_between_swaps`` steps (5 by
  default), so a structure may take up to 4 FIRE steps past ``--fmax`` and end lower than ``relax-batch``, which
  stops at the first step under it; 1 makes the criterion the same (for the final energies' comparison).

A TorchSim state holds one pbc for all its systems: the TorchSim rows run the periodic cells and the clusters as
two sets, one after the other, each as one batch of TorchSim's autobatcher (``TorchSim.scaler``).
The relaxation rows give the largest final-energy difference per atom
against ``relax-batch`` over the structures both converged; ``relax-torchsim-cgforge`` also against
``relax-torchsim-mace`` (one optimizer, two models: TorchSim's FIRE is not ASE's step for step, so it can end a
flat water relaxation in another minimum than ``relax-batch`` does, unless ``--fire-variant torchsim`` runs
TorchSim's order in the batch too). A peer that cannot run (an import missing,
cuEquivariance not importable) gives a row saying why. The ratios the issue's targets name are printed at the end
and kept in the JSON, which goes to $OUT (``common.write_json``).
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
from common import environment, sync, write_json  # noqa: E402
from shapes import mace_mp_file  # noqa: E402

# cgforge is imported where it is used: a bad flag is named before any of it loads.
PEERS = ("loop", "batch", "mace-cueq", "torchsim-mace", "torchsim-cgforge")
MIN_DISTANCE = 0.8  # Å: no two atoms of a generated structure closer (the batch refuses overlapping atoms)
# (name, numerator row, denominator row, value, target): the targets and what cgforge gives TorchSim
RATIOS = (("md: batch / torchsim-mace", "md-batch-nvt", "md-torchsim-mace-nvt", "atom_steps_per_s", 3.0),
          ("md: batch / loop", "md-batch-nvt", "md-loop-nve", "atom_steps_per_s", 10.0),
          ("relax: batch / torchsim-mace", "relax-batch", "relax-torchsim-mace", "structures_per_s", 3.0),
          ("eval: batch / torchsim-mace", "eval-batch", "eval-torchsim-mace", "structures_per_s", None),
          ("md: torchsim-cgforge / torchsim-mace", "md-torchsim-cgforge-nvt", "md-torchsim-mace-nvt",
           "atom_steps_per_s", None),
          ("relax: torchsim-cgforge / torchsim-mace", "relax-torchsim-cgforge", "relax-torchsim-mace",
           "structures_per_s", None))


def structures(count: int, seed: int = 0, rattle: float = 0.0) -> list:
    """``count`` water systems of 8..100 molecules: even indices periodic cells, odd ones clusters."""
    from cgforge.plugin.water import water_box

    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        molecules = int(rng.integers(8, 101))
        for attempt in range(100):  # a small periodic box can put two images of its grid too close: draw again
            atoms = water_box(molecules, seed=(seed * 100_003 + i) * 101 + attempt)
            if i % 2:
                atoms.pbc, atoms.cell = False, None
            distances = atoms.get_all_distances(mic=bool(atoms.pbc.any()))
            if distances[np.triu_indices(len(atoms), 1)].min() >= MIN_DISTANCE:
                break
        else:
            raise RuntimeError(f"structure {i}: no water box of {molecules} molecules without atoms closer than "
                               f"{MIN_DISTANCE} Å in 100 draws")
        if rattle:
            atoms.rattle(rattle, seed=seed + i)
        out.append(atoms)
    return out


def rate(seconds: float, systems: list, steps: int | None = None) -> dict:
    atoms = sum(len(a) for a in systems)
    return {"seconds": seconds, "structures": len(systems), "structures_per_s": len(systems) / seconds,
            "atoms_per_s": atoms / seconds, **({} if steps is None else {"atom_steps_per_s": steps / seconds})}


def failed(err: BaseException) -> dict:
    """The row of a peer that could not run: why, in a line (not a crash of the whole run)."""
    return {"error": f"{type(err).__name__}: {err}"[:400]}


def cueq_missing() -> str | None:
    """Why cuEquivariance cannot run here (None: it imports). MACE's calculator converts with enable_cueq=True
    even where ``cuequivariance_torch`` does not import (its check is that the converter module imports, and that
    module swallows the missing package): the new model then has e3nn's symmetric contractions, and loading the
    converted weights fails with "Unexpected key(s) in state_dict: products.0.symmetric_contractions.weight"
    (session 32's row: cuEquivariance was not installed in that call). Checked first, so the row says so."""
    try:
        import cuequivariance  # noqa: F401
        import cuequivariance_torch  # noqa: F401
    except Exception as err:
        return f"cuEquivariance does not import ({type(err).__name__}: {err})"[:300]
    return None


# ---------------------------------------------------------------------------------------------- cgforge's rows

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


def relax_loop(calc, systems: list, fmax: float, steps: int, device: str) -> tuple[dict, dict]:
    """The row and each structure's final energy (eV, by index) where it converged."""
    from ase.optimize import FIRE

    total_steps, energies = 0, {}
    sync(device)
    start = time.perf_counter()
    for i, atoms in enumerate(systems):
        atoms = atoms.copy()
        atoms.calc = calc
        optimizer = FIRE(atoms, logfile=None)
        if optimizer.run(fmax=fmax, steps=steps):
            energies[i] = atoms.get_potential_energy()
        total_steps += optimizer.nsteps * len(atoms)
    sync(device)
    return rate(time.perf_counter() - start, systems, total_steps), energies


def relax_batch_row(calc, systems: list, args, device: str) -> tuple[dict, dict]:
    """The row and each structure's final energy (eV, by index) where it converged."""
    from cgforge.plugin import FireParameters, relax_batch

    fire = FireParameters(variant=args.fire_variant)
    sync(device)
    start = time.perf_counter()
    done = list(relax_batch(calc, systems, fmax=args.fmax, steps=args.steps, batch_size=args.batch_size, fire=fire))
    sync(device)
    row = rate(time.perf_counter() - start, systems, sum(d.steps * len(d.atoms) for d in done))
    row["statuses"] = {s: sum(d.status == s for d in done) for s in ("converged", "unconverged", "failed")}
    return row, {d.index: d.energy for d in done if d.status == "converged"}


def md_loop(calc, systems: list, steps: int, device: str) -> dict:
    from ase import units
    from ase.md.verlet import VelocityVerlet

    sync(device)
    start = time.perf_counter()
    for atoms in systems:
        atoms = atoms.copy()
        atoms.calc = calc
        VelocityVerlet(atoms, timestep=0.5 * units.fs).run(steps)
    sync(device)
    return rate(time.perf_counter() - start, systems, steps * sum(len(a) for a in systems))


def md_batch(calc, systems: list, args, device: str, shape: bool) -> dict:
    """``shape``: the model's weights are random, its forces hold no molecule together, so atoms fly through each
    other as a gas: the overlap check is off (TorchSim's rows have none either); the rate still compares."""
    from cgforge.plugin import run_md_batch

    sync(device)
    start = time.perf_counter()
    for first in range(0, len(systems), args.batch_size):  # NVT Langevin, as TorchSim's row
        run_md_batch(calc, systems[first:first + args.batch_size], ensemble="nvt", thermostat="langevin",
                     temperature_K=args.temperature, timestep_fs=args.timestep_fs, steps=args.md_steps,
                     min_distance=None if shape else 0.5)
    sync(device)
    row = rate(time.perf_counter() - start, systems, args.md_steps * sum(len(a) for a in systems))
    if shape:
        row["note"] = "random weights: min_distance off (atoms pass through each other)"
    padded = calc.potential.batch_step().padded  # the last batch's force call: captured, or why not
    row["captured"] = padded is not None and padded.cuda_graph
    if padded is not None and padded.capture_error:
        row["capture_error"] = padded.capture_error
    return row


def compare(row: dict, energies: dict, reference: dict, systems: list, against: str) -> None:
    """Into ``row``: over the structures converged in both, how many, the largest and the median
    |E - E_ref| / atoms, and how many lie within the issue's 1e-4 eV/atom."""
    both = [i for i in energies if i in reference]
    gaps = [abs(energies[i] - reference[i]) / len(systems[i]) for i in both]
    row[f"compared_with_{against}"] = len(both)
    row[f"max_energy_difference_per_atom_vs_{against}"] = max(gaps) if gaps else None
    row[f"median_energy_difference_per_atom_vs_{against}"] = float(np.median(gaps)) if gaps else None
    row[f"within_1e-4_vs_{against}"] = sum(g <= 1e-4 for g in gaps)


# ---------------------------------------------------------------------------------------------------- the peers

def mace_cueq(path: Path, systems: list, device: str, dtype: str) -> dict:
    """The loop over MACE's calculator with cuEquivariance; the model's file as written, else (a file MACE's
    converter cannot read) the module re-saved through cgforge's loader, unpatched, with the reason in the row."""
    reason = cueq_missing()
    if reason:
        return {"error": reason}
    from mace.calculators import MACECalculator

    def calculator(file: Path) -> object:
        calc = MACECalculator(model_paths=str(file), device=device, default_dtype=dtype, enable_cueq=True)
        if not any(type(m).__module__.startswith("cuequivariance") for m in calc.models[0].modules()):
            raise RuntimeError("MACE's conversion left no cuEquivariance module in the model")
        return calc

    note = None
    try:
        calc = calculator(path)
    except Exception as err:
        note = f"{path.name} did not convert ({type(err).__name__}: {err}"[:300] + "); ran the re-saved module"
        try:
            from cgforge.plugin.runtime.potential import load_module

            with tempfile.TemporaryDirectory() as folder:
                plain = Path(folder) / "plain.model"
                torch.save(load_module(str(path), "cpu", dtype, patch=False), plain)
                calc = calculator(plain)
        except Exception as again:
            return {"error": note.split("; ran")[0] + f"); re-saved: {type(again).__name__}: {again}"[:300]}
    row = eval_loop(calc, systems, device)
    return row if note is None else {**row, "note": note}


class TorchSim:
    """TorchSim's rows for one model: ``kind`` "mace" (TorchSim's MACE model on the raw module, cuEquivariance
    where it imports) or "cgforge" (``cgforge.plugin.torchsim`` over the Calculator's potential)."""

    def __init__(self, kind: str, raw: torch.nn.Module, calc, args) -> None:
        import torch_sim as ts

        self.ts, self.args, self.device = ts, args, torch.device(args.device)
        self.dtype = getattr(torch, args.dtype)
        self.backend = "cgforge"
        if kind == "mace":
            from torch_sim.models.mace import MaceModel

            missing = cueq_missing()
            self.backend = "cuequivariance" if missing is None else f"e3nn ({missing})"
            self.model = MaceModel(model=raw, device=self.device, dtype=self.dtype, compute_forces=True,
                                   compute_stress=False, enable_cueq=missing is None)
            if getattr(self.model, "_enable_oeq", False):
                self.backend = "cuequivariance + openequivariance (MACE's fallback)"
        else:
            from cgforge.plugin.torchsim import torchsim_model

            self.model = torchsim_model(calc, compute_stress=False)
        self.scalers: dict[str, float] = {}
        self.setup_s = 0.0

    def sets(self, systems: list) -> list[tuple[str, list[int]]]:
        """The periodic cells and the clusters (a state has one pbc), as index lists."""
        periodic = [i for i, a in enumerate(systems) if a.pbc.all()]
        rest = [i for i, a in enumerate(systems) if not a.pbc.all()]
        return [(name, idx) for name, idx in (("periodic", periodic), ("clusters", rest)) if idx]

    def scaler(self, name: str, systems: list) -> float:
        """The autobatcher's memory limit for a set: the whole set's memory scaler, so each set runs as one batch
        (as large as cgforge's batches or larger). TorchSim's own estimate (a ramp of forward passes up to
        the set's size) is not run: it took minutes per set and model on the GPU."""
        if name not in self.scalers:
            ts = self.ts
            start = time.perf_counter()
            state = ts.io.atoms_to_state(systems, device=self.device, dtype=self.dtype)
            metrics = ts.autobatching.calculate_memory_scalers(state, self.model.memory_scales_with)
            self.scalers[name] = 1.01 * float(sum(metrics))
            self.setup_s += time.perf_counter() - start
        return self.scalers[name]

    def row(self, seconds: float, systems: list, steps: int | None = None) -> dict:
        return {**rate(seconds, systems, steps), "backend": self.backend, "setup_s": self.setup_s,
                "max_memory_scaler": dict(self.scalers)}

    def evaluate(self, systems: list) -> dict:
        ts, seconds = self.ts, 0.0
        for name, idx in self.sets(systems):
            group = [systems[i] for i in idx]
            batcher = ts.BinningAutoBatcher(model=self.model, memory_scales_with=self.model.memory_scales_with,
                                            max_memory_scaler=self.scaler(name, group))
            state = ts.io.atoms_to_state(group, device=self.device, dtype=self.dtype)
            self.model(state[[0]])  # warm
            sync(self.args.device)
            start = time.perf_counter()
            batcher.load_states(state)
            for sub, _ in batcher:
                self.model(sub)
            sync(self.args.device)
            seconds += time.perf_counter() - start
        return self.row(seconds, systems)

    def md(self, systems: list) -> dict:
        ts, args, seconds = self.ts, self.args, 0.0
        for name, idx in self.sets(systems):
            group = [systems[i] for i in idx]
            batcher = ts.BinningAutoBatcher(model=self.model, memory_scales_with=self.model.memory_scales_with,
                                            max_memory_scaler=self.scaler(name, group))
            sync(args.device)
            start = time.perf_counter()
            ts.integrate(system=group, model=self.model, integrator=ts.Integrator.nvt_langevin, n_steps=args.peer_md_steps,
                         temperature=args.temperature, timestep=args.timestep_fs * 1e-3, autobatcher=batcher)
            sync(args.device)
            seconds += time.perf_counter() - start
        return self.row(seconds, systems, args.peer_md_steps * sum(len(a) for a in systems))

    def relax(self, systems: list) -> tuple[dict, dict]:
        """The row and each converged structure's final energy (eV, by index)."""
        ts, args, seconds, energies = self.ts, self.args, 0.0, {}
        converged = ts.generate_force_convergence_fn(force_tol=args.fmax)
        for name, idx in self.sets(systems):
            group = [systems[i] for i in idx]
            batcher = ts.InFlightAutoBatcher(model=self.model, memory_scales_with=self.model.memory_scales_with,
                                             max_memory_scaler=self.scaler(name, group))
            sync(args.device)
            start = time.perf_counter()
            final = ts.optimize(system=group, model=self.model, optimizer=ts.Optimizer.fire, convergence_fn=converged,
                                max_steps=args.steps, autobatcher=batcher, steps_between_swaps=args.peer_check_every)
            sync(args.device)
            seconds += time.perf_counter() - start
            done = (ts.system_wise_max_force(final) < args.fmax).tolist()
            for i, e, ok in zip(idx, final.energy.detach().double().cpu().tolist(), done, strict=True):
                if ok:
                    energies[i] = e
        row = self.row(seconds, systems)
        row["converged"] = len(energies)
        return row, energies


def torchsim_rows(kind: str, raw, calc, systems: list, rattled: list, reference: dict, args, rows: dict,
                  relaxed: dict) -> None:
    """Into ``rows``: the ``eval-``, ``relax-`` and ``md-torchsim-KIND(-nvt)`` rows; each one that cannot run says
    why. ``relaxed`` keeps each kind's final energies: TorchSim's FIRE over cgforge's model is compared with its FIRE
    over MACE's (the same optimizer: a difference there is the models', not the optimizers')."""
    names = [f"eval-torchsim-{kind}", f"md-torchsim-{kind}-nvt", f"relax-torchsim-{kind}"]
    peer_rattled = rattled[:args.peer_relax_structures]
    try:
        runner = TorchSim(kind, raw, calc, args)
    except Exception as err:
        for name in names:
            rows[name] = failed(err)
        return
    for name, job in zip(names, (lambda: runner.evaluate(systems), lambda: runner.md(systems),
                                 lambda: runner.relax(peer_rattled))):
        if (name.startswith("relax") and not peer_rattled) or (name.startswith("md") and not args.peer_md_steps):
            continue
        try:
            out = job()
        except Exception as err:
            rows[name] = failed(err)
            continue
        if name.startswith("relax"):
            out, energies = out
            compare(out, energies, reference, rattled, "batch")
            relaxed[kind] = energies
            if kind != "mace" and "mace" in relaxed:
                compare(out, energies, relaxed["mace"], rattled, "torchsim_mace")
        rows[name] = out


# ------------------------------------------------------------------------------------------------------- main

class Rows(dict):
    """A model's rows, each printed (with the time it took) and the JSON written again as it is set: a run stopped
    by a time limit keeps what it measured."""

    def __init__(self, model: str, save) -> None:
        super().__init__()
        self.model, self.save, self.since = model, save, time.perf_counter()

    def __setitem__(self, row: str, values: dict) -> None:
        super().__setitem__(row, values)
        took, self.since = time.perf_counter() - self.since, time.perf_counter()
        print(f"{self.model:15s} {row:24s} {values}  [{took:.0f} s]", flush=True)
        self.save()


def model_rows(name: str, file: Path, systems: list, rattled: list, args, rows: Rows) -> None:
    from cgforge.plugin import Calculator

    device, peers = args.device, set(args.peers)
    calc = Calculator(str(file), device=device, dtype=args.dtype)
    reference, loop = {}, {}
    if "loop" in peers:
        rows["eval-loop"] = eval_loop(calc, systems[:args.loop_eval], device)
    if "batch" in peers:
        rows["eval-batch"] = eval_batch(calc, systems, args.batch_size, device)
    if rattled and "loop" in peers and args.loop_relax:
        rows["relax-loop"], loop = relax_loop(calc, rattled[:args.loop_relax], args.fmax, args.steps, device)
    if rattled and ({"batch", "torchsim-mace", "torchsim-cgforge"} & peers):  # the reference energies
        rows["relax-batch"], reference = relax_batch_row(calc, rattled, args, device)
        if loop:
            compare(rows["relax-batch"], reference, loop, rattled, "loop")
    for row in ("relax-loop", "relax-batch"):  # a shape's random weights can leave every force below fmax
        if rows.get(row, {}).get("atom_steps_per_s") == 0:
            rows[row] = {**rows[row], "note": "every structure converged at its start: no FIRE step ran"}
    if args.md_steps and "loop" in peers and args.loop_md:
        rows["md-loop-nve"] = md_loop(calc, systems[:args.loop_md], args.loop_md_steps, device)
    if args.md_steps and "batch" in peers:
        rows["md-batch-nvt"] = md_batch(calc, systems, args, device, shape=name != "bundled")
    if "mace-cueq" in peers:
        rows["eval-mace-cueq"] = mace_cueq(file, systems[:args.loop_eval], device, args.dtype)
    relaxed = {}
    for kind in ("mace", "cgforge"):
        if f"torchsim-{kind}" in peers:  # TorchSim's MACE model converts the plain module of the file
            raw = torch.load(file, map_location=device, weights_only=False).to(getattr(torch, args.dtype))
            torchsim_rows(kind, raw, calc, systems, rattled, reference, args, rows, relaxed)


def ratios(rows: dict) -> dict:
    """The ratios of RATIOS that both rows give, and the TorchSim relaxations' final-energy agreement with
    relax-batch (the issue's 1e-4 eV/atom)."""
    out = {}
    for name, top, bottom, value, target in RATIOS:
        a, b = rows.get(top, {}).get(value), rows.get(bottom, {}).get(value)
        if a is not None and b:
            out[name] = {"ratio": a / b, "target": target}
    for kind, against in (("mace", "batch"), ("cgforge", "batch"), ("cgforge", "torchsim_mace")):
        row = rows.get(f"relax-torchsim-{kind}", {})
        if row.get(f"max_energy_difference_per_atom_vs_{against}") is not None:
            out[f"relax: torchsim-{kind} final energies vs {against.replace('_', '-')}"] = {
                "max_ev_per_atom": row[f"max_energy_difference_per_atom_vs_{against}"],
                "median_ev_per_atom": row.get(f"median_energy_difference_per_atom_vs_{against}"),
                "within_target": row.get(f"within_1e-4_vs_{against}"),
                "structures": row[f"compared_with_{against}"], "target": 1e-4}
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=("bundled", "mace-mp-medium"),
                        default=["bundled", "mace-mp-medium"])
    parser.add_argument("--peers", nargs="+", choices=PEERS, default=list(PEERS))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--structures", type=int, default=1024)
    parser.add_argument("--relax-structures", type=int, default=1024, help="0: no relaxation rows")
    parser.add_argument("--loop-eval", type=int, default=64, help="structures the evaluation loops run")
    parser.add_argument("--loop-relax", type=int, default=32, help="structures the ASE FIRE loop relaxes")
    parser.add_argument("--batch-size", type=int, default=256, help="structures per batch of cgforge's paths")
    parser.add_argument("--fmax", type=float, default=0.05)
    parser.add_argument("--steps", type=int, default=500, help="FIRE steps at most")
    parser.add_argument("--fire-variant", choices=("ase", "torchsim"), default="ase",
                        help="relax-batch's FIRE step: ASE's (as the relax-loop row), or TorchSim's order (as its "
                             "batched FIRE: the endpoints then compare one algorithm)")
    parser.add_argument("--md-steps", type=int, default=1000, help="steps of the batched MD rows (0: no MD rows)")
    parser.add_argument("--peer-md-steps", type=int, default=None,
                        help="steps of TorchSim's MD rows (default: --md-steps; its rate is what compares; 0: none)")
    parser.add_argument("--peer-relax-structures", type=int, default=None,
                        help="the first structures TorchSim relaxes (default: all --relax-structures; 0: none)")
    parser.add_argument("--peer-check-every", type=int, default=5,
                        help="TorchSim's FIRE checks convergence every this many steps (its steps_between_swaps, default "
                             "5: a structure may run up to 4 steps past fmax; 1: checked every step, as relax-batch)")
    parser.add_argument("--loop-md", type=int, default=8, help="structures the velocity-Verlet loop runs")
    parser.add_argument("--loop-md-steps", type=int, default=100, help="steps of the velocity-Verlet loop")
    parser.add_argument("--timestep-fs", type=float, default=0.5)
    parser.add_argument("--temperature", type=float, default=300.0, help="K, the batched NVT Langevin rows (cgforge's and TorchSim's)")
    args = parser.parse_args(argv)
    args.peer_md_steps = args.md_steps if args.peer_md_steps is None else args.peer_md_steps
    args.peer_relax_structures = (args.relax_structures if args.peer_relax_structures is None
                                  else args.peer_relax_structures)
    for flag, value, least in (("--structures", args.structures, 1), ("--relax-structures", args.relax_structures, 0),
                               ("--loop-eval", args.loop_eval, 1), ("--loop-relax", args.loop_relax, 0),
                               ("--batch-size", args.batch_size, 1), ("--steps", args.steps, 0),
                               ("--md-steps", args.md_steps, 0), ("--loop-md", args.loop_md, 0),
                               ("--peer-md-steps", args.peer_md_steps, 0), ("--peer-relax-structures",
                                                                            args.peer_relax_structures, 0),
                               ("--loop-md-steps", args.loop_md_steps, 1),
                               ("--peer-check-every", args.peer_check_every, 1)):
        if value < least:
            parser.error(f"{flag}: expected an integer >= {least}, got {value}")
    for flag, value in (("--fmax", args.fmax), ("--timestep-fs", args.timestep_fs),
                        ("--temperature", args.temperature)):
        if not value > 0:
            parser.error(f"{flag}: expected a number > 0, got {value}")
    return args


def main() -> None:
    args = parse()
    from cgforge.plugin.runtime.bundled import model_path

    systems = structures(args.structures)
    rattled = structures(args.relax_structures, seed=1, rattle=0.05)
    payload = {"args": vars(args), "environment": environment(), "atoms": sum(len(a) for a in systems),
               "rows": {}, "ratios": {}}
    path = None

    def save() -> None:
        nonlocal path
        path = write_json("bench_batch", payload, path)

    with tempfile.TemporaryDirectory() as folder:
        for name in args.models:
            file = model_path("mace") if name == "bundled" else mace_mp_file(Path(folder), args.dtype)
            rows = payload["rows"][name] = Rows(name, save)
            model_rows(name, file, systems, rattled, args, rows)
            payload["ratios"][name] = ratios(rows)
            for ratio, values in payload["ratios"][name].items():
                if "ratio" in values:
                    target = "" if values["target"] is None else f" (target >= {values['target']:g})"
                    print(f"{name:15s} {ratio:40s} {values['ratio']:8.2f}x{target}", flush=True)
                else:
                    print(f"{name:15s} {ratio:40s} max {values['max_ev_per_atom']:.2e}, median "
                          f"{values['median_ev_per_atom']:.2e} eV/atom, {values['within_target']} of "
                          f"{values['structures']} structures within 1e-4", flush=True)
            save()
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
