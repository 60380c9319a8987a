"""Run the maintained benchmarks into one run folder with a manifest.

    python benchmarks/run.py SUITE [SUITE ...] [--name NAME] [--results DIR] [--commit SHA] [--timeout S]
    python benchmarks/run.py layer -- mace-large --tuning loop_order=chunks     (one suite: its arguments replaced)
    python benchmarks/run.py --list                                             (the suites and their commands)
    python benchmarks/run.py layer md --dry-run                                 (the plan and manifest, nothing run)

Writes ``benchmarks/results/<name>-<device>-<yyyymmdd>/`` (a letter appended when that folder exists; ``name``
defaults to the suites joined by ``-``; ``device`` is ``h100``, ``h200``, ... or ``cpu``) holding, for every
command of every suite, its log (``<suite>.log``, ``<suite>-2.log``, ...) and the JSON the script writes there
(the scripts write to ``$OUT``), and ``manifest.json``: the command line, the commit, the device, the versions of
torch, cupy, e3nn, mace-torch, nequip, cuequivariance, openequivariance and FastMACE, and per command its exit
status, seconds and files. The manifest is rewritten after every command, so a run cut short keeps what it did.

The commit: ``git rev-parse HEAD`` with ``dirty`` from ``git status --porcelain`` and ``tree``, the hash of the
working tree as it ran (tracked and not-ignored files; ``git rev-parse COMMIT^{tree}`` equals it when the tree is
that commit's). A copy of the repository whose ``.git`` is missing or stale (the device machine's) names the
commit with ``--commit SHA`` or ``CGFORGE_COMMIT=SHA``; the manifest then says ``"source": "override"`` and keeps
what git said beside it. The scripts' own JSON ``environment.commit`` takes the same value (``common.environment``
reads ``CGFORGE_COMMIT``, which this driver sets for them).

Investigations (one-off questions, kept runnable) live in benchmarks/investigations/ and are not suites here.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"


@dataclass(frozen=True)
class Suite:
    question: str
    commands: tuple[tuple[str, ...], ...]  # script (in benchmarks/) and its arguments, one tuple per command


SUITES: dict[str, Suite] = {
    "layer": Suite("one interaction layer's radial weights + convolution vs MLP + cuEquivariance (fwd, fwd+bwd)",
                   (("bench_layer.py", "mace-medium", "mace-large", "mace-mp-medium-l2"),)),
    "md": Suite("force call through ASE, 5184 atoms: cgforge vs MACECalculator / NequIPCalculator with their kernels",
                (("bench_md.py", "--systems", "5k", "--models", "mace-mp-medium,nequip-M", "--dtypes", "float32",
                  "--backends", "cgforge,cueq,oeq", "--steps", "10", "--warmup", "3", "--nvt-only"),)),
    "engine": Suite("whole MD steps at 5184 atoms: cgforge's engine (plain, compiled) vs FastMACE 1.0",
                    (("bench_md.py", "--systems", "5k", "--models", "bundled-mace,mace-mp-medium", "--dtypes", "float32",
                      "--backends", "cgforge-engine,cgforge-engine-compiled,fastmace", "--ensembles", "nvt",
                      "--md-steps", "200", "--md-warmup", "100"),)),
    "capacity": Suite("largest boxes: one force call at 5k, 500k and 1.03M atoms (MACE-MP-medium, NequIP M); no floor "
                      "(its CPU neighbour count of 1 M atoms takes minutes of the device call)",
                      (("bench_md.py", "--systems", "5k,500k,1m", "--models", "mace-mp-medium", "--dtypes", "float32",
                        "--backends", "cgforge", "--steps", "3", "--warmup", "1", "--nvt-only", "--no-floor"),
                       ("bench_md.py", "--systems", "1m", "--models", "nequip-M", "--dtypes", "float32",
                        "--backends", "cgforge", "--steps", "3", "--warmup", "1", "--nvt-only", "--no-floor"))),
    "ladder": Suite("capacity ladder to 10 M atoms (tiles past one graph) vs Symmetrix-XL (needs .device/symx installed)",
                    (("bench_capacity.py", "--model", "mace-mp-medium", "--atoms", "5184", "1029000", "2000000",
                      "5000000", "10000000"),
                     ("bench_capacity.py", "--model", "nequip-M", "--atoms", "5184", "1029000", "10000000"),
                     ("bench_capacity.py", "--peer", "symmetrix", "--atoms", "5184", "1029000"),
                     ("bench_capacity.py", "--peer", "symmetrix", "--profile", "capacity", "--atoms", "3000000"))),
    "tp": Suite("tensor product alone vs e3nn, cuEquivariance, OpenEquivariance (batch 50000)", (("bench_tp.py",),)),
    "conv": Suite("fused convolution on water and DHFR graphs vs e3nn, OpenEquivariance, cuEquivariance",
                  (("bench_conv.py",),)),
    "sc": Suite("MACE's symmetric contraction vs e3nn, cuEquivariance, OpenEquivariance",
                (("bench_symmetric_contraction.py",),)),
    "mace": Suite("MACE-MP-medium model and calculator call, 5184 atoms, vs e3nn / cuEquivariance / OEQ",
                  (("bench_mace.py", "12", "float32", "cgforge,cueq,oeq,hybrid,e3nn", "medium"),)),
    "nequip": Suite("NequIP M and l1 model and calculator call, 5184 atoms, vs e3nn / OEQ / cuEquivariance",
                    (("bench_nequip.py", "12", "M", "e3nn,cgforge,oeq,cueq,cgforge-calc"),
                     ("bench_nequip.py", "12", "l1", "e3nn,cgforge,oeq,cueq,cgforge-calc"))),
    "lammps": Suite("LAMMPS pair_style mliap unified: cgforge's class vs MACE's and the engine (needs .lammps/)",
                    (("bench_lammps.py",),)),
    "rebuild": Suite("what the MD engine's neighbour-list rebuilds cost per skin", (("engine_rebuild.py",),)),
    "radial-table": Suite("radial tables vs the radial MLP they replace, per weight width",
                          (("bench_radial_table.py",),)),
    "engine-profile": Suite("the MD engine's step: settings sweep, then its kernels", (("profile_engine.py",),)),
    "harmonics": Suite("the spherical-harmonics kernel vs e3nn's module (5k to 1 M-atom edge counts)",
                       (("bench_harmonics.py",),)),
    "batch": Suite("many small structures (1,024 of 24-300 atoms): cgforge's batched evaluation, FIRE and MD vs the "
                   "loop over cgforge's Calculator, MACE's calculator (cuEquivariance), TorchSim + MACE "
                   "(cuEquivariance) and TorchSim over cgforge, where they import",
                   (("bench_batch.py",),)),
    "compile": Suite("torch.compile of a water model's step: a first and a second process sharing one cache",
                     (("bench_compile.py",),)),
    "nve": Suite("energy conservation: NVE of a 1,536-atom water box at 1 fs for 50 ps on the device engine, the "
                 "total energy's drift per model (bundled MACE and NequIP, FP32)", (("nve_drift.py",),)),
}

VERSIONS = {  # manifest key: distribution names, first found wins (nothing is imported: importing
    # openequivariance can start a JIT build of its extension)
    "torch": ("torch",),
    "cupy": ("cupy-cuda13x", "cupy-cuda12x", "cupy"),
    "e3nn": ("e3nn",),
    "mace": ("mace-torch",),
    "nequip": ("nequip",),
    "cuequivariance": ("cuequivariance",),
    "cuequivariance-torch": ("cuequivariance-torch",),
    "openequivariance": ("openequivariance",),
    "fastmace": ("fastmace",),
    "ase": ("ase",),
    "numpy": ("numpy",),
}


def _git(*args: str) -> str | None:
    try:
        run = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return run.stdout if run.returncode == 0 else None


def working_tree_hash() -> str | None:
    """The git tree of the working tree as it is (tracked and not-ignored files), without touching the index."""
    git_dir = _git("rev-parse", "--git-dir")
    if git_dir is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        index = Path(tmp) / "index"
        source = (ROOT / git_dir.strip()) / "index"
        if source.is_file():
            shutil.copyfile(source, index)
        env = dict(os.environ, GIT_INDEX_FILE=str(index))
        try:
            add = subprocess.run(["git", "add", "-A", "."], cwd=ROOT, env=env, capture_output=True, timeout=300)
            tree = subprocess.run(["git", "write-tree"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return tree.stdout.strip() if add.returncode == 0 and tree.returncode == 0 else None


def commit_info(override: str | None) -> dict:
    """What ran: git's HEAD, dirty flag and working-tree hash, or the override (flag or CGFORGE_COMMIT)."""
    head = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain")
    git = {"head": head.strip() if head else None,
           "dirty": bool(status.strip()) if status is not None else None,
           "changed": status.splitlines()[:20] if status else [],
           "tree": working_tree_hash() if head else None}
    if override:
        return {"sha": override, "source": "override", "dirty": None, "git": git}
    if git["head"] is None:
        return {"sha": None, "source": "unknown (no git; pass --commit or CGFORGE_COMMIT)", "dirty": None, "git": git}
    return {"sha": git["head"], "source": "git", "dirty": git["dirty"], "git": git}


def versions() -> dict:
    """Installed versions by distribution metadata; a package importable without metadata (a source build on
    PYTHONPATH) is ``"importable, no metadata"``; a missing one None."""
    import importlib.util
    from importlib import metadata

    found: dict[str, str | None] = {}
    for key, dists in VERSIONS.items():
        version = None
        for dist in dists:
            try:
                version = metadata.version(dist)
                break
            except metadata.PackageNotFoundError:
                continue
        if version is None:
            try:
                spec = importlib.util.find_spec(key.replace("-", "_"))
            except (ImportError, ValueError):
                spec = None
            version = "importable, no metadata" if spec is not None else None
        found[key] = version
    return found


def device_info() -> dict:
    """The GPU as nvidia-smi names it (no CUDA context made here), else the CPU."""
    info: dict = {"gpus": []}
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=60).stdout
            info["gpus"] = [dict(zip(("name", "driver", "memory"), (f.strip() for f in line.split(",")), strict=False))
                            for line in out.splitlines() if line.strip()]
        except (OSError, subprocess.TimeoutExpired):
            pass
    info["name"] = info["gpus"][0]["name"] if info["gpus"] else f"cpu ({platform.processor() or platform.machine()})"
    info["cpus"] = os.cpu_count()
    return info


def device_slug(name: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``h100``; no GPU -> ``cpu``."""
    if name.startswith("cpu"):
        return "cpu"
    words = [w for w in re.split(r"[^A-Za-z0-9]+", name) if w and w.upper() not in ("NVIDIA", "TESLA", "GEFORCE")]
    for word in words:
        if re.fullmatch(r"[A-Za-z]+\d+[A-Za-z]*", word):
            return word.lower()
    return (words[0] if words else "gpu").lower()


def run_folder(results: Path, name: str, slug: str, day: datetime.date) -> Path:
    base = f"{name}-{slug}-{day:%Y%m%d}"
    for suffix in ("", *"bcdefghijklmnopqrstuvwxyz"):
        path = results / f"{base}{suffix}"
        if not path.exists():
            return path
    raise SystemExit(f"run.py: too many runs named {base} in {results}")


def plan(suites: list[str], extra: list[str]) -> list[tuple[str, tuple[str, ...]]]:
    """(suite, command) pairs in order; ``extra`` replaces the arguments of a one-command suite."""
    steps = []
    for name in suites:
        commands = SUITES[name].commands
        if extra:
            commands = ((commands[0][0], *extra),)
        steps += [(name, command) for command in commands]
    return steps


def dropped_options(suites: list[str], extra: list[str]) -> list[str]:
    """The options (``--name value``) of a one-command suite that ``extra`` replaces without naming them."""
    if not extra or len(suites) != 1:
        return []
    named = {token.split("=")[0] for token in extra if token.startswith("--")}
    command = SUITES[suites[0]].commands[0]
    return [f"{token} {command[k + 1]}" if k + 1 < len(command) and not command[k + 1].startswith("--") else token
            for k, token in enumerate(command) if token.startswith("--") and token not in named]


def parse_args(argv: list[str]) -> argparse.Namespace:
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(prog="run.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("suites", nargs="*", metavar="SUITE", help=f"one or more of: {', '.join(SUITES)}")
    parser.add_argument("--list", action="store_true", help="print the suites and their commands")
    parser.add_argument("--name", help="run folder name before -<device>-<date> (default: the suites joined by -)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="where run folders go (default: %(default)s)")
    parser.add_argument("--commit", default=os.environ.get("CGFORGE_COMMIT") or None,
                        help="the commit that is running, for a copy without a current .git (default: "
                             "$CGFORGE_COMMIT, else git rev-parse HEAD)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per command (default: none)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and the manifest; run nothing")
    args = parser.parse_args(argv)
    args.extra = extra
    if args.list:
        return args
    if not args.suites:
        parser.error(f"name at least one SUITE: {', '.join(SUITES)}")
    unknown = [s for s in args.suites if s not in SUITES]
    if unknown:
        parser.error(f"unknown SUITE {', '.join(map(repr, unknown))}; choose from {', '.join(SUITES)}")
    if extra and (len(args.suites) != 1 or len(SUITES[args.suites[0]].commands) != 1):
        parser.error("arguments after -- need exactly one SUITE of one command "
                     f"(not {', '.join(args.suites)})")
    if args.name is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", args.name):
        parser.error(f"--name {args.name!r}: letters, digits, '.', '_' and '-' only")
    if args.commit is not None and not re.fullmatch(r"[0-9a-fA-F]{7,40}", args.commit):
        parser.error(f"--commit {args.commit!r}: expected a git commit hash (7-40 hex digits)")
    if args.timeout is not None and not args.timeout > 0:
        parser.error(f"--timeout {args.timeout}: expected a positive number of seconds")
    return args


def _write(path: Path, manifest: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    tmp.replace(path)


def _run_one(command: list[str], log: Path, env: dict, timeout: float | None) -> tuple[int, float]:
    """Run ``command`` with its output to the console and to ``log``; (exit status, seconds). Killed (status -9)
    after ``timeout`` seconds when given."""
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, bufsize=1)
        timer = threading.Timer(timeout, proc.kill) if timeout is not None else None
        if timer is not None:
            timer.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                sys.stdout.write(line)
                out.write(line)
            rc = proc.wait()
        finally:
            if timer is not None:
                timer.cancel()
        if timeout is not None and time.perf_counter() - start >= timeout:
            out.write(f"\nrun.py: killed after {timeout} s\n")
    return rc, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.list:
        for name, suite in SUITES.items():
            print(f"{name}: {suite.question}")
            for command in suite.commands:
                print("    python benchmarks/" + " ".join(command))
        return 0
    steps = plan(args.suites, args.extra)
    dropped = dropped_options(args.suites, args.extra)
    if dropped:  # the replaced arguments fall back to the script's defaults: say which, before the device time goes
        print(f"run.py: the arguments after -- replace the suite's; these of its options now take the script's "
              f"defaults: {' '.join(dropped)}", file=sys.stderr)
    device = device_info()
    started = datetime.datetime.now(datetime.timezone.utc)
    folder = run_folder(args.results, args.name or "-".join(args.suites), device_slug(device["name"]), started.date())
    commit = commit_info(args.commit)
    manifest = {
        "name": folder.name,
        "command": " ".join(["python", "benchmarks/run.py", *(sys.argv[1:] if argv is None else argv)]),
        "suites": {name: SUITES[name].question for name in args.suites},
        "started": started.isoformat(timespec="seconds"),
        "finished": None,
        "commit": commit,
        "device": device,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": versions(),
        "env": {k: v for k, v in os.environ.items() if k.startswith("CGFORGE_")},
        "runs": [],
    }
    if args.dry_run:
        print(f"would write {folder}")
        for suite, command in steps:
            print(f"  {suite}: python benchmarks/{' '.join(command)}")
        print(json.dumps(manifest, indent=1))
        return 0
    folder.mkdir(parents=True)
    path = folder / "manifest.json"
    _write(path, manifest)
    env = dict(os.environ, OUT=str(folder), PYTHONUNBUFFERED="1")
    if commit["sha"]:
        env["CGFORGE_COMMIT"] = commit["sha"]
        env["CGFORGE_COMMIT_DIRTY"] = {True: "1", False: "0", None: ""}[commit["dirty"]]
    failed = 0
    seen: dict[str, int] = {}
    for suite, command in steps:
        seen[suite] = seen.get(suite, 0) + 1
        log = folder / (f"{suite}.log" if seen[suite] == 1 else f"{suite}-{seen[suite]}.log")
        before = {p.name for p in folder.iterdir()}
        print(f"== {suite}: python benchmarks/{' '.join(command)}  (log: {log})", flush=True)
        rc, seconds = _run_one([sys.executable, str(HERE / command[0]), *command[1:]], log, env, args.timeout)
        files = sorted(p.name for p in folder.iterdir() if p.name not in before and p.name not in (log.name,))
        manifest["runs"].append({"suite": suite, "command": "python benchmarks/" + " ".join(command), "rc": rc,
                                 "seconds": round(seconds, 1), "log": log.name,
                                 "files": [f for f in files if f != "manifest.tmp"]})
        failed += rc != 0
        _write(path, manifest)
    manifest["finished"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    _write(path, manifest)
    print(f"run folder: {folder} ({len(steps) - failed} of {len(steps)} commands exited 0)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
