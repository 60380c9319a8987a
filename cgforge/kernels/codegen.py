"""Render CUDA C++ for a Schedule from the Jinja2 template (every CG nonzero a literal FMA)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache

import jinja2

from .schedule import Schedule, Segment


@dataclass(frozen=True)
class Layout:
    """How rows map to edges and operands (compile-time flags of one kernel variant).

    csr: a row walks the edges rowptr[row]..rowptr[row+1]; otherwise row == edge.
    perm: edge position -> edge id (y, W and grad-y rows are read at the edge id).
    xidx: the in1 row of an edge is xidx[eid] (else the row itself).
    gidx: backward only, the grad-out row of an edge is gidx[eid] (else the row itself).
    atomic: results are added with atomics to oidx[eid] (forward) / xidx[eid] (backward, grad x).
    """

    csr: bool = False
    perm: bool = False
    xidx: bool = False
    gidx: bool = False
    atomic: bool = False

    def tag(self) -> str:
        return "".join(k[0] if getattr(self, k) else "_" for k in ("csr", "perm", "xidx", "gidx", "atomic"))


TP_LAYOUT = Layout()


@lru_cache(maxsize=1)
def _template() -> jinja2.Template:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("cgforge.kernels", "templates"),
        undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
    )
    return env.get_template("tensor_product.cu.j2")


def _literal(scalar: str):
    if scalar == "float":
        return lambda v: f"{v:.9e}f"
    return lambda v: f"{v:.17e}"


def _gy_slots(seg: Segment) -> list[int]:
    """The in2-row indices whose gradient this backward segment touches (register slots)."""
    idx = set()
    for t in seg.terms:
        idx.update(range(t.y_offset, t.y_offset + t.mul2 * t.d2))
    return sorted(idx)


def kernel_name(schedule: Schedule, scalar: str, layout: Layout) -> str:
    launches = f"{schedule.forward_launch}|{schedule.backward_launch}"
    digest = hashlib.sha1(f"{schedule.problem.key()}|{launches}|{scalar}".encode()).hexdigest()[:12]
    return f"cgf_{digest}_{layout.tag()}"


def render(schedule: Schedule, scalar: str, layout: Layout, forward: bool, backward: bool) -> tuple[str, str]:
    """CUDA source and the kernel base name (`<name>_forward`, `<name>_backward`)."""
    if scalar not in ("float", "double"):
        raise ValueError(f"scalar must be 'float' or 'double', got {scalar!r}")
    p = schedule.problem
    name = kernel_name(schedule, scalar, layout)
    source = _template().render(
        title=f"{p.irreps_in1} x {p.irreps_in2} -> {p.irreps_out} ({scalar}, layout {layout.tag()})",
        name=name, scalar=scalar, lit=_literal(scalar),
        fwd=schedule.forward_launch, bwd=schedule.backward_launch,
        in1_dim=p.irreps_in1.dim, in2_dim=p.irreps_in2.dim, out_dim=p.irreps_out.dim,
        wnumel=max(p.weight_numel, 1), shared_weights=p.shared_weights, y_smem=schedule.y_smem,
        gw_op="+=" if p.shared_weights else "=",  # shared weights: per-warp partial sums
        forward=schedule.forward, backward=schedule.backward,
        seg_gy=[_gy_slots(s) for s in schedule.backward],
        csr=layout.csr, perm=layout.perm, xidx=layout.xidx, gidx=layout.gidx, atomic=layout.atomic,
        emit_forward=forward, emit_backward=backward,
    )
    return source, name
