"""A subprocess run with its memory watched, for telling an out-of-memory kill from any other.

A rank of a real-LAMMPS run was SIGKILLed in CI with no error of its own (2026-11-28, and twice in a row on
2026-12-03), yet the machine had 21 GiB available just after, and the largest finished child's peak (3.3 GiB)
could not include the ranks: mpirun's proxy does not wait for ranks it kills. ``run_watched`` samples the whole
process tree's resident memory and the machine's available memory while the run lasts, and reads the kernel's count
of OOM kills before and after, so that a failure says which it was.
"""

from __future__ import annotations

import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MemoryWatch", "run_watched"]

PROC = Path("/proc")
GIB_IN_KIB = 2**20


def available_gib() -> float | None:
    """MemAvailable of /proc/meminfo, or None where there is none."""
    try:
        for line in (PROC / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / GIB_IN_KIB
    except OSError:
        pass
    return None


def oom_kills() -> int | None:
    """The kernel's count of processes its OOM killer has killed since boot (/proc/vmstat, Linux >= 4.13)."""
    try:
        for line in (PROC / "vmstat").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def tree_rss_gib(root: int) -> float:
    """Resident memory of ``root`` and all its living descendants, in GiB (0 where /proc cannot be read)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}  # KiB
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text().splitlines()
        except OSError:  # the process ended while we looked
            continue
        for line in status:
            if line.startswith("PPid:"):
                children.setdefault(int(line.split()[1]), []).append(int(entry.name))
            elif line.startswith("VmRSS:"):
                rss[int(entry.name)] = int(line.split()[1])
    total, frontier = 0, [root]
    while frontier:
        pid = frontier.pop()
        total += rss.get(pid, 0)
        frontier += children.get(pid, [])
    return total / GIB_IN_KIB


@dataclass
class MemoryWatch:
    """What a watched run's memory did: its tree's largest sampled resident size, the least memory the machine had
    available while it ran, and how many processes the kernel's OOM killer killed meanwhile (None: not readable)."""

    peak_tree_gib: float = 0.0
    least_available_gib: float | None = None
    oom_kills: int | None = None

    def describe(self) -> str:
        """One line for a warning or a failure message."""
        def gib(value: float | None) -> str:
            return "unknown" if value is None else f"{value:.1f} GiB"

        kills = "unknown" if self.oom_kills is None else str(self.oom_kills)
        return (f"the run's processes peaked at {self.peak_tree_gib:.2f} GiB resident, the machine had "
                f"{gib(self.least_available_gib)} available at least, the kernel's OOM killer killed {kills} "
                f"processes meanwhile; available now {gib(available_gib())}")


def run_watched(cmd: list[str], timeout: float, interval: float = 0.5,
                **popen: object) -> tuple[subprocess.CompletedProcess, MemoryWatch]:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **popen)`` with its memory sampled
    every ``interval`` seconds (``MemoryWatch``). A timeout kills the run and raises ``TimeoutExpired`` as run does."""
    watch, kills_before = MemoryWatch(), oom_kills()
    stop = threading.Event()
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen) as proc:

        def sample() -> None:
            while True:
                watch.peak_tree_gib = max(watch.peak_tree_gib, tree_rss_gib(proc.pid))
                now = available_gib()
                if now is not None:
                    least = watch.least_available_gib
                    watch.least_available_gib = now if least is None else min(least, now)
                if stop.wait(interval):
                    return

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
        finally:
            stop.set()
            sampler.join()
    kills_after = oom_kills()
    if kills_before is not None and kills_after is not None:
        watch.oom_kills = kills_after - kills_before
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr), watch
