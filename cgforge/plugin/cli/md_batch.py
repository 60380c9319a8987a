"""``cgforge md-batch IN``: MD of every structure of a file, in batches (``plugin.batch_md.run_md_batch``;
docs/batch.md). Structure i draws its velocities and noise from the seed ``--seed + i``, as ``cgforge md --engine
device`` would alone; a bad structure is named on stderr, written as failed, and its batch runs again without it.
Exit 0 when at least one structure ran, 1 when none could.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING

from cgforge.plugin.md.options import MDOptions, add_arguments, given_by_args

from .md import NAMES
from .relax import Writer, add_file_arguments, check_file_arguments, open_run

if TYPE_CHECKING:
    from ase import Atoms

# cgforge md's flags that mean the same here (MDOptions fields)
MD_FIELDS = ("ensemble", "thermostat", "temperature_K", "timestep_fs", "steps", "friction", "pressure_bar", "taut_fs",
             "taup_fs", "compressibility_per_bar", "seed", "init_velocities")


def add_md_batch_arguments(parser: argparse.ArgumentParser) -> None:
    add_file_arguments(parser, "run", "md")
    add_arguments(parser, MD_FIELDS, {"ensemble": {"help": (
        "nvt (--thermostat), nve (velocity Verlet) or npt (isotropic stochastic cell rescaling with the CSVR "
        "thermostat; needs periodic 3-D cells) (default nvt)")}, "seed": {"help": (
        "structure i's velocities and thermostat noise come from the seed SEED + i (default 0)")}})


def _run_batch(calc, batch: list[tuple[int, Atoms]], o, min_distance: float, failed: dict[int, str]
               ) -> list[tuple[int, Atoms]]:
    """Run ``batch`` (index in IN, atoms); a structure that fails is put in ``failed`` and the rest run again."""
    from cgforge.plugin.batch_md import run_md_batch
    from cgforge.plugin.runtime.batch import BatchStructureError

    while batch:
        try:
            final = run_md_batch(calc, [a for _, a in batch], seed=[o.seed + i for i, _ in batch],
                                 temperature_K=None if o.ensemble == "nve" else o.temperature_K,
                                 min_distance=min_distance, **{k: o[k] for k in MD_FIELDS[:10] if k != "temperature_K"})
        except BatchStructureError as err:
            index, _ = batch.pop(err.index)
            failed[index] = err.reason
            continue
        return [(i, a) for (i, _), a in zip(batch, final, strict=True)]
    return []


def run_from_args(args: argparse.Namespace) -> int:
    """``cgforge md-batch``: check, read, load the model, run in batches, write; the exit code (module doc)."""
    import numpy as np

    from cgforge.plugin.md.dynamics import thermalize

    check_file_arguments(args)
    o = MDOptions(**given_by_args(args), names=lambda key: NAMES.get(key, key))
    source, out, structures, calc = open_run(args, "cgforge md-batch")
    print(f"cgforge md-batch: {len(structures)} structures from {source} -> {out} ({o.describe()}, {o.steps} steps, "
          f"{args.batch_size} at a time)", flush=True)
    saved = {f"md_{k}": v for k, v in o.saved().items() if k != "seed"}
    writer = Writer(out)
    failed: dict[int, str] = {}
    done = atom_steps = 0
    start = time.perf_counter()
    for first in range(0, len(structures), args.batch_size):
        batch = []
        for index in range(first, min(first + args.batch_size, len(structures))):
            atoms = structures[index].copy()
            if o.init_velocities or (o.init_velocities is None and not np.any(atoms.get_momenta())):
                thermalize(atoms, o.temperature_K, np.random.default_rng(o.seed + index))  # as cgforge md's
            batch.append((index, atoms))
        finished = dict(_run_batch(calc, list(batch), o, args.min_distance, failed))
        for index, atoms in batch:  # in IN's order
            info = {**saved, "md_index": index, "md_seed": o.seed + index}
            if index in finished:
                writer.write(finished[index], {**info, "md_status": "done", "md_steps": o.steps})
                done += 1
                atom_steps += len(atoms) * o.steps
            else:
                print(f"cgforge md-batch: structure {index} skipped: {failed[index]}", file=sys.stderr, flush=True)
                writer.write(structures[index], {**info, "md_status": "failed", "md_steps": 0,
                                                 "md_error": failed[index]})
        seconds = max(time.perf_counter() - start, 1e-9)
        print(f"cgforge md-batch: {done + len(failed)}/{len(structures)} done ({len(failed)} failed), "
              f"{seconds:.1f} s, {done / seconds:.2f} structures/s, {atom_steps / seconds:.3g} atom-steps/s",
              flush=True)
    print(f"cgforge md-batch: wrote {len(structures)} structures to {out}", flush=True)
    if not done:
        print(f"cgforge md-batch: error: none of the {len(structures)} structures could be run", file=sys.stderr)
    return 0 if done else 1
