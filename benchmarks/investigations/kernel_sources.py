"""Which lines of the model code launch the eager engine step's kernels (issues 38 and 62: which call sites make
the step's copies; restored from 97c4d26 for NequIP M, whose 87 copies a step were never charged to their lines).

    python3 benchmarks/investigations/kernel_sources.py [--model bundled-mace|bundled-nequip|mace-mp-medium|nequip-M]
                                                        [--molecules 1728] [--steps 5] [--top 40] [--ops copy_,cat]

Runs cgforge's MD engine eagerly (no CUDA graph; NVT Langevin, FP32, 0.5 fs) on bench_md's water box and model
(``bench_md.fp32_source``, at bench_md's skin), profiles ``--steps``
steps with the CPU and CUDA activities and Python stacks, and charges each torch op's own device time and call
count to the innermost frame of the step's code that called it (cgforge, mace, e3nn or nequip; torch's own frames
skipped). Prints the lines by device ms per step (with each line's costliest ops), then the totals.

An op that autograd runs in the backward is charged to ``bwd`` and the line of the forward op whose node it
evaluates (the node shares the forward op's sequence number): the backward's own stack need not be the code that
caused it (the first H100 run, 2026-11-27, charged 13 ms a step, more than the whole captured step, to 8 ops "in"
MACE's ``prepare_graph``). Read with care: a frame names the function and the line it starts on (the profiler's
Python tracer), not the calling line; and the eager step is not the captured one (``--steps`` may include a
neighbour-list rebuild). On a machine without CUDA the device times are zero and the counts are the CPU path's.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
import bench_md  # noqa: E402

from cgforge.plugin.calculator import Calculator  # noqa: E402
from cgforge.plugin.md.engine import Engine  # noqa: E402
from cgforge.plugin.water import water_box  # noqa: E402

MODELS = ("bundled-mace", "bundled-nequip", "mace-mp-medium", "nequip-M")

OWN_CODE = ("cgforge/", "mace/", "e3nn/", "nequip/")


def source_line(stack: list[str]) -> str:
    """The innermost frame of the step's own code in a profiler stack (innermost first), shortened."""
    for frame in stack:
        if any(part in frame for part in OWN_CODE) and "/torch/" not in frame:
            for root in ("site-packages/", str(Path(__file__).resolve().parents[2]) + "/"):
                frame = frame.split(root)[-1]
            return frame
    return "(no model frame: torch or the profiler)"


BACKWARD_NODE = "autograd::engine::evaluate_function: "


def _backward_node(evt):  # noqa: ANN001, ANN202 - torch.profiler FunctionEvents
    """The autograd node evaluation ``evt`` runs under, or None for a forward op."""
    node = evt.cpu_parent
    while node is not None and not node.name.startswith(BACKWARD_NODE):
        node = node.cpu_parent
    return node


def event_lines(events: list) -> list[tuple[object, str]]:
    """(op event, its line) for every ``aten::``/``cgforge::`` op of a profile with stacks: a forward op's line is
    ``source_line`` of its stack; a backward op's is ``bwd`` and the line of the forward op whose autograd node it
    runs under (the node's sequence number is the forward op's)."""
    ops = [e for e in events if e.name.startswith(("aten::", "cgforge::"))]
    forward: dict[int, str] = {}
    backward = {id(e): _backward_node(e) for e in ops}
    for e in ops:
        if backward[id(e)] is None and e.sequence_nr >= 0 and e.stack:
            forward.setdefault(e.sequence_nr, source_line(list(e.stack)))
    lines = []
    for e in ops:
        node = backward[id(e)]
        if node is None:
            lines.append((e, source_line(list(e.stack or []))))
        else:
            lines.append((e, "bwd " + forward.get(node.sequence_nr, f"({node.name[len(BACKWARD_NODE):]})")))
    return lines


def step_sources(prof: torch.profiler.profile, steps: int, only: tuple[str, ...] = ()
                 ) -> tuple[list[tuple[str, float, float, str]], float, float]:
    """[(line, device ms per step, op calls per step, its costliest ops)] slowest first, and the totals (ms, calls)
    per step (``event_lines``: backward ops by their forward op's line); ``only``: just the ops named ``aten::X``
    for X in it (``copy_``, ``cat``: the copies)."""
    ms: dict[str, float] = defaultdict(float)
    calls: dict[str, float] = defaultdict(float)
    ops: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for evt, line in event_lines(list(prof.events())):
        if only and evt.name.split("::")[-1] not in only:
            continue
        device_us = getattr(evt, "self_device_time_total", 0.0)
        if device_us <= 0 and torch.cuda.is_available():
            continue  # no kernel of its own (a view, a wrapper op)
        ms[line] += device_us / 1e3 / steps
        calls[line] += 1 / steps
        ops[line][evt.name] += device_us / 1e3 / steps
    rows = []
    for line in ms:
        top = sorted(ops[line].items(), key=lambda kv: -kv[1])[:3]
        rows.append((line, ms[line], calls[line], ", ".join(f"{name} {t:.3f}" for name, t in top)))
    rows.sort(key=lambda r: (-r[1], -r[2]))
    return rows, sum(ms.values()), sum(calls.values())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bundled-mace", choices=MODELS)
    parser.add_argument("--molecules", type=int, default=1728)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--ops", default="", help="comma-separated aten op names to keep (e.g. copy_,cat); all if empty")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.molecules < 1 or args.top < 1:
        parser.error(f"--steps, --molecules and --top must be >= 1, got {args.steps}, {args.molecules}, {args.top}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    atoms = bench_md.md_atoms(water_box(args.molecules), "float32", device)
    source = bench_md.fp32_source(args.model, Path(tempfile.mkdtemp()))
    calc = Calculator(source, device=device, skin=bench_md.SKIN,
                      dtype=None if args.model == "nequip-M" else "float32")  # NequIP's presets are built in FP32
    engine = Engine(calc, atoms, bench_md.md_integrator("nvt"), seed=1, max_temperature_K=float("inf"),
                    cuda_graph=False)
    engine.run(3)  # kernels compiled, buffers grown
    if device == "cuda":
        torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                          if device == "cuda" else [])
    config = torch._C._profiler._ExperimentalConfig(verbose=True)  # the Python frames of every op, not only the first
    with torch.profiler.profile(activities=activities, with_stack=True, experimental_config=config) as prof:
        engine.run(args.steps)
        if device == "cuda":
            torch.cuda.synchronize()
    only = tuple(op for op in args.ops.split(",") if op)
    rows, total_ms, total_calls = step_sources(prof, args.steps, only)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"{args.model}, {len(atoms)} atoms, eager engine step (NVT Langevin, FP32) on {name}: ops "
          f"{'(' + ', '.join(only) + ') ' if only else ''}with their own device time, charged to the model code's "
          f"line that called them, per step")
    print(f"{'device ms':>10} {'ops':>6}  line")
    for line, ms, calls, top in rows[:args.top]:
        print(f"{ms:10.3f} {calls:6.1f}  {line}   [{top}]")
    print(f"{total_ms:10.3f} {total_calls:6.1f}  all ({len(rows)} lines)")


if __name__ == "__main__":
    main()
