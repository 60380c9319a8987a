"""Kernel tunings side by side in one process: the 5,184-atom engine step of each model under each tuning, the
tunings' runs interleaved round by round so that drift of the machine (clocks, other tenants) falls on all alike.

    python3 benchmarks/investigations/tuning_ab.py --models bundled-mace,mace-mp-medium,nequip-M \\
        --tuning default={} --tuning atomic='{"tp": {"receiver_backward_atomic": true}}' [--rounds 3] [--steps 200]
        [--tuning all='{"rows": {"map_into_above_bytes": 0}}']
        [--tuning ahead-off={} --patch 'ahead-off=cgforge.plugin.md.engine:_INSTALL_AHEAD=False']
        [--tuning m125={} --engine 'm125={"rebuild_margin": 1.25}'] [--tuning s2={} --skin s2=2.0] [--ensemble npt]
        [--tuning compiled={} --compile compiled=default]

Each ``--tuning NAME=JSON`` is a ``KernelTuning.from_dict`` value (``cgforge md --kernel-tuning``'s file format:
kernel knobs, the linear-kernel rule, the row-chunk policy ``rows``); the first is the reference. ``--patch
NAME=MODULE:ATTRIBUTE=EXPRESSION`` sets a module attribute to a Python expression's value while tuning NAME's
calculator is built and runs (restored after): an A/B of a code path that is not a kernel knob. ``--engine
NAME=JSON`` gives tuning NAME's engines these ``EngineOptions`` fields (an A/B of an engine option); ``--skin
NAME=Å`` builds tuning NAME's calculator with that Verlet skin (default bench_md's, `cgforge md`'s); ``--compile
NAME=MODE`` with torch.compile in that mode (``Calculator(compile=)``; its first step, the compilation, falls in the
first round's warm-up: give ``--warmup`` room). ``--ensemble npt`` steps bench_md's NPT (stochastic cell rescaling)
instead of NVT Langevin. Per model: one Calculator per variant (FP32), the box relaxed once by bench_md's
``md_atoms``, then per round and variant a fresh Engine (NVT Langevin or NPT, 0.5 fs, 300 K) that runs ``--warmup``
steps and is timed over ``--steps``, then 40 steps profiled and 40 with CUDA events (``bench_md.device_use``: the
device's idle time, its idle at block boundaries unprofiled, kernels per step). Prints ms per step of every round,
the median per tuning, its ratio to the reference and the median idle times and kernels; JSON goes to
benchmarks/results/ (or $OUT). Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
import bench_md  # noqa: E402
from common import environment, write_json  # noqa: E402

from cgforge.kernels import KernelTuning  # noqa: E402
from cgforge.plugin.calculator import Calculator  # noqa: E402
from cgforge.plugin.md.engine import Engine  # noqa: E402
from cgforge.plugin.md.options import EngineOptions  # noqa: E402
from cgforge.plugin.runtime.compiled import MODES as COMPILE_MODES  # noqa: E402
from cgforge.plugin.runtime.neighbours import check_skin  # noqa: E402
from cgforge.plugin.water import water_box  # noqa: E402

MODELS = ("bundled-mace", "bundled-nequip", "mace-mp-medium", "nequip-M")


def parse_tuning(spec: str) -> tuple[str, KernelTuning]:
    """``NAME=JSON`` -> (NAME, KernelTuning); ``NAME={}`` is the defaults."""
    name, sep, text = spec.partition("=")
    if not sep or not name:
        raise SystemExit(f"--tuning wants NAME=JSON, got {spec!r}")
    try:
        return name, KernelTuning.from_dict(json.loads(text))
    except ValueError as error:  # json.JSONDecodeError is one
        raise SystemExit(f"--tuning {name}: {error}") from None


def parse_patch(spec: str, names: set[str]) -> tuple[str, str, str, object]:
    """``NAME=MODULE:ATTRIBUTE=EXPRESSION`` -> (NAME, MODULE, ATTRIBUTE, value); the module must have it."""
    name, sep, rest = spec.partition("=")
    target, sep2, expression = rest.partition("=")
    module, sep3, attribute = target.partition(":")
    if not (sep and sep2 and sep3 and name and module and attribute):
        raise SystemExit(f"--patch wants NAME=MODULE:ATTRIBUTE=EXPRESSION, got {spec!r}")
    if name not in names:
        raise SystemExit(f"--patch {name}: no --tuning of that NAME")
    try:
        if not hasattr(importlib.import_module(module), attribute):
            raise SystemExit(f"--patch {name}: {module} has no attribute {attribute!r}")
        value = eval(expression, {})  # an investigation script's own command line
    except (ImportError, SyntaxError, NameError) as error:
        raise SystemExit(f"--patch {name}: {error}") from None
    return name, module, attribute, value


@contextlib.contextmanager
def patched(patches: list[tuple[str, str, str, object]], name: str):
    """The module attributes of tuning ``name``'s patches set for the block."""
    saved = []
    try:
        for owner, module, attribute, value in patches:
            if owner == name:
                target = importlib.import_module(module)
                saved.append((target, attribute, getattr(target, attribute)))
                setattr(target, attribute, value)
        yield
    finally:
        for target, attribute, value in reversed(saved):
            setattr(target, attribute, value)


def _named(spec: str, names: set[str], flag: str, form: str) -> tuple[str, str]:
    """``NAME=VALUE`` of a per-tuning flag -> (NAME, VALUE text); NAME must be a --tuning's."""
    name, sep, text = spec.partition("=")
    if not sep or name not in names:
        raise SystemExit(f"{flag} wants NAME={form} with the NAME of a --tuning, got {spec!r}")
    return name, text


def parse_engine(spec: str, names: set[str]) -> tuple[str, EngineOptions]:
    """``NAME=JSON`` -> (NAME, EngineOptions of the JSON object's fields)."""
    name, text = _named(spec, names, "--engine", "JSON")
    try:
        return name, EngineOptions.of(json.loads(text), f"--engine {name}")
    except (ValueError, TypeError) as error:
        raise SystemExit(str(error)) from None


def parse_skin(spec: str, names: set[str]) -> tuple[str, float]:
    """``NAME=ANGSTROM`` -> (NAME, skin), checked as the Calculator checks it."""
    name, text = _named(spec, names, "--skin", "ANGSTROM")
    try:
        return name, check_skin(float(text))
    except ValueError as error:
        raise SystemExit(f"--skin {name}: expected a number of Å >= 0, got {text!r} ({error})") from None


def parse_compile(spec: str, names: set[str]) -> tuple[str, str]:
    """``NAME=MODE`` -> (NAME, MODE), a torch.compile mode the Calculator takes."""
    name, mode = _named(spec, names, "--compile", "MODE")
    if mode not in COMPILE_MODES:
        raise SystemExit(f"--compile {name}: expected one of {', '.join(COMPILE_MODES)}, got {mode!r}")
    return name, mode


def ms_per_step(calc: Calculator, atoms, warmup: int, steps: int, options: EngineOptions | None = None,
                ensemble: str = "nvt") -> tuple[float, dict]:
    """(ms per step, bench_md.device_use of 40 more steps: the device's idle time and kernels per step)."""
    engine = Engine(calc, atoms.copy(), bench_md.md_integrator(ensemble), seed=1, max_temperature_K=float("inf"),
                    engine_options=options)
    engine.run(warmup)
    torch.cuda.synchronize()
    t = time.perf_counter()
    engine.run(steps)
    torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - t) / steps, bench_md.device_use(engine, 40)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mace-mp-medium")
    parser.add_argument("--tuning", action="append", required=True, metavar="NAME=JSON")
    parser.add_argument("--patch", action="append", default=[], metavar="NAME=MODULE:ATTRIBUTE=EXPRESSION")
    parser.add_argument("--engine", action="append", default=[], metavar="NAME=JSON")
    parser.add_argument("--skin", action="append", default=[], metavar="NAME=ANGSTROM")
    parser.add_argument("--compile", action="append", default=[], metavar="NAME=MODE")
    parser.add_argument("--ensemble", default="nvt", choices=("nvt", "npt"))
    parser.add_argument("--molecules", type=int, default=1728)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args()
    models = args.models.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        sys.exit(f"tuning_ab.py: unknown model(s) {unknown}; choose from {', '.join(MODELS)}")
    tunings = [parse_tuning(spec) for spec in args.tuning]
    if len({name for name, _ in tunings}) < len(tunings):
        sys.exit("tuning_ab.py: two --tuning values have the same NAME")
    patches = [parse_patch(spec, {name for name, _ in tunings}) for spec in args.patch]
    engines = dict(parse_engine(spec, {name for name, _ in tunings}) for spec in args.engine)
    skins = dict(parse_skin(spec, {name for name, _ in tunings}) for spec in args.skin)
    compiles = dict(parse_compile(spec, {name for name, _ in tunings}) for spec in args.compile)
    if not torch.cuda.is_available():
        sys.exit("tuning_ab.py needs a CUDA GPU")
    atoms = bench_md.md_atoms(water_box(args.molecules), "float32")
    results: list[dict] = []
    path = None
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            calcs = {}
            for name, tuning in tunings:
                t = time.perf_counter()  # a module is patched in place: each tuning gets its own
                with patched(patches, name):
                    calcs[name] = Calculator(bench_md.fp32_source(model, Path(tmp)), device="cuda",
                                             dtype=None if model.startswith("nequip-") else "float32",
                                             skin=skins.get(name, bench_md.SKIN), tuning=tuning,
                                             compile=compiles.get(name, False))
                print(f"{model} {name}: calculator {time.perf_counter() - t:.1f} s", flush=True)
            times: dict[str, list[float]] = {name: [] for name, _ in tunings}
            device: dict[str, list[dict]] = {name: [] for name, _ in tunings}
            for r in range(args.rounds):
                for name, _ in tunings:
                    with patched(patches, name):
                        ms, use = ms_per_step(calcs[name], atoms, args.warmup, args.steps, engines.get(name),
                                              args.ensemble)
                    times[name].append(ms)
                    device[name].append(use)
                print(f"{model} round {r + 1}: " + ", ".join(f"{n} {v[-1]:.3f}" for n, v in times.items()),
                      flush=True)
            reference = float(np.median(times[tunings[0][0]]))
            for name, tuning in tunings:
                median = float(np.median(times[name]))
                results.append({"model": model, "atoms": len(atoms), "tuning_name": name,
                                "tuning": dataclasses.asdict(tuning),
                                "patches": [p[1:3] + (repr(p[3]),) for p in patches if p[0] == name],
                                "skin": skins.get(name, bench_md.SKIN), "compile": compiles.get(name),
                                "engine_options": dataclasses.asdict(engines[name]) if name in engines else None,
                                "ms_per_step": times[name], "median_ms": median,
                                "vs_reference": median / reference, "device": device[name],
                                "median_idle_ms": float(np.median([u["idle_ms"] for u in device[name]])),
                                "median_gap_idle_ms": float(np.median([u["gap_idle_ms"] for u in device[name]])),
                                "median_boundary_idle_ms": float(np.median([u["boundary_idle_ms"]
                                                                            for u in device[name]])),
                                "median_kernels": float(np.median([u["kernels"] for u in device[name]]))})
            del calcs
            torch.cuda.empty_cache()
            path = write_json("tuning-ab", {"environment": environment(), "args": vars(args), "results": results},
                              path)
    what = "NVT Langevin" if args.ensemble == "nvt" else "NPT stochastic cell rescaling"
    print(f"\n{len(atoms)} atoms, {what} FP32, {args.steps} steps after {args.warmup}, "
          f"{args.rounds} interleaved rounds; JSON: {path}")
    print(f"{'model':16s} {'tuning':12s} {'median ms':>10s} {'vs first':>9s} {'idle ms':>8s} {'in gaps':>8s} "
          f"{'boundary':>8s} {'kernels':>8s}  rounds (idle: the device's, per step, over 40 profiled steps after each "
          f"round's timed ones; in gaps: of it in gaps >= {bench_md.LONG_GAP_US:g} us, the host's waits; boundary: "
          "the idle at block boundaries over 40 more steps unprofiled, from CUDA events)")
    for row in results:
        print(f"{row['model']:16s} {row['tuning_name']:12s} {row['median_ms']:10.3f} {row['vs_reference']:8.3f}x "
              f"{row['median_idle_ms']:8.3f} {row['median_gap_idle_ms']:8.3f} {row['median_boundary_idle_ms']:8.3f} "
              f"{row['median_kernels']:8.0f}  "
              + " ".join(f"{v:.3f}" for v in row["ms_per_step"]))


if __name__ == "__main__":
    main()
