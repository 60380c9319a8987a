"""``cgforge md`` (and examples/water_md.py): the flags, their checks before any model loads, and the run."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

# Only light modules here: `cgforge --help` imports this file (torch, ASE, the patches load where they are used)
from cgforge.plugin.md.options import OPTION_FIELDS, PLOT_SUFFIXES, add_arguments, given_by_args, refuse_on_restart
from cgforge.plugin.runtime.bundled import LISTED
from cgforge.plugin.runtime.bundled import NAMES as BUNDLED

if TYPE_CHECKING:
    from cgforge.plugin.md.files import Restart
    from cgforge.plugin.md.run import MDPlan, MDSummary

__all__ = ["add_md_arguments", "prepare_md", "run_from_args", "MDSetup", "size_hint"]


AUTO_ON_OFF = {"auto": None, "on": True, "off": False}  # a flag's choice as a keyword's value
CPU_MOLECULES = 32  # a CPU-sized default box (96 atoms)
GPU_MOLECULES = 1728  # the benchmarks' 5184-atom box
DEFAULT_RELAX = 100  # FIRE steps for a generated box
# 2 Å: with pipelined rebuilds a longer-lived list costs less than its extra edges, which the model never sees (the
# list is cut to the cutoff on the device) (docs/measured-constants.md)
MD_SKIN = 2.0
# A box this large on a CPU gets a hint first: a step's time and memory per atom (docs/measured-constants.md)
CPU_HINT_ATOMS = 20_000
CPU_SECONDS_PER_ATOM = 1e-3
CPU_BYTES_PER_ATOM = 0.25e6

# run_md's argument -> the flag that sets it, so that errors name what the user typed
NAMES = {**{k: m["flag"] for k, m in OPTION_FIELDS.items()},
         **{k: f"--{k}" for k in ("trajectory", "restart", "log", "plot", "structure", "model")}}


def add_md_arguments(parser: argparse.ArgumentParser) -> None:
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--molecules", type=int, default=None,
                      help=f"water molecules in the box (default {GPU_MOLECULES} on a GPU, {CPU_MOLECULES} on CPU)")
    what.add_argument("--structure", default=None, help="read the structure from this file (any ase.io format)")
    what.add_argument("--restart", default=None, metavar="TRAJ",
                      help="continue this trajectory's run from its last frame with its saved options, engine and "
                           "model for --steps more steps into a new -o file (--structure TRAJ starts a new run)")
    parser.add_argument("--model", default=None,
                        help=f"{LISTED} (bundled water models; default 'mace'), or a .model/.ckpt/.nequip.zip "
                             "file; after --restart: the run's")
    add_arguments(parser)  # one flag per MDOptions field
    parser.add_argument("-o", "--trajectory", default=None,
                        help="trajectory file to write, .traj or .xyz (default: a new md-<date>-<time>.traj)")
    parser.add_argument("--log", default=None, metavar="FILE",
                        help="also write the progress lines (and the model and relaxation lines) to this new file")
    parser.add_argument("--plot", default=None, metavar="FILE.png", help="at the end (also after a blow-up or Ctrl-C) "
                        f"plot the progress lines against time into this new file ({', '.join(PLOT_SUFFIXES)})")
    parser.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available)")
    parser.add_argument("--dtype", choices=("float32", "float64"), default=None,
                        help="model precision (default: the model's)")
    parser.add_argument("--skin", type=float, default=MD_SKIN, help=f"neighbour-list skin in Å (default {MD_SKIN:g})")
    parser.add_argument("--radial-precision", choices=("fp32", "tf32", "3xtf32"), default="fp32",
                        help="radial-MLP products: fp32 (default), tf32 or 3xtf32 on tensor cores (CUDA, FP32 "
                             "models; kept only if the first structure's forces change by <= 1e-4 relative)")
    parser.add_argument("--radial-table", choices=("auto", "on", "off"), default="auto",
                        help="read each layer's weights from a table of the edge length instead of the radial MLP "
                             "(MACE, NequIP; fitted at start, relative error <= 1e-7); auto (default): on for FP32 "
                             "MACE and NequIP models on CUDA when the model allows it")
    parser.add_argument("--kernel-tuning", default=None, metavar="FILE.json", help='the kernels\' tuning: a JSON '
                        'object {"tp": {...}, "sc": {...}} of TPTuning and SCTuning fields (docs/md.md)')
    parser.add_argument("--workspace", choices=("auto", "whole", "tiled"), default="auto", help="the system as one "
                        "graph, in tiles with a fixed working set, auto: tiles where one graph would not fit the GPU")


class MDSetup(NamedTuple):
    """What ``cgforge md`` checked before loading the model: the run's ``plan``, the device, the kernel tuning."""

    plan: MDPlan
    device: Any
    tuning: Any = None


def model_of(model: str | None, restart: Restart | None = None) -> tuple[str, Path | None]:
    """``--model``, else the restart's model (``md_model``), else mace; and its file (None for a bundled name)."""
    saved = restart.model if restart is not None else None
    name = model or (saved.rsplit(" (", 1)[0] if saved and saved.endswith(")") else saved) or "mace"
    if name.lower() in BUNDLED:
        return name, None
    if not Path(name).exists():
        raise (FileNotFoundError(f"--model: {model} not found (expected {LISTED} or a checkpoint file)")
               if model else ValueError(f"--restart: {restart.path} was run with the model {saved}, which is not a "
                                        "bundled model and not a file here; name it with --model"))
    return name, Path(name)


def read_kernel_tuning(path: str | None) -> Any:
    """The ``KernelTuning`` of ``--kernel-tuning FILE.json`` (None without it); errors name the flag and file."""
    if path is None:
        return None
    import json

    from cgforge.kernels.core.tuning import KernelTuning

    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"--kernel-tuning: {path} not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"--kernel-tuning: {path}: not a readable JSON file ({err})") from None
    try:
        return KernelTuning.from_dict(data)
    except ValueError as err:
        raise ValueError(f"--kernel-tuning: {path}: {err}") from None


def size_hint(n_atoms: int, device: Any, above_atoms: int = CPU_HINT_ATOMS) -> str | None:
    """A hint before a box of more than ``above_atoms`` on a CPU (its expected cost), else None."""
    if getattr(device, "type", str(device)) != "cpu" or n_atoms <= above_atoms:
        return None
    seconds, gigabytes = n_atoms * CPU_SECONDS_PER_ATOM, n_atoms * CPU_BYTES_PER_ATOM / 1e9
    return (f"hint: {n_atoms:,} atoms on a CPU: expect roughly {seconds:.0f} s per step and {gigabytes:.0f} GB of "
            f"memory (~{CPU_SECONDS_PER_ATOM * 1e3:g} ms and ~{CPU_BYTES_PER_ATOM / 1e6:g} MB per atom with the "
            "bundled models, more for larger models and on a shared machine); a GPU runs this box in milliseconds "
            "per step (--device cuda); Ctrl-C stops the run after the current step")


def prepare_md(args: argparse.Namespace, stem: str = "md") -> MDSetup:
    """``cgforge md``'s own flags, the structure, then :func:`~cgforge.plugin.md.run.plan_md`: all before the
    model loads. The log file exists from here on (``setup.plan.close()`` closes it)."""
    from cgforge.plugin.calculator import resolve_device
    from cgforge.plugin.md.files import check_distinct, default_trajectory_path, read_restart
    from cgforge.plugin.md.options import check_count, check_number
    from cgforge.plugin.md.run import plan_md

    check_number("--skin", args.skin, strict=False)
    if args.molecules is not None:
        check_count("--molecules", args.molecules, 1)
    try:
        device = resolve_device(args.device)
    except ValueError as err:
        raise ValueError(f"--device: {str(err).removeprefix('device: ')}") from None
    radial = getattr(args, "radial_precision", "fp32")
    if radial != "fp32" and device.type != "cuda":
        raise ValueError(f"--radial-precision: {radial} needs a CUDA device (TF32 is a tensor-core format), got "
                         f"{device}")
    if radial != "fp32" and args.dtype == "float64":
        raise ValueError(f"--radial-precision: {radial} is for FP32 models; leave out --dtype float64")
    tuning = read_kernel_tuning(getattr(args, "kernel_tuning", None))
    trajectory = args.trajectory if args.trajectory is not None else default_trajectory_path(stem)
    restart = None
    given = given_by_args(args)
    if args.restart is not None:  # read first for its model; no output may be it (plan_md checks the rest)
        refuse_on_restart(given, NAMES.__getitem__)  # before the file is read: the flag is the mistake
        outputs = {"--trajectory": trajectory, "--log": args.log, "--plot": getattr(args, "plot", None)}
        check_distinct({k: None if v is None else Path(v) for k, v in outputs.items()},
                       {"--restart": Path(args.restart)})
        restart = read_restart(args.restart, "--restart")
    model, model_file = model_of(args.model, restart)
    structure = Path(args.structure) if args.structure is not None else None
    atoms = None  # a --structure file is read by plan_md, once its outputs are known not to be that file
    if structure is None and restart is None:
        from cgforge.plugin.water import water_box

        n = args.molecules if args.molecules is not None else GPU_MOLECULES if device.type == "cuda" else CPU_MOLECULES
        seed = check_count("--seed", args.seed, 0) if args.seed is not None else OPTION_FIELDS["seed"]["value"]
        atoms = water_box(n, seed=seed)  # the box's seed too
        given.setdefault("relax", DEFAULT_RELAX)  # a generated box is far from the model's equilibrium
    names = {**NAMES, "atoms": "--structure" if structure is not None else "--molecules"}
    plan = plan_md(atoms, names=names, inputs={"--model": model_file}, structure=structure, calculator_later=True,
                   prog="cgforge md", new_run=f"--structure {args.restart}" if restart is not None else None,
                   trajectory=trajectory, restart=restart, log=[print, args.log] if args.log is not None else print,
                   plot=getattr(args, "plot", None), **given)
    plan.model, plan.errors_to_caller = model, True
    if hint := size_hint(len(plan.atoms), device):
        plan.out(hint)
    return MDSetup(plan, device, tuning)


# The library's keywords as cgforge md's flags spell them (plan_md names the run's own): a message's first word...
_STARTS = {k: "--" + k.replace("_", "-") for k in "model device dtype skin workspace radial_table compile".split()}
# ... and a keyword=value anywhere
_SPELLINGS = (("pass dtype=None", "leave out --dtype"), ("dtype=None", "no --dtype"), (" (force=True)", ""),
              ("radial_table=True", "--radial-table on"), ("radial_table=False", "--radial-table off"),
              ("compile=False", "--compile off"), ("tuning=", "--kernel-tuning "),
              ("radial_precision=", "--radial-precision "))


def flag_spelling(message: str) -> str:
    """``message`` with the Calculator's keyword spellings replaced by ``cgforge md``'s flags."""
    name, sep, rest = message.partition(": ")
    message = _STARTS.get(name, name) + sep + rest
    for python, flag in _SPELLINGS:
        message = message.replace(python, flag)
    return message


def run_from_args(args: argparse.Namespace) -> MDSummary:
    """``cgforge md``: check, load the model, run (:meth:`MDPlan.run`); an error's message names flags."""
    from cgforge.plugin import calculator as calculator_module

    try:
        setup = prepare_md(args)  # bad input fails here, before the model is loaded and compiled
        plan = setup.plan
        try:
            t = time.perf_counter()
            calc = calculator_module.Calculator(
                plan.model, device=setup.device, dtype=args.dtype, skin=args.skin,
                radial_precision=args.radial_precision, stress_with_forces=plan.o["ensemble"] == "npt",
                radial_table=AUTO_ON_OFF[getattr(args, "radial_table", "auto")],
                **({"workspace": args.workspace} if getattr(args, "workspace", "auto") != "auto" else {}),
                **({"compile": plan.o.compile} if plan.o.compile not in ("auto", "off") else {}),
                **({"tuning": setup.tuning} if setup.tuning is not None else {}))
        except BaseException as err:
            plan.close(err)
            raise
        return plan.run(calc, seconds=time.perf_counter() - t)  # the model line, relax, compile, options, steps
    except (ValueError, TypeError, OSError) as err:
        if len(err.args) == 1 and isinstance(err.args[0], str):
            err.args = (flag_spelling(err.args[0]),)
        raise
