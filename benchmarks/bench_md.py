"""End-to-end MD step: cgforge's Calculator vs MACECalculator / NequIPCalculator, in one run.

Seconds per NVT step (energy + forces) and per NPT-like step (energy + forces + stress), peak GPU memory,
and for cgforge a breakdown (neighbour list, model forward, backward, copy out, other), on water boxes and
DHFR, FP32 and FP64. A step moves every atom by ~0.01 Å from a reference frame (as MD does between
neighbour-list rebuilds) and asks the calculator through ASE. The neighbour-list rebuild is timed apart
(``nl_build_s``): in MD it happens every few tens of steps.

    python benchmarks/bench_md.py                                   # everything (long)
    python benchmarks/bench_md.py --systems 5k --dtypes float32 --models mace-mp-medium --backends cgforge,e3nn

Systems: 1k, 5k, 20k, 50k, 100k, 200k, 500k, 1m (water boxes of 7^3 ... 70^3 molecules; --nvt-only for
capacity runs of the large ones), dhfr (23,558 atoms; file from
$CGFORGE_DHFR, else .device/base/dhfr.xyz, else ../shared/data/dhfr_jac_23558.tinker.xyz).
Models: mace-mp-medium (MACE-MP-medium shape, 89 elements, random weights, r 6 Å), nequip-l1 (l_max 1,
32 features, 4 layers, r 5 Å), nequip-M (preset M shape), bundled-mace, bundled-nequip (cgforge/models/).
Backends, what a user chooses between: cgforge (our Calculator as it comes: the patched model, on CUDA a CUDA-graph
replay with the edges cut to the cutoff on the device), cgforge-compiled (``Calculator(compile=True)``: the model's
forward and backward compiled by torch.compile; its first call, compilation included, is ``first_call_s``), e3nn,
cueq, oeq (the peers' calculators with their kernels: MACECalculator / NequIPCalculator, cueq and oeq when
importable). Whole MD steps (integrator included, on a box relaxed by 50 FIRE steps of the bundled model,
Maxwell-Boltzmann momenta at 300 K, 0.5 fs): cgforge-engine (``cgforge.plugin.md.engine.Engine``: integrator and
model step on the device, CUDA graph, NVT = ASE's Langevin scheme, NPT = CSVR + stochastic cell rescaling),
cgforge-engine-compiled (the same with ``Calculator(compile=True)``; compilation is in ``<ensemble>_first_step_s``),
cgforge-ase (our Calculator under ASE's Langevin: NVT only) and fastmace (FastMACE in a process of its own,
``fastmace_md.py``: MACE models, FP32; its setup time is reported apart).
Ablations are options, not backends: ``--calculator KEY=VALUE`` passes a keyword to every cgforge Calculator
(``radial_table=false``, ``cuda_graph=false``, ``streaming=true``, ``radial_precision=3xtf32``, ``patch=false``,
``filter_edges=false``, ...), ``--engine KEY=VALUE`` a field of every Engine's ``EngineOptions`` (``fuse_integrator=true``), and
``--kernel-tuning FILE.json`` the kernels' ``KernelTuning`` (row chunks too: ``{"rows": {...}}``); the JSON records
them.
--md-steps / --md-warmup (default 100 steps, every backend alike) / --ensembles set the whole-MD runs. --skin sets the Verlet skin of our calculator. --profile prints a torch.profiler summary of
cgforge's NVT step (kernels by category, then the top kernels) for every cgforge backend measured.
An engine row's ``<ensemble>_timed`` counts what its timed steps held (blocks, rebuilds, captures and why, growths,
discarded steps): a capture inside them is a cost a steady step does not pay.
After each engine run's timed steps, ``DEVICE_STEPS`` more are profiled (CUDA activity only): the row prints the
device's idle time per step (no kernel or copy running on any stream; ``common.device_timeline``) and the kernels
per step (``<ensemble>_device`` in the JSON).
Beside each FP32 row of a water system and a model ``step_floor.py`` knows (not nequip-l1), the table prints
that model's floor at the row's atom count (``floor_ms``: the lower bound of one energy + forces step at the measured
GPU's DRAM bandwidth, L2 bandwidth (step_floor.py's estimate) and FP32 peak (``step_floor.device_rates``; the H100
SXM's on a CPU), counted on the CPU once per model and
atom count) and ``floor_fraction`` = floor_ms / the measured NVT step (1 would be the hardware's limit); --no-floor skips them.
The table is printed last; JSON goes to benchmarks/results/ (or $OUT).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import (  # noqa: E402
    device_spans,
    device_timeline,
    environment,
    peers,
    write_json,
)
from shapes import dhfr_atoms, mace_mp_file, nequip_shape  # noqa: E402

from cgforge.plugin.calculator import Calculator  # noqa: E402
from cgforge.plugin.cli.md import MD_SKIN  # noqa: E402
from cgforge.plugin.runtime.neighbours import neighbour_list  # noqa: E402
from cgforge.plugin.water import water_box  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEVICE = "cuda"  # --device cpu: a smoke run of the script itself, not a measurement
WATER = {"1k": 7, "5k": 12, "20k": 19, "50k": 26, "100k": 32, "200k": 41, "500k": 55, "1m": 70}
MODELS = ("mace-mp-medium", "nequip-l1", "nequip-M", "bundled-mace", "bundled-nequip")
BACKENDS = ("cgforge", "cgforge-compiled", "e3nn", "cueq", "oeq", "cgforge-engine", "cgforge-engine-compiled",
            "cgforge-ase", "fastmace")
MD_BACKENDS = ("cgforge-engine", "cgforge-engine-compiled", "cgforge-ase", "fastmace")  # whole MD steps
ENGINE_BACKENDS = {"cgforge-engine": {}, "cgforge-engine-compiled": {"compile": True}}
# warm-up: past a run's start (captures, the first capacity growths of the edge buffers: MACE-MP-medium's NVT
# discarded 11 steps to them inside a 20-step warm-up's timed window), for every backend alike
MD = {"steps": 200, "warmup": 100, "ensembles": ("nvt", "npt"), "timestep_fs": 0.5, "temperature_K": 300.0,
      "friction_per_fs": 0.01}
CGFORGE_OPTIONS = {"cgforge": {}, "cgforge-compiled": {"compile": True}}
CALCULATOR: dict = {}  # --calculator KEY=VALUE: keywords of every cgforge Calculator (ablations)
ENGINE: dict = {}  # --engine KEY=VALUE: keywords of every Engine
SKIN = MD_SKIN  # `cgforge md`'s: the step a user's run takes
TIMED_STATS = ("blocks", "rebuilds", "captures", "grows", "discarded")  # engine.stats counted over the timed steps
DEVICE_STEPS = 40  # engine steps profiled after the timed ones, for the device's idle time and kernels per step
LONG_GAP_US = 20.0  # an idle gap this long is a host wait (a graph's own launch gaps are a few us)
PROFILE = False
NVT_ONLY = False  # --nvt-only: energy + forces steps and peak memory only (capacity runs of large boxes)
TUNING = None  # --kernel-tuning FILE.json: the cgforge backends' KernelTuning (None: the defaults)
NEQUIP_TYPES = ["H", "C", "N", "O", "S"]  # DHFR's elements; water uses two of them
NEQUIP_SHAPES = {"nequip-l1": "l1", "nequip-M": "M"}
STAGE = {"now": ""}  # what measure() was doing: an out-of-memory row names it
# bench_md's model -> step_floor.py's (the same shapes; nequip-l1 has no floor there)
FLOOR_MODELS = {"mace-mp-medium": "mace-mp-medium", "bundled-mace": "bundled-mace", "bundled-nequip": "bundled-nequip",
                "nequip-M": "nequip-M"}
_FLOORS: dict[tuple[str, int], float | None] = {}  # (model, atoms) -> floor ms: each counted once per run


# ---------------------------------------------------------------------------------------------
# Systems and models


def check_system(name: str) -> None:
    """Exit naming `name` unless it is a system this script builds (before any model is made)."""
    if not (name in WATER or name.isdigit() or name == "dhfr"):
        sys.exit(f"--systems: unknown system {name!r}; choose from {[*WATER, 'dhfr']} or a molecule count")


def system(name: str):
    check_system(name)
    if name == "dhfr":
        return dhfr_atoms()
    # a named box, or that many molecules (small ones for a CPU smoke run)
    return water_box(n_side=WATER[name]) if name in WATER else water_box(int(name))


def nequip_model(shape: str, dtype: str, modifier: str | None = None) -> torch.nn.Module:
    model = nequip_shape(NEQUIP_SHAPES[shape], dtype, tuple(NEQUIP_TYPES))
    if modifier:
        from nequip.model.modify_utils import modify

        model = modify(model, [{"modifier": modifier}])
    return model.eval()


def bundled(kind: str) -> Path:
    from cgforge.plugin.runtime.bundled import model_path

    path = Path(model_path(kind))
    if not path.is_file():
        raise FileNotFoundError(f"bundled {kind} model {path} missing")
    return path


# ---------------------------------------------------------------------------------------------
# Calculators


def make_calculator(model_name: str, backend: str, dtype: str, files: dict, stress: bool):
    """(ASE calculator, computes_stress_always) for one model x backend x dtype."""
    if backend.startswith("cgforge"):
        if model_name == "mace-mp-medium":
            source = files["mace-mp-medium", dtype]
        elif model_name.startswith("nequip-"):
            source = nequip_model(model_name, dtype)
        else:
            source = bundled(model_name.split("-")[1])
        if CGFORGE_OPTIONS[backend].get("compile"):
            torch._dynamo.reset()  # a fresh compilation per measurement (and the recompile limit not reached)
        calc = Calculator(source, device=DEVICE, dtype=dtype if not model_name.startswith("nequip") else None,
                          stress_with_forces=stress, skin=SKIN, **calculator_options(CGFORGE_OPTIONS[backend]))
        return calc, False
    if model_name in ("mace-mp-medium", "bundled-mace"):
        from mace.calculators import MACECalculator

        path = files["mace-mp-medium", dtype] if model_name == "mace-mp-medium" else bundled("mace")
        kw = {"enable_cueq": backend == "cueq", "enable_oeq": backend == "oeq"}
        return MACECalculator(model_paths=str(path), device=DEVICE, default_dtype=dtype, **kw), True
    from nequip.data.transforms import ChemicalSpeciesToAtomTypeMapper, NeighborListTransform
    from nequip.integrations.ase import NequIPCalculator

    modifier = {"e3nn": None, "oeq": "enable_OpenEquivariance", "cueq": "enable_CuEquivariance"}[backend]
    if model_name == "bundled-nequip":
        from cgforge.patches.nequip import load_models as _load_models

        model = _load_models(bundled("nequip"))["sole_model"].eval()
        if modifier:
            from nequip.model.modify_utils import modify

            model = modify(model, [{"modifier": modifier}])
    else:
        model = nequip_model(model_name, dtype, modifier)
    types = model.type_names
    calc = NequIPCalculator(model.to(DEVICE), device=DEVICE, transforms=[
        ChemicalSpeciesToAtomTypeMapper(model_type_names=types, chemical_species_to_atom_type_map={t: t for t in types}),
        NeighborListTransform(r_max=float(model.metadata["r_max"]))])
    return calc, True


# ---------------------------------------------------------------------------------------------
# Timing


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def peak_gb() -> float:
    return torch.cuda.max_memory_allocated() / 1e9 if DEVICE == "cuda" else float("nan")


def reset_memory() -> None:
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def time_steps(atoms, steps: int, warmup: int, props: tuple[str, ...], seed: int = 1) -> list[float]:
    rng = np.random.default_rng(seed)
    p0 = atoms.get_positions().copy()
    times = []
    for i in range(warmup + steps):
        atoms.set_positions(p0 + 0.01 * rng.normal(size=p0.shape))
        sync()
        start = time.perf_counter()
        for prop in props:
            atoms.calc.get_property(prop, atoms)
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    atoms.set_positions(p0)
    return times


def measure(model_name: str, backend: str, dtype: str, atoms, files: dict, steps: int, warmup: int) -> dict:
    row: dict = {"model": model_name, "backend": backend, "dtype": dtype, "atoms": len(atoms)}
    reset_memory()
    t = time.perf_counter()
    calc, always_stress = make_calculator(model_name, backend, dtype, files, stress=False)
    row["setup_s"] = time.perf_counter() - t
    a = atoms.copy()
    a.calc = calc
    sync()
    t = time.perf_counter()
    STAGE["now"] = "the first forces call"
    a.calc.get_property("forces", a)  # the first call: CUDA-graph capture, and torch.compile when asked for
    sync()
    row["first_call_s"] = time.perf_counter() - t
    STAGE["now"] = "the NVT steps"
    nvt = time_steps(a, steps, warmup, ("forces", "energy"))
    row["nvt_s"] = float(np.median(nvt))
    row["peak_gb_nvt"] = peak_gb()
    a.calc.get_property("energy", a)
    row["energy"] = float(a.calc.results["energy"])
    if always_stress:  # the peer computes stress on every call: its NVT step is its NPT step
        row["npt_s"] = row["nvt_s"]
        row["peak_gb"] = row["peak_gb_nvt"]
        if hasattr(calc, "_atoms_to_batch"):
            row.update(mace_peer_breakdown(calc, a))
    else:
        row["edges"] = calc.n_edges
        row["streaming"] = bool(calc.streaming)
        row["spatial_order"] = calc.system is not None and calc.system.order is not None
        row["cuda_graph"] = bool(calc.cuda_graph)
        row["capture_error"] = calc.step.capture_error
        row["model_edge_slots"] = calc.step.capacity
        row["radial_precision"] = calc.radial_precision
        row["radial_table"] = getattr(calc, "radial_table", None)
        row["radial_precision_error"] = calc.radial_precision_error
        row["compile"] = calc.compile
        row["compile_error"] = calc.step.compile_error
        if PROFILE:
            row["profile"] = profile_steps(a, f"{model_name} {backend} {dtype} {len(atoms)} atoms")
        if NVT_ONLY:
            del calc, a
            gc.collect()
            reset_memory()
            return row
        calc.record_timings(True)
        timed = 5
        total = sum(time_steps(a, timed, 0, ("forces", "energy"), seed=2))
        seconds = dict(calc.timings.seconds)
        calc.record_timings(False)
        row["breakdown_nvt"] = {k: v / timed for k, v in seconds.items()}
        row["breakdown_nvt"]["other"] = total / timed - sum(row["breakdown_nvt"].values())
        STAGE["now"] = "a second neighbour list (timing its build)"
        row["nl_build_s"] = nl_build_seconds(calc, a)
        STAGE["now"] = "the NPT steps (stress)"
        calc.stress_with_forces = True
        reset_memory()
        npt = time_steps(a, steps, warmup, ("forces", "energy"), seed=3)
        assert "stress" in calc.results
        row["npt_s"] = float(np.median(npt))
        row["peak_gb"] = peak_gb()
        row["n_builds"] = calc.neighbours.n_builds
    del calc, a
    gc.collect()
    reset_memory()
    return row


def md_atoms(atoms, dtype: str, device: str | None = None):
    """The box relaxed by 50 FIRE steps of the bundled MACE model on ``device`` (default: the benchmark's) (the
    generated box starts far from equilibrium and would heat by ~1000 K), with Maxwell-Boltzmann momenta at 300 K,
    zero total momentum."""
    from ase.md.velocitydistribution import MaxwellBoltzmannDistribution, Stationary
    from ase.optimize import FIRE

    a = atoms.copy()
    a.calc = Calculator(bundled("mace"), device=device or DEVICE, dtype=dtype, skin=SKIN)
    FIRE(a, logfile=None).run(fmax=0.2, steps=50)
    a.calc = None
    MaxwellBoltzmannDistribution(a, temperature_K=MD["temperature_K"], rng=np.random.default_rng(0))
    Stationary(a)
    return a


def fp32_source(model_name: str, folder: Path):
    """What a Calculator loads for one of MODELS in FP32, outside a bench_md run (tuning_ab.py, profile_engine.py):
    the MACE-MP-medium shape written into ``folder``, a NequIP preset built in FP32, or a bundled model's path."""
    if model_name == "mace-mp-medium":
        return mace_mp_file(folder, "float32")
    return _md_source(model_name, "float32", {})


def _md_source(model_name: str, dtype: str, files: dict):
    if model_name == "mace-mp-medium":
        return files["mace-mp-medium", dtype]
    if model_name.startswith("nequip-"):
        return nequip_model(model_name, dtype)
    return bundled(model_name.split("-")[1])


def _ns_per_day(seconds_per_step: float) -> float:
    return MD["timestep_fs"] * 1e-6 * 86400.0 / seconds_per_step


def measure_md(model_name: str, backend: str, dtype: str, atoms, files: dict) -> dict:
    """Seconds per whole MD step (median-free: wall time of ``MD['steps']`` steps after ``MD['warmup']``)."""
    row: dict = {"model": model_name, "backend": backend, "dtype": dtype, "atoms": len(atoms), "md": True}
    if backend == "fastmace":
        return row | fastmace_md(model_name, dtype, atoms, files)
    from ase import units
    from ase.md.langevin import Langevin as AseLangevin

    from cgforge.plugin.md.engine import Engine
    reset_memory()
    options = calculator_options(ENGINE_BACKENDS.get(backend, {}))
    if options.get("compile") or ENGINE.get("fuse_integrator"):
        torch._dynamo.reset()  # a fresh compilation per measurement (and the recompile limit not reached)
    t = time.perf_counter()
    calc = Calculator(_md_source(model_name, dtype, files), device=DEVICE,
                      dtype=dtype if not model_name.startswith("nequip") else None, skin=SKIN, **options)
    row["setup_s"] = time.perf_counter() - t
    row["radial_table"] = calc.radial_table
    dt, temp, fr = MD["timestep_fs"], MD["temperature_K"], MD["friction_per_fs"]
    for ensemble in MD["ensembles"]:
        a = atoms.copy()
        a.calc = calc
        if backend == "cgforge-ase":
            if ensemble != "nvt":
                continue
            dyn = AseLangevin(a, dt * units.fs, temperature_K=temp, friction=fr / units.fs,
                              rng=np.random.default_rng(1), fixcm=False)
            t = time.perf_counter()
            dyn.run(MD["warmup"])
            run = dyn.run
        else:
            integrator = md_integrator(ensemble)
            invalidated = Counter(calc.step.invalidations)
            engine = Engine(calc, a, integrator, seed=1, max_temperature_K=float("inf"), **ENGINE)
            sync()
            t = time.perf_counter()
            engine.run(1)  # the first step: CUDA-graph capture, and torch.compile when asked for (apart)
            sync()
            row[f"{ensemble}_first_step_s"] = time.perf_counter() - t
            t = time.perf_counter()
            engine.run(MD["warmup"])
            run = engine.run
        sync()
        row[f"{ensemble}_warmup_s"] = time.perf_counter() - t
        timed_from = (dict(engine.stats), Counter(calc.step.invalidations)) if backend in ENGINE_BACKENDS else None
        reset_memory()
        t = time.perf_counter()
        run(MD["steps"])
        sync()
        row[f"{ensemble}_s"] = (time.perf_counter() - t) / MD["steps"]
        if timed_from is not None:  # what the timed steps held beyond steady steps: captures, rebuilds, growths
            stats, invalidations = timed_from
            row[f"{ensemble}_timed"] = {**{k: engine.stats[k] - stats[k] for k in TIMED_STATS},
                                        "invalidations": dict(calc.step.invalidations - invalidations)}
        row[f"{ensemble}_ns_per_day"] = _ns_per_day(row[f"{ensemble}_s"])
        row["peak_gb"] = max(row.get("peak_gb", 0.0), peak_gb())
        if backend in ENGINE_BACKENDS:
            row[f"{ensemble}_stats"] = dict(engine.stats)  # before the profiled steps, as before them
            if DEVICE == "cuda":
                row[f"{ensemble}_device"] = device_use(engine, DEVICE_STEPS)
            # why the step's graphs were recaptured during this ensemble's run (each costs a capture)
            row[f"{ensemble}_invalidations"] = dict(calc.step.invalidations - invalidated)
            row["cuda_graph"] = engine.cuda_graph
            row["capture_error"] = engine.capture_error
            row["compile"] = calc.compile
            row["compile_error"] = calc.step.compile_error
            row["fuse_integrator"] = engine.fuse_integrator
            del engine
        gc.collect()
    del calc
    gc.collect()
    reset_memory()
    return row


def md_integrator(ensemble: str):
    """The engine integrator of an ``ensemble`` of the whole-MD runs (``MD``'s timestep, temperature, friction):
    nvt ASE's Langevin scheme, npt CSVR + stochastic cell rescaling at 1 bar (tau_p 1,000 fs)."""
    from cgforge.plugin.md.integrators import Langevin, StochasticCellRescaling

    dt, temp = MD["timestep_fs"], MD["temperature_K"]
    if ensemble == "nvt":
        return Langevin(dt, temp, MD["friction_per_fs"])
    return StochasticCellRescaling(dt, temp, 1e-4, tau_p_fs=1000.0)


# Where each mark is recorded (on the engine's stream, at the method's entry) and what it stands for: "start" before a
# block (or an out-of-block rebuild) queues anything; "end" when a block's work is all queued (its report read);
# "search" when the pipelined search begins (the block's steps queued); "install" before a list is installed.
EVENT_MARKS = (("engine", "_run_block", "start"), ("engine", "_rebuild", "start"), ("engine", "_read_report", "end"),
               ("provider", "search", "search"), ("provider", "install", "install"))


def event_gaps(marks: list[tuple[str, object]]) -> dict[str, list[float]]:
    """The device's idle ms between consecutive marks with nothing queued on the engine's stream between them
    (``marks``: (kind, event) in the order recorded; ``event.elapsed_time(later)`` in ms): "boundary", from each "end"
    to the next mark (the host reading the report and planning what comes next); "search", from each "search" to the
    next mark (the engine's stream idle while the host searched, where the search outlasted the steps queued before
    it; the search's own kernels may run meanwhile, on their stream)."""
    gaps: dict[str, list[float]] = {"boundary": [], "search": []}
    for (kind, event), (_, next_event) in zip(marks, marks[1:]):
        if kind == "end":
            gaps["boundary"].append(event.elapsed_time(next_event))
        elif kind == "search":
            gaps["search"].append(event.elapsed_time(next_event))
    return gaps


def event_idle(engine, steps: int, new_event=None) -> tuple[float, dict[str, list[float]]]:
    """Wall seconds of ``steps`` engine steps with no profiler and no timers, and ``event_gaps`` of the CUDA events
    recorded at ``EVENT_MARKS`` (``new_event``: makes a recordable event, a CUDA one by default)."""
    new_event = new_event or (lambda: torch.cuda.Event(enable_timing=True))
    marks: list[tuple[str, object]] = []

    def marked(kind, fn):
        def wrapper(*a, **k):
            event = new_event()
            event.record()
            marks.append((kind, event))
            return fn(*a, **k)
        return wrapper

    owners = {"engine": engine, "provider": engine.provider}
    undo = []
    for owner, name, kind in EVENT_MARKS:
        target = owners[owner]
        if callable(getattr(target, name, None)):
            setattr(target, name, marked(kind, getattr(target, name)))
            undo.append((target, name))
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    try:
        sync()
        t = time.perf_counter()
        engine.run(steps)
        sync()
        wall = time.perf_counter() - t
    finally:
        for target, name in undo:
            delattr(target, name)  # the instance attribute shadowed the class's method
    return wall, event_gaps(marks)


def device_use(engine, steps: int) -> dict:
    """The device's idle time and kernels per step over ``steps`` more engine steps, profiled (torch.profiler's
    CUDA activity; ``common.device_timeline``): idle = no kernel or copy running between the first and the last;
    gap_idle of it in gaps of at least ``LONG_GAP_US`` (the host's waits: block boundaries, not launch gaps). The
    profiler slows the host's launches, so these are upper bounds; then ``steps`` more unprofiled with CUDA events
    (``event_idle``): boundary_idle_ms and search_idle_ms, the device's idle a step at block boundaries and behind
    the pipelined search, as a run without the profiler has them."""
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.run(steps)
        sync()
    line = device_timeline(device_spans(prof), steps)
    long_gaps = sum(gap for gap in line["gaps_us"] if gap >= LONG_GAP_US) / steps / 1e3
    _, gaps = event_idle(engine, steps)
    return {**{k: line[k] for k in ("wall_ms", "busy_ms", "idle_ms", "kernels", "activities")}, "gap_idle_ms": long_gaps,
            "boundary_idle_ms": sum(gaps["boundary"]) / steps, "search_idle_ms": sum(gaps["search"]) / steps}


def fastmace_md(model_name: str, dtype: str, atoms, files: dict) -> dict:
    """FastMACE in a subprocess per ensemble (it patches MACE on import)."""
    import json
    import subprocess

    from ase.io import write

    if model_name not in ("mace-mp-medium", "bundled-mace"):
        return {"error": "FastMACE runs MACE models only"}
    if dtype != "float32":
        return {"error": "FastMACE runs float32"}
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "atoms.traj"
        write(str(path), atoms)
        for ensemble in MD.get("fastmace_ensembles", MD["ensembles"]):
            cmd = [sys.executable, str(Path(__file__).with_name("fastmace_md.py")),
                   str(_md_source(model_name, dtype, files)), str(path), "--ensemble", ensemble,
                   "--steps", str(MD["steps"]), "--warmup", str(MD["warmup"]), "--timestep", str(MD["timestep_fs"]),
                   "--temperature", str(MD["temperature_K"]), "--friction", str(MD["friction_per_fs"])]
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
                lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
                child = json.loads(lines[-1]) if lines else {"error": f"no result (rc {done.returncode}): "
                                                                      f"{done.stderr[-300:]}"}
            except subprocess.TimeoutExpired:
                child = {"error": "timed out after 600 s"}
            if "error" in child:
                out[f"{ensemble}_error"] = child["error"]
                continue
            out[f"{ensemble}_s"] = child["s_per_step"]
            out[f"{ensemble}_ns_per_day"] = _ns_per_day(child["s_per_step"])
            out[f"{ensemble}_setup_s"] = child["setup_s"]
            out["peak_gb"] = max(out.get("peak_gb", 0.0), child["peak_gb"])
            out["fastmace"] = child.get("fastmace")
            out["plan"] = child.get("plan")
    if not any(k.endswith("_s") for k in out):
        return {"error": "; ".join(f"{k}: {v}" for k, v in out.items() if k.endswith("_error"))}
    return out


def kernel_category(name: str) -> str:
    low = name.lower()
    rules = (("cgf_sc_", "symmetric contraction (cgforge)"), ("cgf_", "convolution (cgforge)"),
             ("gemm", "GEMM"), ("xmma", "GEMM"), ("cutlass", "GEMM"), ("sort", "sort"), ("radix", "sort"),
             ("scatter", "index/scatter/gather"), ("index", "index/scatter/gather"), ("gather", "index/scatter/gather"),
             ("reduce", "reduction"), ("cat", "copy/cat"), ("copy", "copy/cat"), ("memcpy", "copy/cat"),
             ("memset", "copy/cat"), ("fill", "elementwise"), ("elementwise", "elementwise"))
    for key, category in rules:
        if key in low:
            return category
    return "other"


def profile_steps(atoms, label: str, steps: int = 3) -> dict:
    """torch.profiler over `steps` NVT steps: GPU time per kernel category and the top kernels (printed)."""
    from torch.profiler import ProfilerActivity, profile

    rng = np.random.default_rng(5)
    p0 = atoms.get_positions().copy()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for _ in range(steps):
            atoms.set_positions(p0 + 0.01 * rng.normal(size=p0.shape))
            atoms.calc.get_property("forces", atoms)
        sync()
    atoms.set_positions(p0)
    kernels: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name] = kernels.get(event.name, 0.0) + event.device_time / 1000.0 / steps  # ms per step
    categories: dict[str, float] = {}
    for name, ms in kernels.items():
        categories[kernel_category(name)] = categories.get(kernel_category(name), 0.0) + ms
    total = sum(kernels.values())
    print(f"\n## profile: {label}: GPU kernel time {total:.2f} ms per step ({len(kernels)} distinct kernels)")
    for category, ms in sorted(categories.items(), key=lambda kv: -kv[1]):
        print(f"  {category:34s} {ms:8.3f} ms  {100 * ms / max(total, 1e-9):5.1f} %")
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:20]
    print("  top kernels (ms per step):")
    for name, ms in top:
        print(f"    {ms:8.3f}  {name[:110]}")
    try:
        table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=60)
    except (AttributeError, KeyError, ValueError):
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30)
    print("  by op (all steps together):")
    print(table, flush=True)
    try:  # the same by input shape: which tensors the elementwise and GEMM time is spent on
        shapes = prof.key_averages(group_by_input_shape=True).table(
            sort_by="self_device_time_total", row_limit=40, max_name_column_width=40, max_shapes_column_width=70
        )
        print("  by op and input shape (all steps together):")
        print(shapes, flush=True)
    except (AttributeError, KeyError, ValueError, TypeError) as error:
        print(f"  (no by-shape table: {error})")
    return {"gpu_ms": total, "categories": categories, "top": top}


def nl_build_seconds(calc: Calculator, atoms) -> float:
    positions = torch.as_tensor(atoms.positions, dtype=calc.dtype, device=DEVICE)
    cell = torch.as_tensor(np.array(atoms.cell), dtype=calc.dtype, device=DEVICE)
    pbc = tuple(bool(p) for p in atoms.pbc)
    times = []
    for _ in range(4):
        sync()
        t = time.perf_counter()
        neighbour_list(positions, cell, pbc, calc.neighbours.list_cutoff)
        sync()
        times.append(time.perf_counter() - t)
    return float(np.median(times[1:]))


def mace_peer_breakdown(calc, atoms) -> dict:
    """MACECalculator: its CPU batch preparation and the model call (with stress, as it always asks)."""
    prep, model = [], []
    for _ in range(3):
        sync()
        t = time.perf_counter()
        batch = calc._atoms_to_batch(atoms)
        sync()
        prep.append(time.perf_counter() - t)
        data = calc._clone_batch(batch).to_dict()
        t = time.perf_counter()
        calc.models[0](data, compute_stress=True, training=False)
        sync()
        model.append(time.perf_counter() - t)
    return {"breakdown_nvt": {"batch_prep": float(np.median(prep)), "model_with_stress": float(np.median(model))}}


# ---------------------------------------------------------------------------------------------
# The step's floor (issue 38)


def _one_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {' '.join(str(err).split())[:200]}"


def floor_settings(device: str) -> dict | None:
    """What the floors assume: the rates of the GPU the run measures (``step_floor.device_rates``: what it reports,
    else its data sheet's) on CUDA, the H100 SXM's otherwise; None (and a note) when step_floor cannot be imported."""
    try:  # imported here: a broken step_floor.py costs the floors, never the run
        import step_floor

        rates = step_floor.KNOWN_RATES["h100"]
        if device.startswith("cuda") and torch.cuda.is_available():
            rates = step_floor.device_rates(torch.device(device).index or 0)
        return {"bandwidth_gbs": rates.hbm_gbs, "tflops": rates.tflops, "l2_gbs": rates.l2_gbs,
                "rates": rates.name, "sources": dict(rates.sources), "radial": "table", "dtype": "float32",
                "system": "water_box(n_molecules=atoms // 3)"}
    except Exception as err:
        print(f"no step floors: {_one_line(err)}", flush=True)
        return None


def step_floor_ms(model_name: str, atoms: int, settings: dict) -> float | None:
    """The floor (ms) of `model_name`'s step on a water box of `atoms` atoms, counted once per run (the edge count of
    a 1 M-atom box takes ~100 s on the CPU); None for a model step_floor.py does not know or whose count raised."""
    key = (model_name, atoms)
    if key not in _FLOORS:
        _FLOORS[key] = None
        name = FLOOR_MODELS.get(model_name)
        if name is not None:
            try:
                import step_floor

                result = step_floor.step_floor(name, atoms, settings["bandwidth_gbs"] * 1e9, settings["tflops"],
                                               radial=settings["radial"], l2_bandwidth=settings["l2_gbs"] * 1e9)
                _FLOORS[key] = float(result["total_floor_ms"])
            except Exception as err:  # the floor is a comment on the measurement: it must not stop the run
                print(f"no step floor for {model_name} at {atoms} atoms: {_one_line(err)}", flush=True)
    return _FLOORS[key]


def add_floor(row: dict, system_name: str, settings: dict | None) -> None:
    """Put ``floor_ms`` and ``floor_fraction`` (floor / measured NVT step) in a measured FP32 row of a water box."""
    # the floor is FP32 and counts a water box's edges (DHFR's differ); settings None: --no-floor or no step_floor
    if settings is None or row.get("dtype") != "float32" or "error" in row or system_name == "dhfr":
        return
    ms = step_floor_ms(row["model"], row["atoms"], settings)
    if ms is None:
        return
    measured = row.get("nvt_s")  # the force step (or the whole MD step): both do at least the floor's work
    row["floor_ms"] = ms
    row["floor_fraction"] = ms / (1000.0 * measured) if isinstance(measured, float) and measured > 0 else None


# ---------------------------------------------------------------------------------------------
# Main


_PEERS: dict | None = None


def available_backends(requested: list[str], model_name: str) -> list[str]:
    global _PEERS
    if _PEERS is None:
        _PEERS = peers()
    found = _PEERS
    out = []
    for b in requested:
        if b in ("cueq", "oeq") and b not in found:
            continue
        out.append(b)
    return out


def calculator_options(backend: dict) -> dict:
    """A cgforge backend's Calculator keywords: its own, --calculator's and --kernel-tuning's."""
    return {**CALCULATOR, **backend, **({} if TUNING is None else {"tuning": TUNING})}


# set by bench_md itself or by a backend: not an ablation --calculator / --engine may change
FIXED = {"calculator": ("model", "device", "dtype", "skin", "stress_with_forces", "tuning", "compile"),
         "engine": ()}


def keyword_options(flag: str, given: list[str], target) -> dict:
    """``KEY=VALUE`` strings as keywords of ``target`` (the Calculator or EngineOptions): VALUE read as JSON (true, 0.5,
    null), else kept as text (3xtf32); exits naming ``flag`` for a malformed item or a keyword ``target`` lacks."""
    import inspect

    known = [k for k in inspect.signature(target).parameters if k not in (*FIXED[flag], "self", "kwargs")]
    options = {}
    for item in given:
        key, sep, text = item.partition("=")
        if not sep or key not in known:
            sys.exit(f"--{flag}: expected KEY=VALUE with KEY one of {', '.join(known)}; got {item!r}")
        try:
            options[key] = json.loads(text)
        except ValueError:
            options[key] = text
    return options


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", default="1k,5k,20k,50k,dhfr")
    parser.add_argument("--models", default="mace-mp-medium,nequip-l1,nequip-M")
    parser.add_argument("--dtypes", default="float32,float64")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--steps", type=int, default=10, help="timed steps per measurement (median)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cuda", help="cpu only to smoke-test this script")
    parser.add_argument("--skin", type=float, default=MD_SKIN,
                        help=f"Verlet skin (Å) of cgforge's calculator (default {MD_SKIN:g}, `cgforge md`'s)")
    parser.add_argument("--profile", action="store_true", help="profile cgforge's NVT step (torch.profiler)")
    parser.add_argument("--nvt-only", action="store_true",
                        help="energy + forces steps and peak memory only (no breakdown, no NPT): large boxes")
    parser.add_argument("--md-steps", type=int, default=MD["steps"], help="timed steps of the whole-MD backends")
    parser.add_argument("--md-warmup", type=int, default=MD["warmup"], help="steps before timing (captures)")
    parser.add_argument("--ensembles", default="nvt,npt", help="whole-MD backends: nvt, npt or both")
    parser.add_argument("--fastmace-ensembles", default=None,
                        help="FastMACE's ensembles (default: --ensembles; each costs a ~1 min setup)")
    parser.add_argument("--no-floor", action="store_true",
                        help="no step floor (step_floor.py, counted on the CPU) beside the FP32 rows")
    parser.add_argument("--calculator", action="append", default=[], metavar="KEY=VALUE",
                        help="a keyword of every cgforge Calculator, e.g. radial_table=false (repeatable)")
    parser.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE",
                        help="a keyword of every Engine, e.g. fuse_integrator=true (repeatable)")
    parser.add_argument("--kernel-tuning", default=None, metavar="FILE.json",
                        help="the cgforge backends' kernel tuning, as `cgforge md --kernel-tuning` reads it "
                             "(e.g. {\"harmonics\": true}); default: the defaults")
    args = parser.parse_args(argv)
    MD.update(steps=args.md_steps, warmup=args.md_warmup, ensembles=tuple(args.ensembles.split(",")),
              fastmace_ensembles=tuple((args.fastmace_ensembles or args.ensembles).split(",")))
    for ensemble in (*MD["ensembles"], *MD["fastmace_ensembles"]):
        if ensemble not in ("nvt", "npt"):
            sys.exit(f"--ensembles: expected nvt and/or npt, got {ensemble!r}")
    global DEVICE, SKIN, PROFILE, NVT_ONLY, TUNING
    NVT_ONLY = args.nvt_only
    from cgforge.plugin.md.options import EngineOptions

    CALCULATOR.update(keyword_options("calculator", args.calculator, Calculator))
    ENGINE.update(keyword_options("engine", args.engine, EngineOptions))
    if args.kernel_tuning is not None:
        from cgforge.kernels import KernelTuning

        try:
            TUNING = KernelTuning.from_dict(json.loads(Path(args.kernel_tuning).read_text()))
        except (OSError, ValueError) as err:
            sys.exit(f"--kernel-tuning: {args.kernel_tuning}: {err}")
    DEVICE = args.device
    SKIN = args.skin
    PROFILE = args.profile
    if DEVICE == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_md.py needs a CUDA GPU (or --device cpu for a smoke run)")
    systems = args.systems.split(",")
    for name in systems:
        check_system(name)
    unknown = set(args.backends.split(",")) - set(BACKENDS)
    if unknown:
        sys.exit(f"--backends: unknown {sorted(unknown)}; choose from {', '.join(BACKENDS)} (ablations: --calculator, "
                 "--engine, --kernel-tuning)")
    models = args.models.split(",")
    for m in models:
        if m not in MODELS:
            sys.exit(f"--models: unknown {m!r}; choose from {MODELS}")
    floors = None if args.no_floor else floor_settings(args.device)
    tmp = Path(tempfile.mkdtemp())
    files = {}
    rows = []
    env = environment()
    payload = {"environment": env, "rows": rows, "args": vars(args), "floor": floors,
               "kernel_tuning": None if TUNING is None else TUNING.describe()}
    path = None
    for dtype in args.dtypes.split(","):
        if "mace-mp-medium" in models:
            files["mace-mp-medium", dtype] = mace_mp_file(tmp, dtype)
        for sysname in systems:
            atoms = system(sysname)
            relaxed = None
            for model_name in models:
                for backend in available_backends(args.backends.split(","), model_name):
                    try:
                        STAGE["now"] = ""
                        if backend in MD_BACKENDS:
                            relaxed = relaxed if relaxed is not None else md_atoms(atoms, dtype)
                            row = measure_md(model_name, backend, dtype, relaxed, files)
                        else:
                            row = measure(model_name, backend, dtype, atoms, files, args.steps, args.warmup)
                    except torch.cuda.OutOfMemoryError:
                        row = {"model": model_name, "backend": backend, "dtype": dtype, "atoms": len(atoms),
                               "error": f"out of GPU memory in {STAGE['now'] or 'the run'}"}
                    except Exception as err:  # a peer failing must not stop the others
                        row = {"model": model_name, "backend": backend, "dtype": dtype, "atoms": len(atoms),
                               "error": f"{type(err).__name__}: {str(err)[:200]}"}
                    gc.collect()
                    reset_memory()
                    row["system"] = sysname
                    add_floor(row, sysname, floors)
                    rows.append(row)
                    print(row, flush=True)
                    path = write_json("md", payload, path)
    path = write_json("md", payload, path)
    print_table(rows, env, path, floors)


def print_table(rows: list[dict], env: dict, path: Path, floors: dict | None = None) -> None:
    print(f"\n{env.get('device', '?')}, torch {env['torch']}, {env['date']}; JSON: {path}")
    print("seconds per MD step (median); NVT = energy+forces, NPT = +stress; breakdown of cgforge's NVT step in ms")
    print(f"backends {', '.join(MD_BACKENDS)}: whole MD steps (integrator included), {MD['timestep_fs']} fs, "
          f"mean over {MD['steps']} steps; the others: one force call through ASE")
    if floors is not None:
        print(f"floor: step_floor.py's lower bound of the energy + forces step (FP32, radial {floors['radial']}, "
              f"water box) at {floors['bandwidth_gbs']:.0f} GB/s, L2 {floors['l2_gbs']:.0f} GB/s and "
              f"{floors['tflops']:.1f} TFLOP/s ({floors.get('rates', 'H100 SXM')}), ms; reached = floor / NVT s")
    head = (f"{'system':7s} {'atoms':>6s} {'model':15s} {'dtype':7s} {'backend':18s} {'NVT s':>8s} {'NPT s':>8s} "
            f"{'peak GB':>8s} {'floor ms':>9s} {'reached':>7s}  breakdown")
    print(head)
    print("-" * len(head))
    for r in rows:
        prefix = f"{r['system']:7s} {r['atoms']:6d} {r['model']:15s} {r['dtype']:7s} {r['backend']:18s}"
        if "error" in r:
            print(f"{prefix} {r['error']}")
            continue
        if r.get("md"):
            print(f"{prefix} {_cell(r.get('nvt_s'))} {_cell(r.get('npt_s'))} {r.get('peak_gb', float('nan')):8.2f} "
                  f"{floor_cells(r)}  " + md_details(r))
            continue
        parts = " ".join(f"{k}={1000 * v:.1f}" for k, v in r.get("breakdown_nvt", {}).items())
        if "nl_build_s" in r:
            parts += f" | nl_build={1000 * r['nl_build_s']:.1f}"
        if "edges" in r:
            parts += f" | edges={r['edges']} slots={r.get('model_edge_slots')} graph={r.get('cuda_graph')} sorted={r.get('spatial_order')}"
        if "first_call_s" in r:
            parts += f" | first call {r['first_call_s']:.1f} s"
        if r.get("compile_error"):
            parts += f" | compile failed: {r['compile_error'][:60]}"
        if r.get("radial_precision_error") is not None:
            parts += f" | radial {r['radial_precision']} (forces changed {r['radial_precision_error']:.1e})"
        peak = r.get("peak_gb", r.get("peak_gb_nvt"))  # --nvt-only rows: no NPT step
        print(f"{prefix} {_cell(r['nvt_s'])} {_cell(r.get('npt_s'))} {peak:8.2f} {floor_cells(r)}  {parts}")


def _cell(value) -> str:
    return f"{value:8.4f}" if isinstance(value, float) else f"{'-':>8s}"


def floor_cells(r: dict) -> str:
    """The floor (ms) and the fraction of it reached, '-' where the row has none."""
    ms, fraction = r.get("floor_ms"), r.get("floor_fraction")
    return (f"{ms:9.4f}" if isinstance(ms, float) else f"{'-':>9s}") + " " + (
        f"{fraction:7.1%}" if isinstance(fraction, float) else f"{'-':>7s}")


def md_details(r: dict) -> str:
    parts = []
    for ensemble in ("nvt", "npt"):
        if f"{ensemble}_ns_per_day" in r:
            text = f"{ensemble.upper()} {1000 * r[f'{ensemble}_s']:.2f} ms/step {r[f'{ensemble}_ns_per_day']:.2f} ns/day"
            stats = r.get(f"{ensemble}_stats")
            if stats:
                text += (f" (rebuilds {stats['rebuilds']}, discarded {stats['discarded']}, captures "
                         f"{stats['captures']})")
            timed = r.get(f"{ensemble}_timed")
            if timed:  # the timed steps' own share: a capture there costs a graph's capture, not a step
                why = ", ".join(f"{k} {v}" for k, v in timed["invalidations"].items())
                text += (f" [timed steps: captures {timed['captures']}, rebuilds {timed['rebuilds']}"
                         + (f"; recaptured for {why}" if why else "") + "]")
            use = r.get(f"{ensemble}_device")
            if use:
                text += (f" device idle {use['idle_ms']:.3f} ms/step ({use['gap_idle_ms']:.3f} in gaps of "
                         f">= {LONG_GAP_US:g} us), {use['kernels']:.0f} kernels/step")
                if "boundary_idle_ms" in use:  # rows before the events were measured lack it
                    text += (f"; unprofiled idle {use['boundary_idle_ms']:.3f} ms/step at block boundaries, "
                             f"{use['search_idle_ms']:.3f} behind searches")
            if f"{ensemble}_setup_s" in r:
                text += f" setup {r[f'{ensemble}_setup_s']:.0f} s"
            if f"{ensemble}_first_step_s" in r:
                text += f" first step {r[f'{ensemble}_first_step_s']:.1f} s"
            parts.append(text)
        if f"{ensemble}_error" in r:
            parts.append(f"{ensemble.upper()} error: {r[f'{ensemble}_error'][:80]}")
    if "setup_s" in r:
        parts.append(f"calculator setup {r['setup_s']:.1f} s")
    if r.get("capture_error"):
        parts.append(f"capture failed: {r['capture_error'][:80]}")
    if r.get("compile_error"):
        parts.append(f"compile failed: {r['compile_error'][:80]}")
    return "; ".join(parts)


if __name__ == "__main__":
    main()
