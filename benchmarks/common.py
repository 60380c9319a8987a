"""Timing, peer loading and reporting shared by the benchmark scripts."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from pathlib import Path

import numpy as np
import torch

RESULTS = Path(__file__).resolve().parent / "results"
NP_DTYPE = {torch.float32: np.float32, torch.float64: np.float64}  # OpenEquivariance wants numpy dtypes


def cuda_time(fn, iters: int = 20, warmup: int = 5) -> float:
    """Median milliseconds of fn() measured with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def copy_bandwidth() -> float:
    """Bytes/s of a large device-to-device copy (read + write), the practical memory roof."""
    a = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = cuda_time(lambda: b.copy_(a), iters=10, warmup=3)
    return 2 * a.numel() / (ms * 1e-3)


def peers() -> dict:
    found = {}
    if os.environ.get("CGFORGE_BENCH_PEERS", "1") == "0":
        return found
    try:
        import openequivariance as oeq

        found["oeq"] = oeq
    except Exception as exc:  # peers are optional: report, do not fail
        print("OpenEquivariance not importable:", repr(exc)[:200])
    try:
        import cuequivariance as cue
        import cuequivariance_torch as cuet

        found["cueq"] = (cue, cuet)
    except Exception as exc:
        print("cuEquivariance not importable:", repr(exc)[:200])
    return found


def cueq_channelwise(found: dict, irreps_in1, irreps_in2, irreps_out, dtype: torch.dtype):
    """cuEquivariance's fused channelwise convolution of these irreps on CUDA: (its SegmentedPolynomial, the
    polynomial, for its operand sizes). Call it ``sp([w, x, y], {1: sender}, {0: out}, {0: receiver})``."""
    cue, cuet = found["cueq"]
    poly = (cue.descriptors.channelwise_tensor_product(
        cue.Irreps("O3", str(irreps_in1)), cue.Irreps("O3", str(irreps_in2)), cue.Irreps("O3", str(irreps_out)))
        .flatten_coefficient_modes().squeeze_modes().polynomial)
    return cuet.SegmentedPolynomial(poly, math_dtype=dtype, method="uniform_1d").to("cuda"), poly


def commit() -> dict:
    """``{"commit": sha, "dirty": bool | None, "commit_source": ...}``: ``$CGFORGE_COMMIT`` when set (benchmarks/run.py
    sets it; a copy of the repository whose .git is stale or missing must: its HEAD is not what runs), else git's
    HEAD and whether ``git status --porcelain`` lists changes."""
    if os.environ.get("CGFORGE_COMMIT"):
        dirty = {"1": True, "0": False}.get(os.environ.get("CGFORGE_COMMIT_DIRTY", ""))
        return {"commit": os.environ["CGFORGE_COMMIT"], "dirty": dirty, "commit_source": "CGFORGE_COMMIT"}
    root = Path(__file__).resolve().parents[1]
    try:
        sha = subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=root, text=True,
                                      stderr=subprocess.DEVNULL).strip()
        status = subprocess.check_output(["git", "status", "--porcelain"], cwd=root, text=True,
                                         stderr=subprocess.DEVNULL)
    except Exception:
        return {"commit": "unknown", "dirty": None, "commit_source": "none (no git, no CGFORGE_COMMIT)"}
    return {"commit": sha, "dirty": bool(status.strip()), "commit_source": "git HEAD"}


def environment() -> dict:
    info = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__,
            "python": platform.python_version()}
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
    info.update(commit())
    for mod in ("e3nn", "cupy", "cuequivariance", "openequivariance"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:
            pass
    return info


def sync(device: str) -> None:
    """Wait for the device's queued work (a no-op off CUDA): before and after a timed region."""
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def write_json(name: str, payload: dict, path: Path | None = None) -> Path:
    """``payload`` to ``$OUT/NAME-DATE-TIME.json`` (or, given, ``path`` again: a run rewrites its file after each row,
    so one cut short by a timeout keeps the rows it measured)."""
    if path is None:
        out_dir = Path(os.environ.get("OUT", RESULTS))
        out_dir.mkdir(parents=True, exist_ok=True)  # a fresh $OUT folder too
        path = out_dir / f"{name}-{datetime.datetime.now():%Y%m%d-%H%M%S}.json"
    path.write_text(json.dumps(payload, indent=1))
    return path


def fmt(v) -> str:
    return f"{v:8.3f}" if isinstance(v, float) else f"{'n/a':>8s}"


def device_spans(prof) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of every device activity (kernels, copies) of a torch.profiler run, by start."""
    return sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                  if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start)


def device_timeline(spans: list[tuple[float, float, str]], steps: int) -> dict:
    """What the device did over ``steps`` steps of ``spans`` (``device_spans``): ms per step of wall (first start
    to last end), busy (any activity on any stream) and idle time (no activity), activities and kernels (not
    Memcpy/Memset) per step, the idle intervals (us) and their total by the (before, after) pair of activities
    around each."""
    idle_by: dict[tuple[str, str], float] = {}
    gaps_by: dict[tuple[str, str], int] = {}
    busy, gaps = 0.0, []
    if spans:
        end, last = spans[0][0], spans[0][2]
        for start, stop, name in spans:
            if start > end:
                idle_by[(last, name)] = idle_by.get((last, name), 0.0) + start - end
                gaps_by[(last, name)] = gaps_by.get((last, name), 0) + 1
                gaps.append(start - end)
            if stop > end:
                busy += stop - max(start, end)
                end, last = stop, name
    wall = spans[-1][1] - spans[0][0] if spans else 0.0
    kernels = sum(1 for s in spans if not s[2].startswith(("Memcpy", "Memset")))
    return {"wall_ms": wall / steps / 1e3, "busy_ms": busy / steps / 1e3, "idle_ms": (wall - busy) / steps / 1e3,
            "activities": len(spans) / steps, "kernels": kernels / steps, "gaps_us": sorted(gaps),
            "idle_by_pair_us": idle_by, "gaps_by_pair": gaps_by}
