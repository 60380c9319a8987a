"""Render the symmetric-contraction kernels (CUDA C++) from a schedule's straight-line programs."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from functools import lru_cache

import jinja2

from .sc_program import Program, backward_program, forward_program
from .sc_schedule import SCSchedule

# Threads per block (one atom's channels for C = 128) and atoms per thread in the grad-W' kernel
# (amortises the per-species atomics); environment knobs for sweeps.
BLOCK = int(os.environ.get("CGFORGE_SC_BLOCK", "128"))
CHUNK = int(os.environ.get("CGFORGE_SC_CHUNK", "16"))


@dataclass(frozen=True)
class _Out:
    index: int
    offset: int
    dim: int


@lru_cache(maxsize=1)
def _template() -> jinja2.Template:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("cgforge.kernels", "templates"),
        undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
    )
    return env.get_template("symmetric_contraction.cu.j2")


def _literal(scalar: str, v: float) -> str:
    return f"{v:.9e}f" if scalar == "float" else f"{v:.17e}"


def c_lines(program: Program, scalar: str) -> list[str]:
    """One C statement per program statement; temporaries `const`, first assignments declared."""
    declared = set(program.inputs) | set(program.external)
    lines = []
    for s in program.statements:
        parts = []
        for coef, a, b in s.terms:
            factors = ([_literal(scalar, coef)] if coef is not None else []) + [a] + ([b] if b else [])
            parts.append(" * ".join(factors))
        expr = " + ".join(parts)
        if s.accumulate:
            lines.append(f"{s.dst} += {expr};")
        elif s.dst in declared:
            lines.append(f"{s.dst} = {expr};")
        else:
            const = "const " if s.dst.startswith("t") else ""
            lines.append(f"{const}scalar_t {s.dst} = {expr};")
            declared.add(s.dst)
    return lines


def _result(program: Program, prefix: str):
    assigned = program.assigned() | set(program.external)
    return lambda *idx: (name if (name := prefix + "_".join(str(i) for i in idx)) in assigned else "0")


def kernel_name(schedule: SCSchedule, scalar: str) -> str:
    digest = hashlib.sha1(f"{schedule.problem.key()}|{BLOCK}|{CHUNK}|{scalar}".encode()).hexdigest()[:12]
    return f"cgf_sc_{digest}"


def render(schedule: SCSchedule, scalar: str, forward: bool = True, backward: bool = True,
           backward_w: bool = True) -> tuple[str, str]:
    """CUDA source and the kernels' base name (`<name>_forward`, `<name>_backward`, `<name>_backward_w`)."""
    if scalar not in ("float", "double"):
        raise ValueError(f"scalar must be 'float' or 'double', got {scalar!r}")
    p = schedule.problem
    name = kernel_name(schedule, scalar)
    vec = 4 if scalar == "float" else 2
    fwd = forward_program(schedule) if forward else None
    bwd = backward_program(schedule, grad_weights=False) if backward else None
    bwdw = backward_program(schedule, grad_weights=True, external_gw=True) if backward_w else None
    outputs = [_Out(o, out.offset, out.dim) for o, out in enumerate(schedule.outputs)]
    bwd_gx, bwdw_gx = (_result(prog, "gx") if prog else None for prog in (bwd, bwdw))
    source = _template().render(
        title=f"{p.irreps_in} -> {p.irreps_out}, correlation {p.correlation}, {p.num_elements} species "
              f"({scalar})",
        name=name, scalar=scalar, C=p.channels, D=p.in_dim, R=max(schedule.num_slots, 0),
        E=p.num_elements, out_dim=p.out_dim, block=BLOCK, chunk=CHUNK,
        vec=vec if p.in_dim % vec == 0 else 0, vec_t="float4" if scalar == "float" else "double2",
        outputs=outputs, nan_value=lambda k: "quiet_nan()",
        emit_forward=forward, emit_backward=backward, emit_backward_w=backward_w,
        forward=c_lines(fwd, scalar) if fwd else [], fwd_out=_result(fwd, "o") if fwd else None,
        backward=c_lines(bwd, scalar) if bwd else [],
        bwd_gx=bwd_gx,
        backward_w=c_lines(bwdw, scalar) if bwdw else [],
        bwdw_gx=bwdw_gx,
    )
    return source, name
