"""Walk one tensor product through the generator, printing each stage as a value.

    python -m cgforge.kernels.explain IRREPS1 IRREPS2 [IRREPS_OUT] [--mode uvu|uvw] [--dtype float32|float64]
        [--conv] [--loop-order auto|segments|edges|chunks] [--arch sm_90] [--lines 30]

``uvu``: every in1 x in2 pair to every allowed output irrep (MACE, NequIP); ``uvw``: into IRREPS_OUT.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch
from e3nn import o3

from .core import compiler
from .core.cg import sparse_cg
from .core.registry import compile_source, itemsize
from .core.tuning import TPTuning
from .tensor_product import plan as plans
from .tensor_product.layout import CONV_BACKWARD, CONV_FORWARD, TP_LAYOUT
from .tensor_product.problem import TPProblem
from .tensor_product.program import build_program
from .tensor_product.schedule import Schedule, build_schedule


def instructions(irreps_in1: str, irreps_in2: str, irreps_out: str | None, mode: str) -> tuple:
    """(in1, in2, out, instructions) for `TPProblem.build` (see the module docstring)."""
    i1, i2 = o3.Irreps(irreps_in1), o3.Irreps(irreps_in2)
    wanted = o3.Irreps(irreps_out) if irreps_out else None
    if mode == "uvw":
        if wanted is None:
            raise ValueError("--mode uvw needs IRREPS_OUT")
        ins = [(a, b, c, "uvw", True) for a, (_, r1) in enumerate(i1) for b, (_, r2) in enumerate(i2)
               for c, (_, r3) in enumerate(wanted) if r3 in r1 * r2]
        return i1, i2, wanted, ins
    out, ins = [], []
    for a, (mul, r1) in enumerate(i1):
        for b, (_, r2) in enumerate(i2):
            for ir in r1 * r2:
                if wanted is None or ir in [r for _, r in wanted]:
                    ins.append((a, b, len(out), "uvu", True))
                    out.append((mul, ir))
    return i1, i2, o3.Irreps(out), ins


def _problem(p: TPProblem) -> list[str]:
    lines = [f"  {p.irreps_in1} x {p.irreps_in2} -> {p.irreps_out}",
             f"  {len(p.instructions)} instructions, weight_numel={p.weight_numel}, shared_weights={p.shared_weights}"]
    for k, ins in enumerate(p.instructions):
        lines.append(f"  [{k}] in1[{ins.i_in1}]={p.irreps_in1[ins.i_in1]} x in2[{ins.i_in2}]={p.irreps_in2[ins.i_in2]}"
                     f" -> out[{ins.i_out}]={p.irreps_out[ins.i_out]}  {ins.mode}  weights {ins.path_shape}"
                     f"  path_weight={ins.path_weight:.6g}")
    return lines


def _cg(p: TPProblem) -> list[str]:
    lines = []
    for k, ins in enumerate(p.instructions):
        ls = (p.irreps_in1[ins.i_in1].ir.l, p.irreps_in2[ins.i_in2].ir.l, p.irreps_out[ins.i_out].ir.l)
        dense = (2 * ls[0] + 1) * (2 * ls[1] + 1) * (2 * ls[2] + 1)
        lines.append(f"  [{k}] l={ls}: {len(sparse_cg(*ls))} nonzeros of {dense} (path weight folded into each)")
    return lines


def _schedule(s: Schedule, size: int) -> list[str]:
    lines = [f"  tuning {s.tuning}, rows are {'nodes (CSR)' if s.rows_are_nodes else 'edges / batch rows'}",
             f"  in2 row staged at smem offset {s.y_smem}"]
    if s.stacked_backward:
        lines.append("  backward windows of one edge loop side by side: the receiver walks stage a row's grad-out "
                     "block once per loop (row_grad_once)")
    for direction, segments in (("forward", s.forward), ("backward", s.backward)):
        launch = s.launch(direction == "backward")
        lines.append(f"  {direction}: chunk {launch.chunk}, {launch.smem_per_warp} elements "
                     f"({launch.smem_per_warp * size} B) of shared memory per warp, {launch.warps_per_block} warps "
                     f"per block, {len(segments)} segments, loop order {s.loop_order(direction == 'backward')}"
                     + (f", one launch per chunk ({s.backward_passes()}) where the grad-out rows exceed the L2"
                        if direction == "backward" and s.backward_passes() > 1 else ""))
        for seg in segments:
            loads = ", ".join(f"{ld.source}[{ld.global_offset}:+{ld.count}]->smem {ld.smem_offset}" for ld in seg.loads)
            lines.append(f"    {'in1' if direction == 'backward' else 'out'} irrep {seg.irrep} channels "
                         f"[{seg.c0}, {seg.c1}): {len(seg.terms)} terms; loads {loads}")
    return lines


def _program(s: Schedule, scalar: str) -> list[str]:
    from .core.ir import c_group

    lines = []
    for backward in (False, True):
        prog = build_program(s, backward)
        lines.append(f"  {'backward' if backward else 'forward'}: {prog.summary()}")
        first = next((tc for sc in prog.segments for tc in sc.terms if tc.products), None)
        if first is not None:
            lines += [f"    {c_group(g, scalar)}" for g in first.products[:3]]
    return lines


def _ptxas(plan_sources: list[tuple[str, str, str]], arch: str) -> list[str]:
    if not compiler.nvrtc_available():
        return ["  NVRTC not found: install nvidia-cuda-nvrtc-cu12 to see the register report"]
    lines = []
    for label, source, function in plan_sources:
        res = compile_source(source, function, arch).resources(function)
        lines.append(f"  {label:<9} {function}: {res.registers} registers, spills {res.spill_stores} B stored / "
                     f"{res.spill_loads} B loaded")
    return lines


def _launch_bound(problem: TPProblem, tuning: TPTuning, dtype: torch.dtype, arch: str) -> str:
    """The convolution backward's launch bound, as the problem's plan chooses it for a launch."""
    plan = plans.get(plans.register(problem, tuning))
    bound = plan.backward_min_blocks(dtype, CONV_BACKWARD, arch)
    if bound is None:
        return "backward launch bound: none (registers do not limit its blocks per SM, or a bound would not help)"
    source, function = plan.source(dtype, CONV_BACKWARD, True, bound)
    res = compile_source(source, function, arch).resources(function)
    return (f"backward launch bound: {bound} blocks per SM -> {res.registers} registers, spills "
            f"{res.spill_stores} B stored / {res.spill_loads} B loaded")


def explain(irreps_in1: str, irreps_in2: str, irreps_out: str | None = None, *, mode: str = "uvu",
            dtype: torch.dtype = torch.float32, conv: bool = False, loop_order: str = "auto",
            arch: str | None = "sm_90", lines: int = 30) -> str:
    """The walkthrough as text (arch None: skip the NVRTC stage)."""
    from .tensor_product.codegen import render

    problem = TPProblem.build(*instructions(irreps_in1, irreps_in2, irreps_out, mode))
    size = itemsize(dtype)
    scalar = "float" if dtype == torch.float32 else "double"
    schedule = build_schedule(problem, itemsize=size, tuning=TPTuning(loop_order=loop_order), rows_are_nodes=conv)
    layouts = (CONV_FORWARD, CONV_BACKWARD) if conv else (TP_LAYOUT, TP_LAYOUT)
    sources = []
    for layout, backward in zip(layouts, (False, True)):
        direction = "backward" if backward else "forward"
        source, name = render(schedule, scalar, layout, forward=not backward, backward=backward)
        sources.append((direction, source, f"{name}_{direction}"))
    out = ["1. problem", *_problem(problem), "2. sparse CG", *_cg(problem),
           f"3. schedule ({scalar}, {'convolution' if conv else 'tensor product'})", *_schedule(schedule, size),
           "4. program (CG statements per lane-owned channel)", *_program(schedule, scalar)]
    if arch is not None:
        out += [f"5. ptxas report (NVRTC, {arch})", *_ptxas(sources, arch)]
        if conv and compiler.nvrtc_available():
            out.append("  " + _launch_bound(problem, schedule.tuning, dtype, arch))
    source_lines = sources[0][1].splitlines()
    start = next((i for i, line in enumerate(source_lines) if line.startswith('extern "C"')), 0)
    out += [f"6. generated forward kernel ({len(source_lines)} lines), from its signature",
            *source_lines[start:start + lines]]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cgforge.kernels.explain", description=__doc__.splitlines()[0])
    parser.add_argument("irreps_in1")
    parser.add_argument("irreps_in2")
    parser.add_argument("irreps_out", nargs="?")
    parser.add_argument("--mode", choices=("uvu", "uvw"), default="uvu")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--conv", action="store_true", help="the deterministic convolution's kernels (rows = nodes)")
    parser.add_argument("--loop-order", choices=("auto", "segments", "edges", "chunks"), default="auto")
    parser.add_argument("--arch", default="sm_90", help="NVRTC target of the register report ('none' to skip)")
    parser.add_argument("--lines", type=int, default=30)
    args = parser.parse_args(argv)
    try:
        text = explain(args.irreps_in1, args.irreps_in2, args.irreps_out, mode=args.mode,
                       dtype=getattr(torch, args.dtype), conv=args.conv, loop_order=args.loop_order,
                       arch=None if args.arch == "none" else args.arch, lines=args.lines)
    except ValueError as err:
        print(f"explain: {err}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
