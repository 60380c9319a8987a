"""Write docs/performance.md from the newest benchmark JSON under benchmarks/results/.

    python benchmarks/report.py [--results benchmarks/results] [--out docs/performance.md] [--check]

Four tables, each from the newest run that holds its numbers, with that run's device, date and commit, and the
peers timed in the same run: per layer vs cuEquivariance (bench_layer's ``layer-*.json`` with ``cueq-mlp`` rows),
whole MD steps vs FastMACE (bench_md's ``md-*.json`` with ``fastmace`` and ``cgforge-engine`` rows), the force call
through ASE vs MACECalculator / NequIPCalculator with cuEquivariance (``md-*.json`` with ``cueq`` rows), and
capacity (the newest ``cgforge`` force call per model and box), with Symmetrix-XL's published figure beside it.

Which runs count: those of benchmarks/run.py (a ``manifest.json`` beside the JSON, no ``CGFORGE_*`` tuning variable
in its environment: an A/B is not a current number), whose manifest names the commit. Runs from before the driver
recorded the device copy's stale HEAD in their JSON; those count only where ``TREES`` below names the tree that
ran, read by hand from the run folder's README (the default configuration, not an A/B arm). Numbers whose JSON was not kept are read from the run's log into
``LOG_ROWS`` (each value is checked against the log text when this runs: a value not found there stops it).
Nothing else is typed in. ``--check`` exits 1 when the page on disk differs from what this would write.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
PAGE = ROOT / "docs" / "performance.md"

# Runs made before benchmarks/run.py: the tree each ran, from the run folder's README (its "tree" column or text).
TREES = {
    "session40-h200-20261203/engine-profile-20261203-121530.json": ("1728c0e", "README, call 3"),
    "spatial-order-h100-20261126/layer-20261126-135747.json": ("ce8f013", "README, call 9"),
    "spatial-order-h100-20261126/md-20261126-134824.json": ("7e63b3b", "README, call 7"),
    "spatial-order-h100-20261126/md-20261126-134850.json": ("7e63b3b", "README, call 7"),
    "spatial-order-h100-20261126/md-20261126-135314.json": ("7e63b3b", "README, call 8 (7e63b3b + docs)"),
    "spatial-order-h100-20261126/md-20261126-135337.json": ("7e63b3b", "README, call 8 (7e63b3b + docs)"),
    "spatial-order-h100-20261126/md-20261126-135428.json": ("7e63b3b", "README, call 8 (7e63b3b + docs)"),
    "chunks-order-h100-20261126/layer-20261126-104633.json": ("ef9ef27", "README, call 6"),
    "chunks-order-h100-20261126/md-20261126-105126.json": ("ef9ef27", "README, call 6"),
    "chunks-order-h100-20261126/md-20261126-110718.json": ("8a7551c", "README, call 7"),
    "chunks-order-h100-20261126/md-20261126-111434.json": ("8a7551c", "README, call 7"),
    "capacity-h100-20261126/capacity-20261126-222734.json": ("d5bbc04", "README, call 1"),
    "capacity-h100-20261126/capacity-20261126-222803.json": ("d5bbc04", "README, call 1"),
    "capacity-h100-20261126/capacity-20261126-223604.json": ("adb0069", "README, call 2"),
    "capacity-h100-20261126/capacity-20261126-223807.json": ("adb0069", "README, call 2"),
    "capacity-h100-20261126/capacity-20261126-223905.json": ("adb0069", "README, call 2"),
    "capacity-h100-20261126/capacity-20261126-224201.json": ("adb0069", "README, call 3"),
    "engine-harmonics-h100-20261127f/md-20261127-150838.json": ("561a864", "README, call 1"),
    "engine-harmonics-h100-20261127f/md-20261127-151141.json": ("561a864", "README, call 2"),
    "engine-table-h100-20261127k/md-20261127-215958.json": ("486771f", "README, call B"),
    "engine-table-h100-20261127k/md-20261127-220442.json": ("486771f", "README, call C"),
    "engine-table-h100-20261127k/md-20261127-220543.json": ("486771f", "README, call C"),
    "engine-table-h200-20261128/md-20261128-054525.json": ("917cc02", "README, call A"),
    "engine-table-h200-20261128/md-20261128-054617.json": ("917cc02", "README, call B"),
    "engine-table-h200-20261128/md-20261128-055032.json": ("917cc02", "README, call C"),
    "engine-table-h200-20261128b/md-20261128-124743.json": ("d3e5d6a", "README, call A"),
    "engine-table-h200-20261128b/md-20261128-124823.json": ("d3e5d6a", "README, call B"),
    "row-grad-once-h200-20261128/md-20261128-162311.json": ("22a634d", "README, call 5"),
    "engine-profile-h100-20261127j/engine-profile-20261127-215327.json": ("b3b3486", "README (+ the script)"),
    "engine-profile-h100-20261127j/engine-profile-20261127-215415.json": ("b3b3486", "README (+ the script)"),
    "engine-profile-h100-20261127j/engine-profile-20261127-215451.json": ("b3b3486", "README (+ the script)"),
    "engine-profile-h200-20261128/engine-profile-20261128-085659.json": ("b6bb794", "README"),
    "engine-profile-h200-20261128/engine-profile-20261128-085728.json": ("b6bb794", "README"),
    "engine-profile-h200-20261128/engine-profile-20261128-085749.json": ("b6bb794", "README"),
    "issue38-table-h200-20261129/md-20261129-042451.json": ("1e9ba35", "README, call 3"),
    "issue38-table-h200-20261129/md-20261129-042958.json": ("1e9ba35", "README, call 4"),
    "issue38-table-h200-20261129/md-20261129-043105.json": ("1e9ba35", "README, call 4"),
    "issue38-table-h200-20261129/engine-profile-20261129-043243.json": ("1e9ba35", "README, call 5"),
    "issue38-table-h200-20261129/layer-20261129-043836.json": ("1e9ba35", "README, call 6"),
    "cell-search-h200-20261129/md-20261129-084841.json": ("9457cff", "README, call 9"),
    "issue38-h200-20261129b/md-20261129-122020.json": ("c59c1dd", "README, call 5"),
    "issue38-h200-20261129b/md-20261129-122455.json": ("c59c1dd", "README, call 6"),
    "issue38-h200-20261129b/md-20261129-122559.json": ("c59c1dd", "README, call 6"),
    "issue38-h200-20261129b/engine-profile-20261129-122627.json": ("c59c1dd", "README, call 6"),
    "issue38-h200-20261129b/engine-profile-20261129-122659.json": ("c59c1dd", "README, call 6"),
    "session39-h200-20261203/md-20261203-100142.json": ("1dcf488", "README, call 4 (1dcf488's package)"),
    "session39-h200-20261203/md-20261203-100607.json": ("1dcf488", "README, call 5 (1dcf488's package)"),
    "session39-h200-20261203/md-20261203-102609.json": ("1dcf488", "README, call 6 (1dcf488's package)"),
    "session42-h200-20261203/md-20261203-181222.json": ("2dde8e1", "README, call 4"),
    "session42-h200-20261203/md-20261203-181737.json": ("2dde8e1", "README, call 5"),
    "session42-h200-20261203/nve-drift-20261203-180835.json": ("52af3b5", "README, call 2"),
    "session42-h200-20261203/nve-drift-20261203-181047.json": ("52af3b5", "README, call 2"),
}

# Rows printed in a run's log whose JSON was not kept: bench_md's row dicts, copied from the log (checked against it).
LOG_ROWS = {
    "step-5k-h100-20261126/md-5k-peers.log": {
        "date": "2026-11-26T05:53:06", "device": "NVIDIA H100 80GB HBM3",
        "commit": ("3b3549e", "README: 'code 3b3549e' for the calls after the auto loop order"),
        "rows": [
            {"model": "mace-mp-medium", "backend": "cgforge", "system": "5k", "atoms": 5184,
             "nvt_s": 0.01559185649999506, "peak_gb_nvt": 0.725441536},
            {"model": "mace-mp-medium", "backend": "cueq", "system": "5k", "atoms": 5184,
             "nvt_s": 0.3682949709999974, "peak_gb_nvt": 6.69578496},
            {"model": "nequip-M", "backend": "cgforge", "system": "5k", "atoms": 5184,
             "nvt_s": 0.009687730499990721, "peak_gb_nvt": 0.601491456},
            {"model": "nequip-M", "backend": "cueq", "system": "5k", "atoms": 5184,
             "nvt_s": 0.4413925919999997, "peak_gb_nvt": 8.80399616},
        ],
    },
    "engine-harmonics-h100-20261127f/log-call1.txt": {
        "date": "2026-11-27T15:04:00", "device": "NVIDIA H100 80GB HBM3",
        "commit": ("561a864", "README, call 1"),
        "rows": [
            {"model": "bundled-mace", "backend": "cgforge-engine", "system": "5k", "atoms": 5184,
             "nvt_s": 0.003068540705000089, "peak_gb": 0.516522496},
            {"model": "bundled-mace", "backend": "cgforge-engine-compiled", "system": "5k", "atoms": 5184,
             "nvt_s": 0.0027221230899999683, "peak_gb": 0.580863488},
            {"model": "bundled-mace", "backend": "fastmace", "system": "5k", "atoms": 5184,
             "nvt_s": 0.004137646295000082, "peak_gb": 0.266268672},
            {"model": "mace-mp-medium", "backend": "cgforge-engine", "system": "5k", "atoms": 5184,
             "nvt_s": 0.013043072689999918, "peak_gb": 1.17800448},
            {"model": "mace-mp-medium", "backend": "cgforge-engine-compiled", "system": "5k", "atoms": 5184,
             "nvt_s": 0.011830090045000076, "peak_gb": 1.395656704},
        ],
    },
}

# Published by others on their hardware (not run here): /work/shared/anchors.md, "Published anchors of other peers".
PUBLISHED = [
    {"peer": "Symmetrix-XL", "model": "MACE-OMAT-0 (energy, forces, stress)", "atoms": 1_370_000,
     "us_per_atom_step": 6.33, "device": "one A100-80GB", "note": "13.1 M atoms with a fixed workspace"},
]

MODEL_NAMES = {"mace-mp-medium": "MACE-MP-medium shape", "nequip-M": "NequIP preset M", "bundled-mace": "bundled MACE",
               "bundled-nequip": "bundled NequIP", "nequip-l1": "NequIP l1"}
LAYER_NAMES = {"mace-medium": "mace-medium", "mace-large": "mace-large",
               "mace-mp-medium-l2": "MACE-MP-medium layer 2 (every path)"}


@dataclass
class Run:
    """One results file: where it is, when and on what it ran, at which commit, and its rows."""
    path: str  # relative to the results folder
    date: str
    device: str
    commit: str
    commit_note: str
    rows: list[dict]
    versions: dict = field(default_factory=dict)

    def cite(self) -> str:
        return (f"{self.device}, {self.date[:16].replace('T', ' ')}, commit `{self.commit}` ({self.commit_note}); "
                f"[`{self.path}`](../benchmarks/results/{self.path})")


TUNING_FREE = {"CGFORGE_COMMIT", "CGFORGE_COMMIT_DIRTY"}  # a manifest whose env names other CGFORGE_ variables is an A/B


def _commit(results: Path, rel: str) -> tuple[str, str] | None:
    """(commit, where it was read) of a run this page may quote, None for the others: runs of benchmarks/run.py
    without tuning variables, and older runs whose tree ``TREES`` names."""
    manifest = (results / rel).parent / "manifest.json"
    if manifest.is_file():
        data = json.loads(manifest.read_text())
        if set(data.get("env", {})) - TUNING_FREE:
            return None
        commit = data.get("commit", {})
        dirty = commit.get("dirty")
        state = {True: "dirty working tree", False: "clean", None: "dirty state unknown"}[dirty]
        return str(commit.get("sha") or "unknown")[:12], f"manifest.json, {commit.get('source')}, {state}"
    if rel in TREES:
        sha, note = TREES[rel]
        return sha, f"run folder's {note}"
    return None


def load_runs(results: Path, prefix: str) -> list[Run]:
    runs = []
    for path in sorted(results.rglob(f"{prefix}-*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        env = data.get("environment") or data.get("env") or {}
        rows = data.get("rows")
        if not isinstance(rows, list) or not env.get("date"):
            continue
        rel = path.relative_to(results).as_posix()
        known = _commit(results, rel)
        if known is None:
            continue
        commit, note = known
        runs.append(Run(rel, env["date"], env.get("device", "unknown device"), commit, note,
                        [r for r in rows if isinstance(r, dict)], env))
    for rel, entry in LOG_ROWS.items():
        if prefix != "md":
            continue
        log = results / rel
        text = log.read_text() if log.is_file() else ""
        for row in entry["rows"]:
            for key in ("nvt_s", "peak_gb_nvt", "peak_gb"):
                if key in row and f"'{key}': {row[key]!r}" not in text:
                    raise SystemExit(f"report.py: LOG_ROWS[{rel!r}]: {key} {row[key]!r} of {row['model']}/"
                                     f"{row['backend']} is not in {log}")
        sha, note = entry["commit"]
        runs.append(Run(rel, entry["date"], entry["device"], sha, f"run folder's {note}; numbers from the log, "
                        "its JSON was not kept", [dict(r, dtype="float32") for r in entry["rows"]]))
    return sorted(runs, key=lambda r: r.date)


def newest(runs: list[Run], wanted) -> Run | None:
    hits = [r for r in runs if wanted(r)]
    return hits[-1] if hits else None


def _has(run: Run, **match) -> bool:
    return any(all(row.get(k) == v for k, v in match.items()) for row in run.rows)


def _opening(title: str, run: Run | None, missing: str, intro: str, columns: list[str]) -> list[str]:
    """A section's title, text, run and table header; only the title and ``missing`` when no run holds it."""
    out = [f"## {title}", ""]
    if run is None:
        return out + [f"No {missing} under benchmarks/results/.", ""]
    return out + [intro, "", f"Run: {run.cite()}.", "", "| " + " | ".join(columns) + " |",
                  "|---|" + "---:|" * (len(columns) - 1)]


def layer_section(runs: list[Run]) -> list[str]:
    run = newest(runs, lambda r: any("cueq-mlp_fb" in row and "cgforge-table_fb" in row for row in r.rows))
    cueq = run.versions.get("cuequivariance", "") if run else ""
    out = _opening(
        "Per layer: radial weights + convolution vs cuEquivariance", run, "bench_layer run with cuEquivariance rows",
        "One interaction layer on the 5184-atom water box (436,566 edges at 6 Å), FP32, forward and forward + "
        "backward (to x, y and the edge lengths): cgforge's table kernels (the radial weights read from a cubic "
        "table inside the convolution) against MACE's radial MLP + cuEquivariance "
        f"{cueq}'s fused convolution (`uniform_1d`), as MACE runs with cuEquivariance on. The floor: the CG "
        "multiply-adds at the device's FP32 peak, or the bytes at the measured copy bandwidth, whichever is larger.",
        ["problem", "cgforge fwd", "cgforge fwd+bwd", "MLP + cuEquivariance fwd", "MLP + cuEquivariance fwd+bwd",
         "cuEquivariance / cgforge (fwd+bwd)", "floor fwd+bwd"])
    if run is None:
        return out
    for row in run.rows:
        if "cueq-mlp_fb" not in row:
            continue
        out.append(f"| {LAYER_NAMES.get(row['problem'], row['problem'])} | {row['cgforge-table_fwd']:.3f} ms "
                   f"| {row['cgforge-table_fb']:.3f} ms | {row['cueq-mlp_fwd']:.3f} ms | {row['cueq-mlp_fb']:.3f} ms "
                   f"| **{row['cueq-mlp_fb'] / row['cgforge-table_fb']:.2f}x** | {row['floor_fb']:.3f} ms |")
    return out + [""]


def _session_folder(path: str) -> str:
    """The run folder directly under results/ that holds ``path`` (a session's calls may sit in subfolders of it)."""
    return Path(path).parts[0]


def _companion(runs: list[Run], run: Run, model: str, backend: str) -> Run | None:
    """The newest run beside ``run`` (the same folder under results/, or a sibling subfolder of it, device and commit:
    another call on the same machine) that timed ``model`` with ``backend``, where ``run`` itself did not."""
    if _has(run, model=model, backend=backend):
        return run
    return newest(runs, lambda r: _session_folder(r.path) == _session_folder(run.path) and r.device == run.device
                  and r.commit == run.commit and _has(r, model=model, backend=backend))


def engine_section(runs: list[Run]) -> list[str]:
    """Per model, the newest run that timed the engine and FastMACE side by side (runs differ by model when a
    newer run held only some of the models); the compiled engine from that run or one beside it (same folder
    under results/, device and commit); NequIP models (FastMACE runs MACE only) from the run folder of the newest
    such run, else from the newest run that timed them with the engine on the 5k box (a row of its own run, cited
    as such)."""
    # the 5k box's rows only: a run over several boxes (bench_md's --systems) must not put another box's steps here
    runs = [replace(run, rows=[row for row in run.rows if row.get("system", "5k") == "5k"]) for run in runs]
    picked: dict[str, Run] = {}
    for run in runs:  # oldest first: a newer run replaces an older one, model by model
        for model in dict.fromkeys(row["model"] for row in run.rows if row.get("backend") == "fastmace"):
            if _has(run, model=model, backend="cgforge-engine"):
                picked[model] = run
    newest_pick = max(picked.values(), key=lambda r: r.date) if picked else None
    for model in ("nequip-M",):  # no FastMACE peer: the engine beside the newest FastMACE run
        beside = newest_pick and _companion(runs, newest_pick, model, "cgforge-engine")
        if beside is None and newest_pick is not None:
            beside = newest(runs, lambda r, m=model: _has(r, model=m, backend="cgforge-engine", system="5k"))
        if beside is not None:
            picked[model] = beside
    compiled = {model: _companion(runs, run, model, "cgforge-engine-compiled") for model, run in picked.items()}
    cited = [r for r in list(picked.values()) + list(compiled.values()) if r is not None]
    chosen = sorted({run.path: run for run in cited}.values(), key=lambda r: r.date)
    out = _opening(
        "Whole MD steps vs FastMACE", chosen[-1] if chosen else None, "bench_md run with FastMACE rows",
        "Whole NVT steps (integrator included; 0.5 fs, 300 K, mean over 200 steps after a warm-up of 20 steps, 100 in "
        "runs after 2026-12-03 12:45: past a run's first capacity growths; 300 steps in runs after 2026-12-03 18:00) "
        "on the 5184-atom water "
        "box, FP32: cgforge's MD engine (the step on the device, one CUDA graph; `compiled`: the model under "
        "torch.compile, which `cgforge md --compile auto` keeps for a long run where its trial finds it faster) "
        "against FastMACE 1.0 (its own process; "
        "cuEquivariance convolution; MACE models only), FastMACE timed in the same run as the engine, the compiled "
        "engine in that run or in a call beside it on the same machine. cgforge's Verlet skin is `cgforge md`'s, 2 Å, "
        "from 2026-12-03 on (1 Å before: the bundled MACE's step 1.565 -> 1.375 ms, measured side by side in "
        "`session39-h200-20261203`). The floor is `benchmarks/step_floor.py`'s lower bound of the energy + forces "
        "call (bytes at 3,350 GB/s, FLOPs at 66.9 TFLOP/s; from issue 62 on also the L2 bytes, the radial tables' "
        "cubics read per weight per edge, at step_floor's L2 estimate, 12,390 GB/s, which raises the floor: rows "
        "measured before it used the floor without it; runs after 2026-12-03 10:10 at the measured GPU's rates, "
        "`step_floor.device_rates`); reached = floor / the engine's step. Idle: the device's idle at the engine's "
        "block boundaries, where the host waits on a block's report, from CUDA events with no profiler (runs after "
        "2026-12-03 18:00). Kernels: the engine's kernels a step (profiled). Lower is better.",
        ["model", "cgforge engine", "engine compiled", "FastMACE 1.0", "compiled / FastMACE", "engine / FastMACE",
         "floor", "reached", "idle", "kernels", "runs (engine, compiled)"])
    if not chosen:
        return out
    run_line = out.index(f"Run: {chosen[-1].cite()}.")
    out[run_line:run_line + 1] = [f"Run {k + 1}: {run.cite()}." + ("" if k == len(chosen) - 1 else "  ")
                                  for k, run in enumerate(chosen)]
    number = {run.path: k + 1 for k, run in enumerate(chosen)}

    def ms(v: object) -> str:
        return f"{v * 1e3:.2f} ms" if isinstance(v, float) else "-"

    def ratio(a: object, b: object) -> str:
        return f"{a / b:.2f}" if isinstance(a, float) and isinstance(b, float) else "-"

    def nvt(run: Run | None, model: str, backend: str, key: str = "nvt_s") -> object:
        return next((row.get(key) for row in run.rows if row.get("model") == model
                     and row.get("backend") == backend), None) if run is not None else None

    for model, run in picked.items():
        plain, fast = nvt(run, model, "cgforge-engine"), nvt(run, model, "fastmace")
        comp = nvt(compiled[model], model, "cgforge-engine-compiled")
        floor = nvt(run, model, "cgforge-engine", "floor_ms")
        device = nvt(run, model, "cgforge-engine", "nvt_device") or {}
        idle, kernels = device.get("boundary_idle_ms"), device.get("kernels")
        reached = f"{floor / (plain * 1e3):.0%}" if isinstance(floor, float) and isinstance(plain, float) else "-"
        runs_cell = f"{number[run.path]}, {number[compiled[model].path]}" if compiled[model] else f"{number[run.path]}"
        out.append(f"| {MODEL_NAMES.get(model, model)} | {ms(plain)} | {ms(comp)} | {ms(fast)} | {ratio(comp, fast)} "
                   f"| {ratio(plain, fast)} | {f'{floor:.3f} ms' if isinstance(floor, float) else '-'} | {reached} "
                   f"| {f'{idle:.3f} ms' if isinstance(idle, float) else '-'} "
                   f"| {f'{kernels:.0f}' if isinstance(kernels, int | float) else '-'} | {runs_cell} |")
    last = max(run.date for run in chosen)
    def engine_nvt(run: Run) -> list[dict]:
        return [row for row in run.rows
                if row.get("backend") == "cgforge-engine" and row.get("system") == "5k" and row.get("nvt_s")]

    later = newest(runs, lambda r: r.date > last and bool(engine_nvt(r)))  # an NPT-only run has no NVT step to cite
    if later is not None:
        rows = engine_nvt(later)
        text = ", ".join(f"{MODEL_NAMES.get(r['model'], r['model'])} {r['nvt_s'] * 1e3:.2f} ms" for r in rows)
        out += ["", f"A newer run timed the uncompiled engine alone, with no peer in that run: {text} "
                f"({later.cite()})."]
    return out + [""]


def force_section(runs: list[Run]) -> list[str]:
    run = newest(runs, lambda r: _has(r, backend="cueq", dtype="float32", system="5k")
                 and _has(r, backend="cgforge", dtype="float32", system="5k"))
    out = _opening(
        "Force call through ASE vs the models' own calculators with cuEquivariance", run,
        "bench_md run with cuEquivariance rows",
        "One energy + forces call through ASE on the 5184-atom water box, FP32 (MACE-MP-medium shape and NequIP "
        "preset M, random weights): cgforge's `Calculator` (a CUDA-graph replay) against MACECalculator / "
        "NequIPCalculator with cuEquivariance, in the same run. The peers' time includes their host-side batch "
        "preparation, which is what an ASE user waits for.",
        ["model", "cgforge", "peak GB", "peer + cuEquivariance", "peak GB", "peer / cgforge"])
    if run is None:
        return out
    for model in dict.fromkeys(row["model"] for row in run.rows if row.get("backend") == "cueq"):
        cell = {row["backend"]: row for row in run.rows if row.get("model") == model and row.get("system") == "5k"}
        ours, peer = cell.get("cgforge"), cell.get("cueq")
        if not ours or not peer or not ours.get("nvt_s") or not peer.get("nvt_s"):
            continue
        out.append(f"| {MODEL_NAMES.get(model, model)} | {ours['nvt_s'] * 1e3:.1f} ms | {ours['peak_gb_nvt']:.2f} "
                   f"| {peer['nvt_s'] * 1e3:.0f} ms | {peer['peak_gb_nvt']:.2f} | {peer['nvt_s'] / ours['nvt_s']:.0f}x |")
    return out + [""]


def capacity_section(runs: list[Run]) -> list[str]:
    out = ["## Capacity: the largest boxes, one force call", "",
           "The default calculator (it plans its own memory: stored or streamed edges, row chunks) on water boxes of "
           "bench_md, one energy + forces call through ASE, FP32; the newest run of each model and size. No peer was run "
           "at these sizes (the peers' largest runs here are the 5184-atom box above). Symmetrix-XL's figure is its "
           "authors' own, on their hardware: not comparable run for run, listed for scale.", "",
           "| model | atoms | edges | s per call | µs per atom and step | peak GB | run |",
           "|---|---:|---:|---:|---:|---:|---|"]
    best: dict[tuple[str, str], tuple[Run, dict]] = {}
    for run in runs:
        for row in run.rows:
            if (row.get("backend") == "cgforge" and row.get("dtype") == "float32" and isinstance(row.get("nvt_s"), float)
                    and row.get("system") in ("5k", "500k", "1m") and row.get("model") in ("mace-mp-medium", "nequip-M")
                    and "cueq" not in {r.get("backend") for r in run.rows}):
                best[(row["model"], row["system"])] = (run, row)  # runs are in date order: the newest wins
    order = {"5k": 0, "500k": 1, "1m": 2}
    for (model, _system), (run, row) in sorted(best.items(), key=lambda kv: (kv[0][0], order[kv[0][1]])):
        edges = f"{row['edges']:,}" if row.get("edges") else "-"
        out.append(f"| {MODEL_NAMES[model]} | {row['atoms']:,} | {edges} | {row['nvt_s']:.4g} "
                   f"| {row['nvt_s'] / row['atoms'] * 1e6:.2f} | {row.get('peak_gb_nvt', float('nan')):.1f} "
                   f"| {run.device}, {run.date[:10]}, `{run.commit}`, [`{run.path}`](../benchmarks/results/{run.path}) |")
    for p in PUBLISHED:
        out.append(f"| {p['peer']} (published): {p['model']} | {p['atoms']:,} | - | - | {p['us_per_atom_step']:.2f} "
                   f"| - | {p['device']}, its authors' figure ({p['note']}) |")
    return out + [""]


def ladder_section(runs: list[Run]) -> list[str]:
    """bench_capacity's rows: cgforge (one graph or tiles) and Symmetrix-XL on the same boxes, the newest per row."""
    out = ["## Capacity ladder: to ten million atoms and beyond", "",
           "One energy + forces call through an ASE calculator (the second of its process), FP32 water, each size a "
           "process of its own (`benchmarks/bench_capacity.py`). cgforge's `workspace=\"auto\"` evaluates one graph "
           "where it fits and tiles with a fixed working set past that; Symmetrix-XL 0.1.1 ran the same model file "
           "and boxes in the same machine session (its peak: the driver's memory in use after the call).", "",
           "| code | model | atoms | ran | s per call | µs per atom and step | peak GB | bytes per atom | run |",
           "|---|---|---:|---|---:|---:|---:|---:|---|"]
    best: dict[tuple, tuple[Run, dict]] = {}
    for run in runs:
        for row in run.rows:
            if isinstance(row.get("seconds"), float) and "error" not in row:
                key = (row.get("backend"), row.get("model"), row.get("atoms"), row.get("workspace") or row.get("profile"))
                best[key] = (run, row)  # runs are in date order: the newest wins
    for (backend, model, atoms, _), (run, row) in sorted(best.items(), key=lambda kv: (
            kv[0][1], kv[0][0] != "cgforge", kv[0][2], str(kv[0][3]))):
        ran = row.get("ran")
        how = f"{ran} (workspace {row['workspace']})" if "workspace" in row else f"{ran} profile"
        out.append(f"| {backend} | {MODEL_NAMES.get(model, model)} | {atoms:,} | {how} | {row['seconds']:.4g} "
                   f"| {row['us_per_atom']:.2f} | {row['peak_bytes'] / 1e9:.1f} | {row['bytes_per_atom']:,.0f} "
                   f"| {run.device}, {run.date[:10]}, `{run.commit}`, [`{run.path}`](../benchmarks/results/{run.path}) |")
    return out + [""]


PROFILE_CATEGORIES = ("convolution (cgforge)", "copy/cat", "elementwise", "GEMM", "index/scatter/gather",
                      "symmetric contraction (cgforge)")


def profile_section(results: Path) -> list[str]:
    """Per model, the newest vetted ``profile_engine.py`` run that profiled the captured step: its kernel time by
    category beside the step's wall time (the uncompiled engine)."""
    picked: dict[str, tuple[str, dict, dict, str, str]] = {}
    for path in sorted(results.rglob("engine-profile-*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        rel = path.relative_to(results).as_posix()
        known = _commit(results, rel)
        plain = next((r for r in data.get("results", []) if isinstance(r, dict) and r.get("compile") is None
                      and "captured" in r), None)
        env, model = data.get("environment", {}), data.get("args", {}).get("model")
        nvt = data.get("args", {}).get("ensemble", "nvt") == "nvt"  # the section's step; NPT profiles are read apart
        if known is None or plain is None or not model or not env.get("date") or not nvt:
            continue
        if model not in picked or env["date"] > picked[model][1]["date"]:
            picked[model] = (rel, env, plain, *known)
    out = ["## Where the engine's step goes", ""]
    if not picked:
        return out + ["No profile_engine.py run with a captured-step profile under benchmarks/results/.", ""]
    out += ["The uncompiled engine's 5184-atom NVT step (FP32, the engine's defaults) as the CUDA graphs it replays, "
            "profiled by `benchmarks/profile_engine.py`: each kernel's own time per step (10 steps, a neighbour-list "
            "rebuild's kernels amortised), by category; the step's wall time beside it (the rest is the gaps "
            "between kernels).", "",
            "| model | step | kernels a step | kernel time | " + " | ".join(PROFILE_CATEGORIES) + " | other | run |",
            "|---|" + "---:|" * (len(PROFILE_CATEGORIES) + 5)]
    for model, (rel, env, plain, sha, note) in sorted(picked.items()):
        part = plain["captured"]
        cats = part.get("categories", {})
        other = part["kernel_ms"] - sum(cats.get(c, 0.0) for c in PROFILE_CATEGORIES)
        step = plain["sweep"][0]["ms_per_step"] if plain.get("sweep") else float("nan")
        out.append(f"| {MODEL_NAMES.get(model, model)} | {step:.2f} ms | {part['kernels_per_step']} "
                   f"| {part['kernel_ms']:.2f} ms | " + " | ".join(f"{cats.get(c, 0.0):.2f}" for c in PROFILE_CATEGORIES)
                   + f" | {other:.2f} | {env.get('device', 'unknown device')}, {env['date'][:16].replace('T', ' ')}, "
                   f"commit `{sha}` ({note}); [`{rel}`](../benchmarks/results/{rel}) |")
    return out + [""]


def nve_section(results: Path) -> list[str]:
    """Per model and dtype, the newest vetted ``nve_drift.py`` run that equilibrated before its NVE: the total
    energy's drift, excursion and spread."""
    picked: dict[tuple[str, str], tuple[Run, dict]] = {}
    for path in sorted(results.rglob("nve-drift-*.json")):
        data, rel = json.loads(path.read_text()), path.relative_to(results).as_posix()
        env, known = data.get("environment") or {}, _commit(results, rel)
        if known is None or not env.get("date") or not data.get("args", {}).get("equilibrate_ps"):
            continue
        run = Run(rel, env["date"], env.get("device", "unknown device"), *known, data.get("results", []))
        for row in run.rows:
            key = (row["model"], row["dtype"])
            if key not in picked or run.date > picked[key][0].date:
                picked[key] = (run, row)
    newest_run = max((run for run, _ in picked.values()), key=lambda r: r.date, default=None)
    out = _opening("Energy conservation (NVE)", newest_run, "nve_drift.py run that equilibrated first",
                   "`benchmarks/nve_drift.py`: a water box of 1,536 atoms, Langevin at 300 K first (the run's "
                   "`--equilibrate-ps`), then velocity Verlet on the device engine (the CUDA graph `cgforge md "
                   "--ensemble nve` replays), the total energy read every 100 steps. Drift: the slope of a "
                   "least-squares line through E(t); spread: E's RMS about that line; max: the largest "
                   "|E(t) - E(0)|; all per atom. Each row from the newest such run of its model and dtype.",
                   ["model", "dtype", "timestep", "ps", "mean T", "drift", "max", "spread", "ms a step", "run"])
    for (model, dtype), (run, row) in sorted(picked.items()):
        out.append(f"| {MODEL_NAMES.get(model, model)} | {dtype} | {row['timestep_fs']:g} fs | {row['ps']:g} "
                   f"| {row['mean_temperature_K']:.0f} K | {row['slope_mev_per_atom_per_ps']:+.4f} meV/atom/ps "
                   f"| {row['max_abs_mev_per_atom']:.3f} meV/atom | {row['spread_mev_per_atom']:.3f} meV/atom "
                   f"| {row['ms_per_step']:.2f} | commit `{run.commit}`, [`{run.path}`](../benchmarks/results/{run.path}) |")
    return out + [""]


BATCH_ROWS = (("evaluation", "eval", "structures_per_s", "structures/s",
               ("eval-batch", "eval-loop", "eval-mace-cueq", "eval-torchsim-mace", "eval-torchsim-cgforge")),
              ("FIRE relaxation", "relax", "structures_per_s", "structures/s",
               ("relax-batch", "relax-loop", "relax-torchsim-mace", "relax-torchsim-cgforge")),
              ("MD", "md", "atom_steps_per_s", "atom-steps/s",
               ("md-batch-nvt", "md-loop-nve", "md-torchsim-mace-nvt", "md-torchsim-cgforge-nvt")))


FIRE_ORDERS = {"ase": "ASE's", "torchsim": "TorchSim's"}


def _every(steps: int) -> str:
    return "every step" if steps == 1 else f"every {steps} steps"


def _batch_size(args: dict, workload: str) -> float:
    """How much of a workload a run did: runs of the same workload rank by it (a short check does not displace the
    full-size run), then by date."""
    if workload == "eval":
        return args.get("structures") or 0
    if workload == "relax":
        return args.get("relax_structures") or 0
    return (args.get("md_steps") or 0) * (args.get("structures") or 0)


def batch_section(results: Path) -> list[str]:
    """Per model and workload (evaluation, relaxation, MD), the largest FP32 ``bench_batch`` run of ``benchmarks/run.py
    batch`` that holds it, the newest among equals: each row's throughput, the issue's ratios."""
    runs = []
    for path in sorted(results.rglob("bench_batch-*.json")):
        data, rel = json.loads(path.read_text()), path.relative_to(results).as_posix()
        env, known = data.get("environment") or {}, _commit(results, rel)
        if (known is not None and env.get("date") and isinstance(data.get("rows"), dict)
                and (data.get("args") or {}).get("dtype", "float32") == "float32"):
            runs.append(Run(rel, env["date"], env.get("device", "unknown device"), *known, [data]))
    chosen: dict[tuple[str, str], Run] = {}  # (model, workload) -> its run
    for run in runs:
        data = run.rows[0]
        for model, rows in data["rows"].items():
            for _, workload, _, _, names in BATCH_ROWS:
                if not any(name in rows for name in names):
                    continue
                rank = (_batch_size(data.get("args") or {}, workload), run.date)
                best = chosen.get((model, workload))
                if best is None or rank > (_batch_size(best.rows[0].get("args") or {}, workload), best.date):
                    chosen[(model, workload)] = run
    out = _opening("Many structures at once vs a loop and TorchSim", max(runs, key=lambda r: r.date) if runs else None,
                   "bench_batch run of benchmarks/run.py",
                   "`benchmarks/bench_batch.py`: water cells and clusters of 24-300 atoms, FP32; cgforge's batched "
                   "paths (one graph per batch) against a loop over cgforge's Calculator, MACE's calculator "
                   "(cuEquivariance where it imports) and TorchSim with its MACE model and over cgforge's model, in "
                   "the same run. Each model's workload comes from the largest run of it, the newest among equals "
                   "(named below the table). A row a peer could not run says why.",
                   ["model", "workload", "row", "throughput", "note"])
    if not chosen:
        return out
    models = list(dict.fromkeys(model for model, _ in chosen))
    for model in models:
        for label, workload, key, unit, names in BATCH_ROWS:
            run = chosen.get((model, workload))
            rows = run.rows[0]["rows"][model] if run else {}
            for name in names:
                row = rows.get(name)
                if row is None:
                    continue
                note = row.get("error") or row.get("note") or ""
                number = row.get(key)
                value = "-" if not isinstance(number, int | float) else (
                    f"{number:,.0f} {unit}" if number >= 100 else f"{number:.3g} {unit}")
                out.append(f"| {model} | {label} | {name} | {value} | {str(note)[:120]} |")
    out.append("")
    for model in models:
        for label, workload, *_ in BATCH_ROWS:
            run = chosen.get((model, workload))
            if run is None:
                continue
            args = run.rows[0].get("args", {})
            size = {"eval": f"structures {args.get('structures')}",
                    "relax": f"relaxed {args.get('relax_structures')} (TorchSim: "
                             f"{args.get('peer_relax_structures') or args.get('relax_structures')}), FIRE in "
                             f"{FIRE_ORDERS.get(args.get('fire_variant', 'ase'), '?')} order, TorchSim checking "
                             f"convergence {_every(args.get('peer_check_every', 5))}",
                    "md": f"structures {args.get('structures')}, MD steps {args.get('md_steps')} (TorchSim: "
                          f"{args.get('peer_md_steps') or args.get('md_steps')})"}[workload]
            out += [f"{model}, {label}: {run.cite()}; {size}; ratios (cgforge / peer):", ""]
            for name, values in (run.rows[0].get("ratios") or {}).get(model, {}).items():
                if name.split(":")[0] != workload:
                    continue
                target = values.get("target")
                if "ratio" in values:
                    said = f"{values['ratio']:.2f}x" + ("" if target is None else f" (target >= {target:g})")
                else:
                    median = values.get("median_ev_per_atom")
                    said = (f"max {values['max_ev_per_atom']:.2e} eV/atom over {values['structures']} structures "
                            f"converged in both" + ("" if median is None else
                                                    f", median {median:.2e}, {values['within_target']} within")
                            + f" (target <= {target:g})")
                out.append(f"- {model}, {name}: {said}")
            out.append("")
    return out


def render(results: Path) -> str:
    layer, md = load_runs(results, "layer"), load_runs(results, "md")
    lines = ["# Performance", "",
             "<!-- Generated by `python benchmarks/report.py` from benchmarks/results/: do not edit by hand. -->", "",
             "Current numbers only, each table from the newest run that holds it, with the run's device, date and "
             "commit; peers are timed in the same run as cgforge unless a row says *published*. Every run, with the "
             "question it answered: [benchmarks/results/README.md](../benchmarks/results/README.md). To refresh: "
             "`python benchmarks/run.py layer engine md capacity ladder` on a GPU, then `python benchmarks/report.py`.", ""]
    lines += layer_section(layer) + engine_section(md) + force_section(md) + capacity_section(md)
    lines += ladder_section(load_runs(results, "capacity")) + batch_section(results) + profile_section(results)
    lines += nve_section(results)
    lines += ["## Where the numbers come from", "",
              "- Runs made with `benchmarks/run.py` carry their commit in `manifest.json`. Older runs recorded the "
              "device copy's stale HEAD in their JSON; for those, the tree that ran is taken from the run folder's "
              "README (`TREES` in benchmarks/report.py) and the table says so.",
              "- The force-call table's numbers are read from the run's log (`LOG_ROWS` in benchmarks/report.py): "
              "that run's JSON was not kept; report.py checks each value against the log text.",
              "- Symmetrix-XL: published by its authors (`PUBLISHED` in benchmarks/report.py), not run here.",
              "- The measurements behind the code's constants and choices (chunk sizes, thresholds, defaults): "
              "[measured-constants.md](measured-constants.md).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--out", type=Path, default=PAGE)
    parser.add_argument("--check", action="store_true", help="exit 1 if --out differs from what would be written")
    args = parser.parse_args(argv)
    if not args.results.is_dir():
        parser.error(f"--results {args.results}: not a folder")
    text = render(args.results)
    if args.check:
        same = args.out.is_file() and args.out.read_text() == text
        print(f"{args.out}: {'up to date' if same else 'differs from benchmarks/report.py output'}")
        return 0 if same else 1
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
