"""Render CUDA C++ for a Schedule: the template's skeleton plus the printed program (stage 5)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from ..core import warp_reduce
from ..core.ir import c_group, literal
from ..core.templates import template
from ..radial_table.ops import CUBIC_SOURCE
from .layout import Layout
from .program import build_program, segment_groups
from .schedule import Schedule


def kernel_name(schedule: Schedule, scalar: str, layout: Layout) -> str:
    launches = f"{schedule.forward_launch}|{schedule.backward_launch}"
    # the loop orders enter the name only when not segments (such kernels keep their names)
    orders = (schedule.loop_order(False), schedule.loop_order(True))
    order = "" if orders == ("segments", "segments") else "|" + "|".join(orders)
    passes = schedule.backward_passes()
    order += f"|passes{passes}" if passes > 1 else ""
    order += "" if schedule.tuning.grad_y_reduce_scatter else "|gy-butterfly"
    order += "|stacked" if schedule.stacked_backward else ""  # the receiver walks stage differently (row_grad_once)
    digest = hashlib.sha1(f"{schedule.problem.key()}|{launches}|{scalar}{order}".encode()).hexdigest()[:12]
    return f"cgf_{digest}_{layout.tag()}"


@dataclass(frozen=True)
class GradYGroup:
    """One ``reduce_scatter<width>`` of an edge's grad y partials: ``values`` (C expressions, zeros pad them to
    ``width``), of which the first ``n_y`` are in2 elements ``y_first ..`` and, with ``grad_r``, the last is grad r."""

    width: int
    shift: int
    size: int
    values: tuple[str, ...]
    y_first: int
    n_y: int
    grad_r: bool


def grad_y_groups(slots: tuple[int, ...], table: bool, scatter: bool = True) -> tuple[GradYGroup, ...]:
    """The reduction of one edge loop's grad y registers (``gya[i]`` holds in2 element ``slots[i]``) and, for a
    table, its grad r (``gra``): the partials are the slots' span (an element no term touches is a zero) then grad
    r, summed in the groups of ``warp_reduce.plan`` (``scatter`` False: one group of width 1 per partial, a
    butterfly each, lane 0 adding the sums)."""
    partials: list[tuple[str, int | None]] = []
    if slots:
        held = {yi: i for i, yi in enumerate(slots)}
        partials = [(f"gya[{held[yi]}]" if yi in held else "0", yi) for yi in range(slots[0], slots[-1] + 1)]
    if table:
        partials.append(("gra", None))
    groups = []
    plan = (warp_reduce.plan(len(partials)) if scatter
            else tuple(warp_reduce.ReduceGroup(i, 1, 1) for i in range(len(partials))))
    for g in plan:
        part = partials[g.first:g.first + g.size]
        ys = [yi for _, yi in part if yi is not None]
        groups.append(GradYGroup(g.width, g.shift, g.size, tuple(e for e, _ in part) + ("0",) * (g.width - g.size),
                                 ys[0] if ys else 0, len(ys), part[-1][1] is None))
    return tuple(groups)


def render(schedule: Schedule, scalar: str, layout: Layout, forward: bool, backward: bool,
           backward_min_blocks: int | None = None) -> tuple[str, str]:
    """CUDA source and the kernel base name (`<name>_forward`, `<name>_backward`). `backward_min_blocks`: the
    B of the backward's ``__launch_bounds__(threads, B)`` (None: threads only); the name stays the same."""
    literal(scalar, 0.0)  # checks the scalar type
    p = schedule.problem
    name = kernel_name(schedule, scalar, layout)
    source = template("tensor_product.cu.j2").render(
        title=f"{p.irreps_in1} x {p.irreps_in2} -> {p.irreps_out} ({scalar}, layout {layout.tag()})",
        name=name, scalar=scalar, c=lambda group: c_group(group, scalar),
        fwd=schedule.forward_launch, bwd=schedule.backward_launch, bwd_min_blocks=backward_min_blocks,
        in1_dim=p.irreps_in1.dim, in2_dim=p.irreps_in2.dim, out_dim=p.irreps_out.dim,
        wnumel=max(p.weight_numel, 1), shared_weights=p.shared_weights, y_smem=schedule.y_smem,
        gw_op="+=" if p.shared_weights else "=",  # shared weights: per-warp partial sums
        forward=build_program(schedule, backward=False) if forward else None,
        backward=build_program(schedule, backward=True) if backward else None,
        forward_loop_order=schedule.loop_order(False), backward_loop_order=schedule.loop_order(True),
        csr=layout.csr, perm=layout.perm, xidx=layout.xidx, gidx=layout.gidx, atomic=layout.atomic,
        grad_x=layout.grad_x, fixed=layout.fixed, table=layout.table, cubic_source=CUBIC_SOURCE if layout.table else "",
        emit_forward=forward, emit_backward=backward, segment_groups=segment_groups,
        grad_y_groups=lambda slots, table: grad_y_groups(slots, table, schedule.tuning.grad_y_reduce_scatter),
        backward_passes=schedule.backward_passes(), row_grad_once=backward and schedule.row_grad_once(layout),
    )
    return source, name
