"""Render the symmetric-contraction kernels (CUDA C++) from a schedule's straight-line programs."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from ..core.ir import Program, c_lines
from ..core.templates import template
from ..core.tuning import SCTuning
from .program import backward_program, forward_program
from .schedule import SCSchedule


@dataclass(frozen=True)
class _Out:
    index: int
    offset: int
    dim: int


def _lines(program: Program | None, scalar: str) -> list[str]:
    if program is None:
        return []
    return c_lines(program.statements, scalar, program.inputs + program.external)


def _result(program: Program, prefix: str):
    assigned = program.assigned() | set(program.external)
    return lambda *idx: (name if (name := prefix + "_".join(str(i) for i in idx)) in assigned else "0")


def kernel_name(schedule: SCSchedule, scalar: str, tuning: SCTuning | None = None) -> str:
    tuning = tuning or SCTuning()
    # the pairings enter the name only when not the default (names of default kernels stay as they were)
    extra = "" if tuning.pairings == SCTuning().pairings else f"|{','.join(tuning.pairings)}"
    text = f"{schedule.problem.key()}|{tuning.block}|{tuning.chunk}|{scalar}{extra}"
    digest = hashlib.sha1(text.encode()).hexdigest()[:12]
    return f"cgf_sc_{digest}"


def render(schedule: SCSchedule, scalar: str, forward: bool = True, backward: bool = True,
           backward_w: bool = True, tuning: SCTuning | None = None) -> tuple[str, str]:
    """CUDA source and the kernels' base name (`<name>_forward`, `<name>_backward`, `<name>_backward_w`)."""
    if scalar not in ("float", "double"):
        raise ValueError(f"scalar must be 'float' or 'double', got {scalar!r}")
    tuning = tuning or SCTuning()
    p = schedule.problem
    name = kernel_name(schedule, scalar, tuning)
    vec = 4 if scalar == "float" else 2
    fwd = forward_program(schedule, tuning) if forward else None
    bwd = backward_program(schedule, grad_weights=False, tuning=tuning) if backward else None
    bwdw = backward_program(schedule, grad_weights=True, external_gw=True, tuning=tuning) if backward_w else None
    outputs = [_Out(o, out.offset, out.dim) for o, out in enumerate(schedule.outputs)]
    bwd_gx, bwdw_gx = (_result(prog, "gx") if prog else None for prog in (bwd, bwdw))
    source = template("symmetric_contraction.cu.j2").render(
        title=f"{p.irreps_in} -> {p.irreps_out}, correlation {p.correlation}, {p.num_elements} species "
              f"({scalar})",
        name=name, scalar=scalar, C=p.channels, D=p.in_dim, R=max(schedule.num_slots, 0),
        E=p.num_elements, out_dim=p.out_dim, block=tuning.block, chunk=tuning.chunk,
        vec=vec if p.in_dim % vec == 0 else 0, vec_t="float4" if scalar == "float" else "double2",
        outputs=outputs, nan_value=lambda k: "quiet_nan()",
        emit_forward=forward, emit_backward=backward, emit_backward_w=backward_w,
        forward=_lines(fwd, scalar), fwd_out=_result(fwd, "o") if fwd else None,
        backward=_lines(bwd, scalar),
        bwd_gx=bwd_gx,
        backward_w=_lines(bwdw, scalar),
        bwdw_gx=bwdw_gx,
    )
    return source, name
