"""The ``cgforge`` command line. One small function per subcommand; each returns the exit code."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from .md import AUTO_ON_OFF, add_md_arguments

EXIT_OK = 0
EXIT_ERROR = 1  # bad input, unreadable or unwritable file, model that fails to load
EXIT_USAGE = 2  # argparse: unknown flag, missing value, bad choice
EXIT_UNSTABLE = 3  # cgforge md: the run blew up (non-finite forces/energy, temperature above the limit)
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT, what shells report)
EXIT_TERMINATED = 143  # SIGTERM, what batch schedulers send before they kill a job (128 + SIGTERM)


def _check_paths(src: str | None, dst: str, force: bool) -> None:
    """Before any work: IN exists (None: a bundled model), OUT is not IN, new or --force, in a writable folder."""
    from cgforge.atomic import check_new_file

    if src is not None and not os.path.exists(src):
        raise FileNotFoundError(f"IN: {src} does not exist")
    if os.path.exists(dst):
        if src is not None and os.path.samefile(src, dst):
            raise ValueError(f"OUT is the same file as IN ({dst}); cgforge never writes over its input")
        if not force:
            raise FileExistsError(f"OUT: {dst} exists; pass --force to overwrite it")
    check_new_file(dst, force=True, what="OUT")


def cmd_patch(args: argparse.Namespace) -> int:
    """``cgforge patch IN OUT``: a copy of the checkpoint IN (or a bundled model) that runs cgforge's kernels;
    ``cgforge unpatch IN OUT``: IN as a plain model that loads without cgforge (MACE only). IN is never modified."""
    from cgforge.patches import families
    from cgforge.plugin.runtime.bundled import NAMES, model_path

    patched = args.command == "patch"
    source = str(model_path(args.input.lower())) if args.input.lower() in NAMES else args.input  # a bundled model
    _check_paths(source, args.output, args.force)
    family = families.family_for_file(source)
    family.check_output(args.output, patched=patched, what="OUT")
    out = family.save(source, args.output, force=args.force, patched=patched, device=getattr(args, "device", "cpu"),
                      dtype=getattr(args, "dtype", None))
    print(f"cgforge: wrote {'patched' if patched else 'plain'} {family.title} model to {out}")
    return EXIT_OK


def cmd_lammps_model(args: argparse.Namespace) -> int:
    """``cgforge lammps-model IN OUT``: the file LAMMPS's ``pair_style mliap unified`` loads, holding IN."""
    from cgforge.plugin.lammps import CgforgeMLIAP
    from cgforge.plugin.lammps.write import usage_lines, write_lammps_model
    from cgforge.plugin.runtime.bundled import NAMES

    _check_paths(None if args.input.lower() in NAMES else args.input, args.output, args.force)
    obj = CgforgeMLIAP(args.input, dtype=args.dtype, device=args.device, patch=AUTO_ON_OFF[args.patch],
                       head=args.head, type_map=_parse_type_map(args.type_map), mode=args.mode,
                       cuda_graph=AUTO_ON_OFF[args.cuda_graph], radial_table=AUTO_ON_OFF[args.radial_table],
                       timers=args.timers)
    out = write_lammps_model(obj, args.output, force=args.force)
    print(f"cgforge: wrote the LAMMPS ML-IAP model to {out} ({out.stat().st_size / 1e6:.2f} MB); in LAMMPS:")
    print("\n".join(f"  {line}" for line in usage_lines(obj, out.name)))
    return EXIT_OK


def _parse_type_map(text: str | None) -> dict[str, str] | None:
    """'H=Hydrogen,O=Oxygen' -> {'H': 'Hydrogen', 'O': 'Oxygen'}."""
    if text is None:
        return None
    pairs = [p.split("=") for p in text.split(",") if p.strip()]
    if not pairs or any(len(p) != 2 or not p[0].strip() or not p[1].strip() for p in pairs):
        raise ValueError(f"--type-map: expected SYMBOL=TYPE[,SYMBOL=TYPE...], got {text!r}")
    return {a.strip(): b.strip() for a, b in pairs}


def _run(module: str) -> Callable[[argparse.Namespace], int]:
    """The subcommand ``cli.<module>``, imported when it runs (``--help`` loads nothing heavy)."""
    def run(args: argparse.Namespace) -> int:
        import importlib

        code = importlib.import_module(f"{__package__}.{module}")
        code = code.main() if module == "doctor" else code.run_from_args(args)
        return code if isinstance(code, int) else EXIT_OK  # cgforge md returns its summary
    return run


def _add_io(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", metavar="IN", help="checkpoint to read (never modified), or 'mace'/'nequip' (the "
                        "bundled water models)")
    parser.add_argument("output", metavar="OUT", help="file to write")
    parser.add_argument("--force", action="store_true", help="overwrite OUT if it exists")


def build_parser() -> argparse.ArgumentParser:
    from cgforge import __version__
    from cgforge.plugin.runtime.bundled import LISTED

    parser = argparse.ArgumentParser(
        prog="cgforge", description="Fast equivariant kernels for MACE and NequIP.",
        epilog=f"exit codes: {EXIT_OK} done, {EXIT_ERROR} error (bad input or file), {EXIT_USAGE} usage, "
               f"{EXIT_UNSTABLE} MD blew up, {EXIT_INTERRUPTED} interrupted (Ctrl-C), {EXIT_TERMINATED} terminated "
               "(SIGTERM)",
    )
    parser.add_argument("--version", action="version", version=f"cgforge {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("patch", help="write a copy of a checkpoint that uses cgforge's kernels "
                       f"(MACE .model -> .model; NequIP .ckpt/.nequip.zip -> .nequip.zip; {LISTED}: the "
                       "bundled water models)")
    _add_io(p)
    p.add_argument("--device", default="cpu", help="device to load and save on: cpu (default), cuda, cuda:N")
    p.add_argument("--dtype", choices=("float32", "float64"), default=None,
                   help="convert the model's precision (default: keep the checkpoint's)")
    p.set_defaults(func=cmd_patch)

    p = sub.add_parser("unpatch", help="write a plain MACE model (loadable without cgforge)")
    _add_io(p)
    p.set_defaults(func=cmd_patch)

    p = sub.add_parser("lammps-model", help="write the file LAMMPS's `pair_style mliap unified` loads (a MACE or "
                       "NequIP model inside; patched and compiled in the LAMMPS process)")
    p.add_argument("input", metavar="IN", help=f"checkpoint (.model, .ckpt, .nequip.zip) or {LISTED} (the "
                   "bundled water models); never modified")
    p.add_argument("output", metavar="OUT", help="file to write: .pkl (pickle; recommended) or .pt (torch.save; "
                   "needs TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 in LAMMPS with torch >= 2.6)")
    p.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    p.add_argument("--dtype", choices=("float32", "float64"), default=None,
                   help="run the model in this precision (default: the checkpoint's)")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: the device of LAMMPS's arrays: "
                   "CUDA with Kokkos on a GPU, else cpu)")
    p.add_argument("--head", default=None, help="MACE head of a multi-head model")
    p.add_argument("--type-map", default=None, metavar="SYMBOL=TYPE,...",
                   help="NequIP: chemical symbol of each type whose name is not one")
    p.add_argument("--mode", choices=("auto", "ghost", "exchange"), default="auto",
                   help="auto (default: ghost neighbours when LAMMPS lists them, else the feature exchange)")
    for flag, what in (("--patch", "cgforge's kernels (auto: as the Calculator; off: the model's own code)"),
                       ("--cuda-graph", "capture ghost-mode and one-rank exchange-mode steps in a CUDA graph (auto: "
                                        "on CUDA, for a model whose edges beyond the cutoff contribute zero)"),
                       ("--radial-table", "radial weights from a table of the edge length (auto: as the Calculator, "
                                          "on CUDA for a patched FP32 model that can)")):
        p.add_argument(flag, choices=tuple(AUTO_ON_OFF), default="auto", help=what)
    p.add_argument("--timers", action="store_true", help="keep per-phase times of every call; the input prints "
                   "their table into LAMMPS's screen and log (docs/lammps.md, \"Timers\")")
    p.set_defaults(func=cmd_lammps_model)

    from .md_batch import add_md_batch_arguments
    from .relax import add_relax_arguments

    p = sub.add_parser("md", help="run MD of a water box or any structure with a MACE/NequIP model (on a GPU: "
                       "cgforge's kernels and device engine; on a CPU: the model's own code, the faster path there, "
                       "and ASE's dynamics): NVT, NVE or NPT, a trajectory, restarts, a plot",
                       epilog=f"exit codes: {EXIT_OK} done, {EXIT_ERROR} error (bad input, file, model), {EXIT_USAGE} "
                              f"usage, {EXIT_UNSTABLE} the run blew up, {EXIT_INTERRUPTED} interrupted (Ctrl-C: the "
                              f"trajectory ends at the last complete step), {EXIT_TERMINATED} terminated (SIGTERM)")
    add_md_arguments(p)
    p.set_defaults(func=_run("md"))
    batch_exits = (f"exit codes: {EXIT_OK} at least one structure done (bad ones are named and kept in OUT as failed), "
                   f"{EXIT_ERROR} none, or bad input, {EXIT_USAGE} usage")
    p = sub.add_parser("relax", help="relax every structure of an extended XYZ file or ASE database with batched "
                       "FIRE; writes a new file of the same format with energies, forces and a status each",
                       epilog=batch_exits)
    add_relax_arguments(p)
    p.set_defaults(func=_run("relax"))
    p = sub.add_parser("md-batch", help="MD (NVE, NVT or NPT) of every structure of an extended XYZ file or ASE "
                       "database, many in one model call; writes a new file of the same format with each last state",
                       epilog=batch_exits)
    add_md_batch_arguments(p)
    p.set_defaults(func=_run("md_batch"))

    p = sub.add_parser("doctor", help="print the environment and compile/run one small kernel end to end")
    p.set_defaults(func=_run("doctor"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_guarded(lambda: args.func(args), f"cgforge {args.command}")


def run_guarded(func: Callable[[], int], prog: str) -> int:
    """``func()``'s exit code; a user-facing error is one line on stderr; SIGTERM unwinds like Ctrl-C (143)."""
    import signal

    from cgforge.plugin.md.checks import sigterm_as_interrupt

    try:
        with sigterm_as_interrupt():
            return func()
    except KeyboardInterrupt as err:
        terminated = getattr(err, "signum", signal.SIGINT) == signal.SIGTERM
        detail = str(err) if str(err) else "terminated (SIGTERM)" if terminated else "interrupted (Ctrl-C)"
        print(f"{prog}: {detail}", file=sys.stderr)
        return EXIT_TERMINATED if terminated else EXIT_INTERRUPTED
    except (ValueError, TypeError, OSError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return EXIT_ERROR
    except RuntimeError as err:
        from cgforge.plugin.md.run import MDInstabilityError

        if not isinstance(err, MDInstabilityError):
            raise  # a bug or a device failure: the traceback is what helps
        print(f"{prog}: error: {err}", file=sys.stderr)
        return EXIT_UNSTABLE


if __name__ == "__main__":
    sys.exit(main())
