"""Bytes a force call writes, by kind of op and by the cgforge line that issued it: a CPU count of the data
movement that is not arithmetic (copies, concatenations, fills), to find and check what a GPU profile lists as
"copy/cat" without a GPU.

The MACE-MP-medium shape on a 1029-atom water box, FP32, on the CPU. ``--rows-like-1m`` scales the chunk sizes
by the box (the row chunks and the chunked linears' sizes of a 1.03 M-atom call, divided by 1000) so the call
takes the path a million atoms take. Convolution and symmetric-contraction kernels run as their torch references
on the CPU: ops issued under ``cgforge/kernels/`` are one kernel on the GPU and are listed apart. Backward ops of
torch's own autograd nodes are attributed to the line that asked for the gradient.

    python3 benchmarks/investigations/copy_traffic.py [--rows-like-1m] [--top 25]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import traceback
from collections import defaultdict
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
from shapes import mace_mp_shape  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
COPY_OPS = {"cat", "copy_", "clone", "_to_copy", "index_copy_", "index_copy", "slice_scatter", "contiguous",
            "as_strided_scatter", "select_scatter", "stack"}
FILL_OPS = {"fill_", "zero_", "zeros", "zeros_like", "new_zeros", "full", "new_full", "ones_like", "ones"}
GEMM_OPS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear"}
ONE_M_ATOMS = 1_029_000


def kind(name: str) -> str:
    return ("copy/cat" if name in COPY_OPS else "fill" if name in FILL_OPS else "GEMM" if name in GEMM_OPS
            else "other")


def _innermost(frames: list[tuple[str, int, str]]) -> str | None:
    for filename, lineno, name in reversed(frames):
        parts = Path(filename).parts
        for package in ("cgforge", "mace", "e3nn"):
            if package in parts and not filename.endswith("copy_traffic.py"):
                return f"{'/'.join(parts[parts.index(package):])}:{lineno} {name}"
    return None


def call_site() -> str:
    """The innermost frame in cgforge, mace or e3nn that issued the op, 'package/file:line function'; for an
    op of torch's own backward, '<node> of' the forward line that made the node (anomaly mode records it)."""
    node = torch._C._current_autograd_node()
    if node is not None and not type(node).__name__.startswith("BackwardCFunction"):
        trace = node.metadata.get("traceback_", [])
        frames = []
        for line in trace:  # formatted stack lines: '  File "x.py", line 12, in f\n    code\n'
            if line.lstrip().startswith("File "):
                head = line.strip().split("\n")[0]
                filename = head.split('"')[1]
                lineno = int(head.split("line ")[1].split(",")[0])
                frames.append((filename, lineno, head.rsplit("in ", 1)[-1]))
        return f"{node.name()} of {_innermost(frames) or '(outside cgforge)'}"
    frames = [(f.filename, f.lineno, f.name) for f in traceback.extract_stack()[:-3]]
    return _innermost(frames) or "(outside cgforge)"


class Traffic(TorchDispatchMode):
    """Bytes written by each op (its tensor outputs), keyed by (kind, site)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        outs = out if isinstance(out, (tuple, list)) else (out,)
        written = sum(t.numel() * t.element_size() for t in outs if isinstance(t, torch.Tensor))
        if name in COPY_OPS and name in ("copy_",) and isinstance(args[0], torch.Tensor):
            written = args[0].numel() * args[0].element_size()
        if written and not name.startswith(("view", "_reshape_alias", "_unsafe_view", "new_empty", "empty_like", "as_strided", "t", "transpose", "permute",
                                            "expand", "slice", "select", "split", "narrow", "unsqueeze", "squeeze",
                                            "detach", "alias", "empty")):
            site = call_site()
            reference = ("reference", "_csr_edges", "_Eager", "kernels/symmetric_contraction")
            k = "kernel (reference on CPU)" if any(r in site for r in reference) else kind(name)
            self.bytes[k, f"{name} @ {site}"] += written
            self.calls[k, f"{name} @ {site}"] += 1
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows-like-1m", action="store_true", help="chunk sizes scaled to the box (1 M's path)")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--side", type=int, default=7, help="molecules per box side (7: 1029 atoms)")
    args = parser.parse_args()
    torch.manual_seed(0)
    from cgforge.patches import e3nn_layers
    from cgforge.patches.mace import row_chunks
    from cgforge.plugin.calculator import Calculator
    from cgforge.plugin.water import water_box

    atoms = water_box(n_side=args.side)
    scale = ONE_M_ATOMS / len(atoms)
    if args.rows_like_1m:  # the thresholds over the box ratio: 1 M atoms' chunked path
        above, chunk = int(e3nn_layers.CHUNKED_ABOVE_BYTES / scale), int(e3nn_layers.CHUNK_BYTES / scale)
        for module in (e3nn_layers, row_chunks):
            module.CHUNKED_ABOVE_BYTES, module.CHUNK_BYTES = above, chunk
        row_chunks.MIN_CHUNK_ROWS = 1
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "mace-mp-medium.model"
        torch.save(mace_mp_shape(torch.float32, "medium"), path)
        atoms.calc = Calculator(path, device="cpu", dtype="float32", skin=1.0, patch=True, radial_table=True)
        atoms.get_forces()  # plans, warm-up
        atoms.positions += 0.01  # inside the skin: the same graph, a new call
        with Traffic() as traffic, torch.autograd.detect_anomaly(check_nan=False):
            atoms.calc.calculate(atoms, ["energy", "forces"], ["positions"])
    n = len(atoms)
    totals: dict[str, int] = defaultdict(int)
    for (k, _), b in traffic.bytes.items():
        totals[k] += b
    print(f"{n} atoms, rows like 1 M: {args.rows_like_1m}; bytes written per atom by kind:")
    for k, b in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"  {k:28s} {b / n / 1024:10.1f} KiB/atom")
    print(f"top {args.top} sites outside the kernels:")
    rows = sorted(((b, k, s) for (k, s), b in traffic.bytes.items() if not k.startswith("kernel")), reverse=True)
    for b, k, s in rows[:args.top]:
        print(f"  {b / n / 1024:8.1f} KiB/atom  {traffic.calls[k, s]:5d} calls  {k:9s} {s}")


if __name__ == "__main__":
    main()
