"""Where the pipelined rebuild's host time goes (issue 62): the ops, host syncs and allocations of the MD engine's
``snapshot`` / ``search`` / ``install`` (``ModelForces``), phase by phase, with each sync's call site; runs on a CPU.

    python benchmarks/investigations/search_host_ops.py [--atoms 5184] [--device cpu|cuda] [--path native|cuda|both]
                                                       [--cycles 3] [--block-ms 2.5] [--results FOLDER]

The bundled MACE ``Calculator`` (FP32, skin 1 Å) on ``water_box`` (``--atoms`` / 3 molecules), its ``ModelForces``
made and started as ``Engine`` does, then ``--cycles`` rebuild cycles as the engine runs them (``snapshot`` before
a block, ``search`` after it, ``install`` between blocks; the positions moved by 0.02 Å between cycles). Per phase
and sub-phase (``neighbour_list``: ``_bin_atoms``, ``candidate_pairs``, the exact cut; ``list_topology``:
``pair_reverse``; ``install``: the Verlet list, ``_load_verlet``, ``_keep``, the reference), counted in one cycle
under a TorchDispatchMode (every aten op, the new storages it allocates) and a TorchFunctionMode (host reads):

  syncs, by kind, each with its call site (the innermost cgforge frame), the ops that make a CUDA host wait:
    scalar: ``_local_scalar_dense`` (``int()``, ``float()``, ``bool()``, ``.item()`` of a device tensor);
    d2h: ``.cpu()``, ``.tolist()``, ``.numpy()``, ``.to("cpu")``, ``np.asarray`` of a device tensor;
    h2d: ``torch.tensor`` / ``torch.as_tensor`` of host data onto the device (a pageable copy: torch syncs the
         stream after it);
    shape: an output sized by device data (``nonzero``, ``masked_select``, ``unique``, indexing with a bool mask,
         ``repeat_interleave`` without ``output_size``);
  and the host wall time of each phase and part (the timed cycles, outside the modes; on CUDA from one
  ``torch.cuda.synchronize()`` to the next, but the search: ``--block-ms`` of matmuls are queued on the main stream
  before it, as the engine's block, and it is timed until it returns, its host time), with each phase's
  ``cudaStreamSynchronize`` / memcpy / launch calls counted by ``torch.profiler`` on CUDA.

``--path cuda`` (CPU only) runs the CUDA branch's host code on the CPU: ``Tensor.is_cuda`` reads True, the step is
padded (as a CUDA-graph step is), and the custom kernels' launches (``cell_pairs``, ``pair_reverse``) are replaced by
their torch references, run outside the counts (a launch is counted as one). Its op and sync counts are the CUDA
path's (the ``device.type == "cuda"`` branches of ``ModelForces`` aside: streams, events, and install's 5 clones);
its wall times are not. ``--path native``: the device's own path (on a CPU the torch candidate loop). Prints a
table; JSON goes to --results (default $OUT or benchmarks/results/).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import statistics
import sys
import time
import traceback
import types
import weakref
from collections import Counter, defaultdict
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

BENCH = Path(__file__).resolve().parent.parent  # benchmarks/
sys.path.insert(0, str(BENCH))
from common import environment, sync, write_json  # noqa: E402

import cgforge  # noqa: E402

PACKAGE = str(Path(cgforge.__file__).resolve().parent)
PHASES = ("snapshot", "search", "install")
# aten ops whose output size depends on device data: a CUDA host waits for the count
SHAPE_OPS = ("nonzero", "masked_select", "_unique", "unique_", "unique_consecutive", "unique_dim", "argwhere",
             "nonzero_numpy")
SCALAR_OPS = ("_local_scalar_dense",)
D2H_METHODS = ("tolist", "numpy", "cpu", "__array__")
H2D_FUNCTIONS = ("tensor", "as_tensor")


def call_site() -> str:
    """The innermost frame in the cgforge package: ``path:line function`` (path from the package's parent)."""
    for frame in reversed(traceback.extract_stack()):
        if frame.filename.startswith(PACKAGE):
            rel = os.path.relpath(frame.filename, os.path.dirname(PACKAGE))
            return f"{rel}:{frame.lineno} {frame.name}"
    return "(outside cgforge)"


class Recorder:
    """Ops, syncs and allocations of what runs inside ``phase`` labels (a stack: ``search/neighbour_list/...``)."""

    def __init__(self) -> None:
        self.labels: list[str] = []
        self.recording = False  # counts only in the recorded cycle
        self.paused = 0
        self.ops: dict[str, Counter] = defaultdict(Counter)  # label -> op name -> count
        self.op_s: dict[str, Counter] = defaultdict(Counter)  # label -> op name -> seconds inside the op
        self.allocs: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # label -> [storages, bytes]
        self.syncs: list[dict] = []
        self.launches: Counter = Counter()  # label -> custom kernel launches (emulated path)
        self.stand_in_s = 0.0  # seconds in the stand-ins of kernel launches (--path cuda), outside every count
        self.timing = False  # the timed cycles: wall seconds per label (inclusive, less the stand-ins) summed
        self.wall_s: Counter = Counter()

    @property
    def label(self) -> str:
        return "/".join(self.labels) or "(none)"

    @contextlib.contextmanager
    def phase(self, name: str):
        self.labels.append(name)
        label, stand_in, start = self.label, self.stand_in_s, time.perf_counter()
        try:
            yield
        finally:
            if self.timing:
                self.wall_s[label] += time.perf_counter() - start - (self.stand_in_s - stand_in)
            self.labels.pop()

    def active(self) -> bool:
        return self.recording and bool(self.labels) and not self.paused

    def sync(self, kind: str, what: str) -> None:
        self.syncs.append({"label": self.label, "kind": kind, "op": what, "site": call_site()})


class Ops(TorchDispatchMode):
    def __init__(self, rec: Recorder) -> None:
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rec = self.rec
        if not rec.active():
            return func(*args, **kwargs)
        name = func.name().split("::")[-1]  # e.g. "nonzero", "index.Tensor"
        base = name.split(".")[0]
        inputs = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
        start = time.perf_counter()
        out = func(*args, **kwargs)
        rec.op_s[rec.label][name] += time.perf_counter() - start
        rec.ops[rec.label][name] += 1
        for t in _tensors(out):
            storage = t.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in inputs:
                rec.allocs[rec.label][0] += 1
                rec.allocs[rec.label][1] += storage.nbytes()
        if base in SCALAR_OPS:
            rec.sync("scalar", name)
        elif base in SHAPE_OPS or base.startswith("_unique"):
            rec.sync("shape", name)
        elif base == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] or ()):
            rec.sync("shape", name + " (bool mask)")
        elif base == "repeat_interleave" and kwargs.get("output_size") is None and not (
                len(args) > 2 and isinstance(args[-1], int)) and name.endswith("Tensor"):
            rec.sync("shape", name + " (no output_size)")
        return out


class HostReads(TorchFunctionMode):
    """Host reads of device tensors; a tensor that a read made (``.cpu()``) is a host tensor (reading it: no sync)."""

    def __init__(self, rec: Recorder) -> None:
        super().__init__()
        self.rec = rec
        self.host: dict[int, weakref.ref] = {}  # id -> the host tensor (tensors compare by value: no WeakSet)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rec, name = self.rec, getattr(func, "__name__", str(func))
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        on_host = first is not None and id(first) in self.host and self.host[id(first)]() is first
        out = func(*args, **kwargs)
        if rec.active() and not on_host:
            if name in D2H_METHODS or (name == "to" and _to_host(args, kwargs)):
                rec.sync("d2h", f"Tensor.{name}" + ("(cpu)" if name == "to" else ""))
                self.mark(out)
            elif name in H2D_FUNCTIONS:
                if kwargs.get("device") is not None:
                    rec.sync("h2d", f"torch.{name}(device=)")
                else:
                    self.mark(out)
        return out


    def mark(self, t) -> None:
        if isinstance(t, torch.Tensor):
            self.host[id(t)] = weakref.ref(t)


def _to_host(args, kwargs) -> bool:
    device = kwargs.get("device", args[1] if len(args) > 1 else None)
    return isinstance(device, str | torch.device) and torch.device(device).type == "cpu"


def _tensors(tree) -> list[torch.Tensor]:
    flat = []
    stack = [tree]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            flat.append(x)
        elif isinstance(x, list | tuple):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
    return flat


def wrap(owner, attr: str, rec: Recorder, label: str, patches: list) -> None:
    """``owner.attr`` runs inside ``rec.phase(label)`` (undone from ``patches``)."""
    original = getattr(owner, attr)

    @functools.wraps(original)
    def labelled(*args, **kwargs):
        with rec.phase(label):
            return original(*args, **kwargs)

    patches.append((owner, attr, original))
    setattr(owner, attr, labelled)


def label_parts(provider, rec: Recorder) -> list:
    """Sub-phase labels on the functions the phases call; returns the patches to undo."""
    from cgforge.kernels import edge_layout
    from cgforge.plugin.md import forces
    from cgforge.plugin.runtime import neighbours, step_graph

    step, nl = provider.step, provider.potential.neighbours
    patches: list = []
    for owner, attr, label in ((forces, "neighbour_list", "neighbour_list"), (neighbours, "_bin_atoms", "bin_atoms"),
                               (neighbours, "candidate_pairs", "candidate_pairs"),
                               (step, "list_topology", "list_topology"), (step_graph, "edge_topology", "edge_topology"),
                               (edge_layout, "pair_reverse", "pair_reverse"), (step, "install_list", "install_list"),
                               (nl, "install", "verlet.install"), (step, "_load_verlet", "load_verlet"),
                               (step, "_load_topology", "load_topology"), (step, "_keep", "keep"),
                               (provider, "_set_reference", "set_reference")):
        wrap(owner, attr, rec, label, patches)
    return patches


def undo(patches: list) -> None:
    for owner, attr, original in reversed(patches):
        if isinstance(owner, types.ModuleType):  # put the function back
            setattr(owner, attr, original)
        else:  # an instance: drop the attribute, the class's method shows again
            delattr(owner, attr)


class _FakeLaunch:
    """A custom kernel's launch on the CPU: its outputs from the torch reference, outside the counts."""

    def __init__(self, name: str, rec: Recorder, memo: dict) -> None:
        self.name, self.rec, self.memo = name, rec, memo

    def launch(self, grid, block, args) -> None:
        from cgforge.kernels.cell_search import Bins, candidate_pairs_reference
        from cgforge.kernels.pair_reverse import pair_reverse_reference

        rec = self.rec
        if rec.active():
            rec.launches[rec.label] += 1
        rec.paused += 1
        start = time.perf_counter()
        try:
            with torch.no_grad():
                if self.name.startswith("cell_pairs"):
                    (sorted_pos, atoms_by_bin, coord, first_in_bin, atoms_in_bin, cell, wrap_, b0, b1, b2, r0, r1, r2,
                     p0, p1, p2, cutoff2, n, rowptr, counts, sender, shifts) = args
                    if rowptr is None:  # pass 1: the counts (the pairs kept for pass 2)
                        wrapped = torch.empty_like(sorted_pos).index_copy_(0, atoms_by_bin, sorted_pos)
                        bins = (int(b0), int(b1), int(b2))
                        bin_of_atom = (coord[:, 0] * bins[1] + coord[:, 1]) * bins[2] + coord[:, 2]
                        binned = Bins(wrapped, wrap_, coord, bin_of_atom, atoms_by_bin, atoms_in_bin, first_in_bin,
                                      bins, (int(r0), int(r1), int(r2)), math.sqrt(float(cutoff2)))
                        pbc = (bool(p0), bool(p1), bool(p2))
                        self.memo["pairs"] = candidate_pairs_reference(binned, cell, pbc, 1 << 22)
                        counts.copy_(torch.bincount(self.memo["pairs"][1], minlength=int(n)))
                    else:  # pass 2: rows in (receiver, sender) order, which the caller's sort keeps
                        found, _, found_shifts = self.memo.pop("pairs")
                        sender.copy_(found)
                        shifts.copy_(found_shifts)
                elif self.name == "pair_reverse":
                    sender, receiver, shifts, rowptr, pairs, reverse, missing = args
                    found = pair_reverse_reference(sender, receiver, shifts, rowptr.shape[0] - 1)
                    if found is None:
                        missing.fill_(1)
                    else:
                        reverse.copy_(found)
                else:
                    raise NotImplementedError(f"no CPU stand-in for the kernel {self.name}")
        finally:
            rec.paused -= 1
            rec.stand_in_s += time.perf_counter() - start


@contextlib.contextmanager
def cuda_branches(rec: Recorder):
    """``Tensor.is_cuda`` True and the search's kernels launched on the CPU (``_FakeLaunch``), for ``--path cuda``."""
    from cgforge.kernels import cell_search, pair_reverse

    memo: dict = {}
    saved = [(k, k.get) for k in (cell_search._KERNELS, pair_reverse._KERNELS)]
    for kernels, _ in saved:
        kernels.get = lambda name, device: _FakeLaunch(name, rec, memo)
    torch.Tensor.is_cuda = property(lambda self: True)
    try:
        yield
    finally:
        del torch.Tensor.is_cuda  # torch._C.TensorBase's property shows again
        for kernels, _ in saved:
            del kernels.get


def make_provider(atoms_count: int, device: str, skin: float, padded: bool):
    """The bundled MACE's ModelForces as ``Engine`` makes and starts it, and the engine's state."""
    from cgforge.plugin import Calculator
    from cgforge.plugin.md.engine import Engine
    from cgforge.plugin.md.integrators import Langevin
    from cgforge.plugin.water import water_box

    atoms = water_box(max(1, atoms_count // 3), seed=0)
    calc = Calculator("mace", device=device, dtype="float32", skin=skin)
    engine = Engine(calc, atoms, Langevin(0.5, 300.0, 0.01), seed=0)
    provider = engine.provider
    if padded:
        provider.step.padded = True  # as a CUDA-graph step is (padded buffers: _load_verlet's refit)
    s = engine.state
    provider.start(s.positions, s.cell, engine.pbc, atoms.numbers, engine.integrator.changes_cell)
    return engine, provider


def block_stand_in(device: str, ms: float):
    """A function queueing ~``ms`` ms of main-stream work that fills the device (FP32 matmuls): the block the
    search hides behind in the engine (its side stream's kernels then wait for SMs, as there). None off CUDA."""
    if not device.startswith("cuda") or ms <= 0:
        return None
    a = torch.randn(4096, 4096, device=device)
    out = torch.empty_like(a)
    for _ in range(3):
        torch.mm(a, a, out=out)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        torch.mm(a, a, out=out)
    end.record()
    torch.cuda.synchronize()
    count = max(1, round(ms / (start.elapsed_time(end) / 10)))

    def run() -> None:
        for _ in range(count):
            torch.mm(a, a, out=out)

    return run


def cycle(engine, provider, rec: Recorder, times: dict | None, device: str, generator, block=None) -> None:
    """One pipelined rebuild as the engine runs it: snapshot, (the block: the positions move, ``block()`` queues its
    device work), search, install; ``times``: the phases' wall ms (less the kernels' CPU stand-ins) appended: from
    a synced device to a synced device, but the search behind a block: until it returns (its host time)."""
    s = engine.state

    def timed(name: str, fn, behind: bool = False):
        if not behind:
            sync(device)
        stand_in, start = rec.stand_in_s, time.perf_counter()
        with rec.phase(name):
            out = fn()
        if not behind:
            sync(device)
        elapsed = time.perf_counter() - start - (rec.stand_in_s - stand_in)
        sync(device)
        if times is not None:
            times[name].append(1e3 * elapsed)
        return out

    pending = timed("snapshot", lambda: provider.snapshot(s.positions, s.cell))
    with torch.no_grad():  # the block the search hides behind
        s.positions.add_(0.02 * torch.randn(s.positions.shape, generator=generator, dtype=s.positions.dtype)
                         .to(s.positions.device))
        if block is not None:
            block()
    timed("search", lambda: provider.search(pending), behind=block is not None)
    timed("install", lambda: provider.install(pending))


def cuda_calls(engine, provider, device: str, generator) -> dict:
    """Per phase, the CUDA runtime and driver calls of one cycle (torch.profiler's host events named cuda*/cu*:
    cudaStreamSynchronize, cudaMemcpyAsync, cudaLaunchKernel, cuLaunchKernel, ...), by name."""
    from torch.profiler import ProfilerActivity, profile

    s = engine.state
    found = {}
    pending = None
    for name in PHASES:
        sync(device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            if name == "snapshot":
                pending = provider.snapshot(s.positions, s.cell)
            elif name == "search":
                provider.search(pending)
            else:
                provider.install(pending)
        sync(device)
        found[name] = dict(Counter(e.name for e in prof.events() if e.device_type.name == "CPU"
                                   and e.name.startswith("cu") and e.name[2:3].isalpha() and e.name[2:3] != "t"))
    return found


def run_path(path: str, args) -> dict:
    rec = Recorder()
    emulate = path == "cuda"
    engine, provider = make_provider(args.atoms, args.device, args.skin, padded=emulate)
    generator = torch.Generator().manual_seed(0)
    patches = label_parts(provider, rec)
    branches = cuda_branches(rec) if emulate else contextlib.nullcontext()
    block = block_stand_in(args.device, args.block_ms)
    try:
        with branches:
            cycle(engine, provider, rec, None, args.device, generator, block)  # warm-up (kernel loads, allocator)
            times: dict[str, list] = defaultdict(list)
            rec.timing = True
            for _ in range(args.cycles):
                cycle(engine, provider, rec, times, args.device, generator, block)
            rec.timing = False
            rec.recording = True
            with HostReads(rec), Ops(rec):
                cycle(engine, provider, rec, None, args.device, generator)
            rec.recording = False
            calls = (cuda_calls(engine, provider, args.device, generator) if args.device.startswith("cuda")
                     else None)
    finally:
        undo(patches)
    n_pairs = int(provider.potential.neighbours.sender.shape[0])
    return {"path": path, "pairs": n_pairs, "wall_ms": {k: statistics.median(v) for k, v in times.items()},
            "label_wall_ms": {k: 1e3 * v / args.cycles for k, v in rec.wall_s.items()},
            "wall_ms_all": dict(times), "ops": {k: dict(v) for k, v in rec.ops.items()},
            "op_ms": {k: {n: 1e3 * s for n, s in v.items()} for k, v in rec.op_s.items()},
            "allocs": {k: {"storages": v[0], "bytes": v[1]} for k, v in rec.allocs.items()},
            "launches": dict(rec.launches), "syncs": rec.syncs, "cuda_calls": calls}


def summarise(result: dict) -> list[dict]:
    """Rows per label (phase and sub-phases), each with the ops and syncs of that label alone (not its children)."""
    labels = sorted(set(result["ops"]) | {s["label"] for s in result["syncs"]} | set(result["launches"]),
                    key=lambda k: (PHASES.index(k.split("/")[0]) if k.split("/")[0] in PHASES else 9, k))
    rows = []
    for label in labels:
        ops = result["ops"].get(label, {})
        syncs = [s for s in result["syncs"] if s["label"] == label]
        rows.append({"label": label, "ops": sum(ops.values()), "launches": result["launches"].get(label, 0),
                     "syncs": len(syncs), "allocs": result["allocs"].get(label, {}).get("storages", 0),
                     "op_ms": sum(result["op_ms"].get(label, {}).values()),
                     "wall_ms": result["label_wall_ms"].get(label)})
    return rows


def report(result: dict) -> None:
    print(f"\n== path {result['path']}: {result['pairs']} Verlet pairs; wall ms (median): "
          + ", ".join(f"{k} {v:.2f}" for k, v in result["wall_ms"].items()))
    print("ops, launches, syncs, allocs, op ms: each label alone (op ms: inside the ops, one cycle); wall ms: "
          "inclusive, mean of the timed cycles (stand-ins excluded)")
    print(f"{'phase / part':44s} {'ops':>5s} {'launch':>6s} {'syncs':>5s} {'allocs':>6s} {'op ms':>8s} {'wall ms':>8s}")
    totals: dict[str, Counter] = defaultdict(Counter)
    for row in summarise(result):
        top = row["label"].split("/")[0]
        for key in ("ops", "launches", "syncs", "allocs"):
            totals[top][key] += row[key]
        wall = f"{row['wall_ms']:8.2f}" if row["wall_ms"] is not None else ""
        print(f"{row['label']:44s} {row['ops']:5d} {row['launches']:6d} {row['syncs']:5d} {row['allocs']:6d} "
              f"{row['op_ms']:8.2f} {wall}")
    for top, t in totals.items():
        print(f"{'TOTAL ' + top:44s} {t['ops']:5d} {t['launches']:6d} {t['syncs']:5d} {t['allocs']:6d}")
    print("ops by name (each label alone):")
    for label, ops in result["ops"].items():
        print(f"  {label}: " + ", ".join(f"{n} {c}" for n, c in sorted(ops.items(), key=lambda x: -x[1])))
    print("syncs (on CUDA the host waits), by call site:")
    sites = Counter((s["label"], s["kind"], s["op"], s["site"]) for s in result["syncs"])
    for (label, kind, op, site), count in sites.items():
        print(f"  {label:40s} {kind:6s} {count:2d}x {op:28s} {site}")
    if result["cuda_calls"]:
        print("CUDA runtime calls per phase:", result["cuda_calls"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--atoms", type=int, default=5184)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--path", choices=("native", "cuda", "both"), default=None,
                        help="native: the device's own code; cuda: the CUDA branch's host code on a CPU (default: "
                             "both on a CPU, native on CUDA)")
    parser.add_argument("--cycles", type=int, default=3, help="timed rebuild cycles (after one warm-up)")
    parser.add_argument("--skin", type=float, default=1.0)
    parser.add_argument("--block-ms", type=float, default=2.5, help="on CUDA: device ms of main-stream work queued "
                        "before each timed search, as the engine's block (0: the search alone on an idle device)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: a CUDA host dispatches "
                                                               "from one thread; 0: torch's default)")
    parser.add_argument("--results", type=Path, default=None, help="folder for the JSON (default $OUT or "
                                                                   "benchmarks/results/)")
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    path = args.path or ("native" if cuda else "both")
    if args.atoms < 3 or args.cycles < 1:
        parser.error(f"--atoms must be >= 3 (one water) and --cycles >= 1, got {args.atoms} and {args.cycles}")
    if cuda and path != "native":
        parser.error("--path cuda emulates the CUDA branch on a CPU: use --path native with --device cuda")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.results is not None:
        os.environ["OUT"] = str(args.results)
    results = [run_path(p, args) for p in (("native", "cuda") if path == "both" else (path,))]
    for result in results:
        report(result)
    out = write_json("search_host_ops", {"environment": environment(), "args": {k: str(v) for k, v in vars(args).items()},
                                         "torch_threads": torch.get_num_threads(), "results": results,
                                         "rows": {r["path"]: summarise(r) for r in results}})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
