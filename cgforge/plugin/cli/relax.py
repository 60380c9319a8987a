"""``cgforge relax IN``: relax every structure of a file in batches (``plugin.relax.relax_batch``; docs/batch.md).
IN and OUT (a new file of IN's format: extended XYZ or an ASE database) and the model flags are shared with
``cgforge md-batch``. Exit 0 when at least one structure was relaxed, 1 when none could be.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from cgforge.plugin.md.options import check_count, check_number
from cgforge.plugin.runtime.bundled import LISTED

if TYPE_CHECKING:  # ase loads at run time only: `cgforge --help` imports nothing heavy
    from ase import Atoms

    from cgforge.plugin.calculator import Calculator

XYZ = (".xyz", ".extxyz")
DB = (".db",)


def add_file_arguments(parser: argparse.ArgumentParser, verb: str, tag: str) -> None:
    """IN, OUT, --force, the model, --batch-size, --min-distance: what ``relax`` and ``md-batch`` share."""
    parser.add_argument("input", metavar="IN", help=f"structures to {verb}: extended XYZ (.xyz, .extxyz) or an ASE "
                        "database (.db); never modified")
    parser.add_argument("-o", "--output", metavar="OUT", default=None,
                        help=f"new file of the same format (default: IN with .{tag} before the suffix)")
    parser.add_argument("--force", action="store_true", help="overwrite OUT if it exists (never IN)")
    parser.add_argument("--model", default="mace",
                        help=f"{LISTED} (bundled water models), or a .model/.ckpt/.nequip.zip file")
    parser.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available)")
    parser.add_argument("--dtype", choices=("float32", "float64"), default=None,
                        help="model precision (default: the model's)")
    parser.add_argument("--batch-size", type=int, default=64, help=f"structures to {verb} together (default 64)")
    parser.add_argument("--min-distance", type=float, default=0.5,
                        help="two atoms closer than this (Å) make a structure bad: skipped (default 0.5)")
    parser.set_defaults(output_tag=tag)


def add_relax_arguments(parser: argparse.ArgumentParser) -> None:
    add_file_arguments(parser, "relax", "relaxed")
    parser.add_argument("--fmax", type=float, default=0.05, help="converged when the largest atomic force is below "
                        "this, eV/Å (default 0.05)")
    parser.add_argument("--steps", type=int, default=1000, help="FIRE steps per structure at most (default 1000)")
    parser.add_argument("--max-atoms", type=int, default=None,
                        help="atoms in the batch at most (default: no limit beyond --batch-size)")
    parser.add_argument("--cell", action="store_true", help="relax the cells of structures periodic in 3-D too "
                        "(ASE's FrechetCellFilter on each); others relax their positions only")


def check_file_arguments(args: argparse.Namespace) -> None:
    """--batch-size and --min-distance (``add_file_arguments``) in range."""
    check_count("--batch-size", args.batch_size, 1)
    check_number("--min-distance", args.min_distance, strict=False)


def output_path(args: argparse.Namespace) -> tuple[Path, Path]:
    """(IN, OUT) checked before the model loads: IN exists, OUT is new (or --force), of IN's format, not IN."""
    from cgforge.plugin.md.files import check_distinct, check_new_path

    source = Path(args.input)
    suffix = source.suffix.lower()
    if suffix not in XYZ + DB:
        raise ValueError(f"IN: {source} must be extended XYZ (.xyz, .extxyz) or an ASE database (.db)")
    if not source.is_file():
        raise FileNotFoundError(f"IN: {source} not found")
    out = Path(args.output) if args.output else source.with_name(f"{source.stem}.{args.output_tag}{source.suffix}")
    formats = XYZ if suffix in XYZ else DB
    out = check_new_path(out, force=args.force, what="OUT", suffixes=formats)
    check_distinct({"OUT": out}, {"IN": source})
    return source, out


def read_structures(source: Path) -> list[Atoms]:
    """Every frame (row) of IN; an unreadable file is one error naming it."""
    try:
        if source.suffix.lower() in DB:
            from ase.db import connect

            return [row.toatoms() for row in connect(source).select()]
        from ase.io import read

        frames = read(source, index=":", format="extxyz")
    except Exception as err:  # ase.io and ase.db raise a different type per problem; all mean "cannot read"
        raise ValueError(f"IN: {source}: cannot read it: {type(err).__name__}: {err}") from None
    return list(frames)


class Writer:
    """Appends each finished structure to OUT (created at the first one)."""

    def __init__(self, path: Path) -> None:
        self.path, self.db = path, None
        if path.suffix.lower() in DB:
            from ase.db import connect

            path.unlink(missing_ok=True)  # --force: a new database, not rows added to the old one
            self.db = connect(path)
        else:
            path.write_text("")

    def write(self, atoms: Atoms, info: dict) -> None:
        if self.db is not None:
            self.db.write(atoms, **{k: v for k, v in info.items() if v is not None})
            return
        from ase.io import write

        atoms.info.update({k: v for k, v in info.items() if v is not None})
        write(self.path, atoms, format="extxyz", append=True)


def open_run(args: argparse.Namespace, prog: str) -> tuple[Path, Path, list[Atoms], Calculator]:
    """(IN, OUT, IN's structures, the model's calculator); the model's banner printed."""
    from cgforge.plugin import Calculator
    from cgforge.plugin.md.run import model_banner

    source, out = output_path(args)
    structures = read_structures(source)
    if not structures:
        raise ValueError(f"IN: {source} holds no structures")
    start = time.perf_counter()
    calc = Calculator(args.model, device=args.device, dtype=args.dtype)
    print(f"{prog}: {model_banner(args.model, calc, time.perf_counter() - start)}", flush=True)
    return source, out, structures, calc


def run_from_args(args: argparse.Namespace) -> int:
    """``cgforge relax``: check, read, load the model, relax, write; the exit code (module doc)."""
    from ase import Atoms

    from cgforge.plugin.relax import relax_batch

    check_file_arguments(args)
    check_count("--steps", args.steps, 0)
    check_number("--fmax", args.fmax)
    if args.max_atoms is not None:
        check_count("--max-atoms", args.max_atoms, 1)
    source, out, structures, calc = open_run(args, "cgforge relax")
    what = "positions and cells" if args.cell else "positions"
    print(f"cgforge relax: {len(structures)} structures from {source} -> {out} (FIRE on {what} to fmax "
          f"{args.fmax:g} eV/Å, at most {args.steps} steps, {args.batch_size} at a time)", flush=True)
    writer = Writer(out)
    counts = {"converged": 0, "unconverged": 0, "failed": 0}
    start = time.perf_counter()
    every = max(1, len(structures) // 10)
    for done in relax_batch(calc, structures, fmax=args.fmax, steps=args.steps, batch_size=args.batch_size,
                            max_atoms=args.max_atoms, min_distance=args.min_distance, cell_filter=args.cell):
        counts[done.status] += 1
        writer.write(done.atoms if isinstance(done.atoms, Atoms) else Atoms(), {
            "relax_index": done.index, "relax_status": done.status, "relax_steps": done.steps,
            "relax_fmax": done.fmax, "relax_error": done.error})
        if done.status == "failed":
            print(f"cgforge relax: structure {done.index} skipped: {done.error}", file=sys.stderr, flush=True)
        finished = sum(counts.values())
        if finished % every == 0 or finished == len(structures):
            seconds = time.perf_counter() - start
            print(f"cgforge relax: {finished}/{len(structures)} done ({counts['converged']} converged, "
                  f"{counts['unconverged']} unconverged, {counts['failed']} failed), {seconds:.1f} s, "
                  f"{finished / max(seconds, 1e-9):.2f} structures/s", flush=True)
    print(f"cgforge relax: wrote {sum(counts.values())} structures to {out}", flush=True)
    if counts["failed"] == len(structures):
        print(f"cgforge relax: error: none of the {len(structures)} structures could be relaxed", file=sys.stderr)
    return 1 if counts["failed"] == len(structures) else 0
