"""The CPU evaluator of the tensor-product kernels: runs a program the way the generated kernel does.

Rows and lanes' channels are vectorised; edges run in waves in the kernel's loop order. Operands are staged into
a per-row window by the schedule's loads, the CG arithmetic is the program's statements (``core.ir.run``), stores
go through the staging window: CI checks schedule, program and layouts against e3nn without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.ir import run
from .layout import TP_LAYOUT, Layout
from .program import SegmentCode, TermCode, TPProgram, build_program, segment_groups
from .schedule import Schedule


@dataclass
class _Rows:
    """The edge bookkeeping of a launch: per row its edge range; per edge position its id and operand rows."""

    count: int
    begin: torch.Tensor
    end: torch.Tensor
    perm: torch.Tensor | None
    xidx: torch.Tensor | None
    gidx: torch.Tensor | None  # backward: grad-out row; forward: oidx (atomic output row)

    def wave(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows that have a k-th edge, that edge's id)."""
        rows = (self.end - self.begin > k).nonzero().flatten()
        pos = self.begin[rows] + k
        return rows, (self.perm[pos].long() if self.perm is not None else pos)

    def depth(self) -> int:
        return int((self.end - self.begin).max()) if self.count else 0


def _rows(layout: Layout, count: int, rowptr, perm, xidx, gidx) -> _Rows:
    if layout.csr:
        begin, end = rowptr[:-1].long(), rowptr[1:].long()
    else:
        begin = torch.arange(count)
        end = begin + 1
    return _Rows(count, begin, end, perm if layout.perm else None, xidx if layout.xidx else None,
                 gidx if (layout.gidx or layout.atomic) else None)


def _index(rows: torch.Tensor, table: torch.Tensor | None, eid: torch.Tensor) -> torch.Tensor:
    return table[eid].long() if table is not None else rows


def _bind(env: dict, name: str, t: torch.Tensor) -> None:
    for m in range(t.shape[-1]):
        env[f"{name}[{m}]"] = t[..., m]


def _collect(env: dict, name: str, like: torch.Tensor) -> torch.Tensor:
    return torch.stack([env[f"{name}[{m}]"].expand(like.shape[:-1]) for m in range(like.shape[-1])], -1)


class _Kernel:
    """One launch: smem windows, inputs, and the state a kernel keeps in registers."""

    def __init__(self, program: TPProgram, layout: Layout, rows: _Rows, x, y, w):
        s = program.schedule
        self.p, self.s, self.program, self.layout, self.rows = s.problem, s, program, layout, rows
        self.x, self.y, self.w = x, y, w
        self.smem = x.new_zeros(rows.count, s.launch(program.backward).smem_per_warp)

    def weights(self, eid: torch.Tensor) -> torch.Tensor:
        return self.w.reshape(1, -1).expand(eid.shape[0], -1) if self.p.shared_weights else self.w[eid]

    def stage(self, rows, eid, sc: SegmentCode, with_y: bool, g: torch.Tensor | None = None,
              sources: tuple[str, ...] = ("x", "g")) -> torch.Tensor:
        """The window of the wave's rows after this segment's staging of ``sources`` (written back to self.smem)."""
        sm = self.smem[rows]
        if with_y:
            sm[:, self.s.y_smem:self.s.y_smem + self.p.irreps_in2.dim] = self.y[eid]
        xr = _index(rows, self.rows.xidx, eid)
        for ld in sc.segment.loads:
            if ld.source not in sources:
                continue
            src = self.x[xr] if ld.source == "x" else g[_index(rows, self.rows.gidx, eid)]
            sm[:, ld.smem_offset:ld.smem_offset + ld.count] = src[:, ld.global_offset:ld.global_offset + ld.count]
        self.smem[rows] = sm
        return sm

    def stage_row_grad(self, sc: SegmentCode, g: torch.Tensor) -> None:
        """Every row's own grad-out block of this segment, staged once before its edge loop (the template's
        ``stage_row_grad``; ``Schedule.row_grad_once``)."""
        for ld in sc.segment.loads:
            if ld.source == "g":
                self.smem[:, ld.smem_offset:ld.smem_offset + ld.count] = \
                    g[:self.rows.count, ld.global_offset:ld.global_offset + ld.count]

    def read(self, sm: torch.Tensor, start: torch.Tensor | int, count: int) -> torch.Tensor:
        """sm[row, start + m] for m < count; start per channel [n] or a scalar -> [R, (n,) count]."""
        idx = torch.as_tensor(start)[..., None] + torch.arange(count)
        return sm[:, idx]

    def store(self, rows, sm, acc: torch.Tensor, sc: SegmentCode, dst: torch.Tensor, dst_rows: torch.Tensor,
              atomic: bool) -> None:
        seg = sc.segment
        n = (seg.c1 - seg.c0) * seg.dim
        sm[:, seg.stage_smem:seg.stage_smem + n] = acc.reshape(acc.shape[0], -1)
        self.smem[rows] = sm
        lo = seg.row_offset + seg.c0 * seg.dim
        block = sm[:, seg.stage_smem:seg.stage_smem + n]
        if atomic:
            dst[:, lo:lo + n] = dst[:, lo:lo + n].index_add(0, dst_rows, block)
        else:
            dst[dst_rows, lo:lo + n] = block


def _loop(kernel: _Kernel, program: TPProgram, init, edge, finish, before=None) -> None:
    """The kernel's loops: rows (vectorised), segments and edge waves in the schedule's loop order; ``before``
    runs per segment ahead of its loop's edge waves."""
    rows, depth = kernel.rows, kernel.rows.depth()
    everyone = torch.arange(rows.count)
    for group in segment_groups(program, program.schedule.loop_order(program.backward)):
        if before is not None:
            for _, sc in group:
                before(sc)
        states = [init(sc) for _, sc in group]
        for k in range(depth):
            r, eid = rows.wave(k)
            for j, (_, sc) in enumerate(group):
                edge(sc, states[j], r, eid, j == 0)
        for (_, sc), state in zip(group, states):
            finish(sc, state, everyone)


def _forward_term(kernel: _Kernel, sm, wr, tc: TermCode, c: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    t, s = tc.term, kernel.s
    if t.mode == "uvu":
        xv = kernel.read(sm, t.x_smem + (c - t.x_base) * t.d1, t.d1)  # [R, n, d1]
        for v in range(t.mul2):
            ys = kernel.read(sm, s.y_smem + t.y_offset + v * t.d2, t.d2)  # [R, d2]
            wv = wr[:, t.w_offset + c * t.mul2 + v] if t.has_weight else torch.ones_like(xv[..., 0])
            env: dict = {}
            _bind(env, "xv", xv)
            _bind(env, "yw", ys[:, None, :] * wv[..., None])
            _bind(env, "acc[j]", acc)
            run((st for grp in tc.products for st in grp), env)
            acc = _collect(env, "acc[j]", acc)
        return acc
    for u in range(t.mul1):
        xs = kernel.read(sm, t.x_smem + u * t.d1, t.d1)
        for v in range(t.mul2):
            env = {}
            _bind(env, "xs", xs)
            _bind(env, "ys", kernel.read(sm, s.y_smem + t.y_offset + v * t.d2, t.d2))
            _bind(env, "t3", xs.new_zeros(xs.shape[0], t.d3))
            run((st for grp in tc.products for st in grp), env)
            t3 = _collect(env, "t3", xs.new_zeros(xs.shape[0], t.d3))
            wv = wr[:, t.w_offset + (u * t.mul2 + v) * t.mul_out + c]  # [R, n]
            acc = acc + wv[..., None] * t3[:, None, :]
    return acc


def run_forward(schedule: Schedule | TPProgram, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor,
                layout: Layout = TP_LAYOUT, rows: int | None = None, rowptr: torch.Tensor | None = None,
                perm: torch.Tensor | None = None, xidx: torch.Tensor | None = None,
                oidx: torch.Tensor | None = None, out_rows: int | None = None) -> torch.Tensor:
    """The forward kernel of `layout` on CPU tensors: out [out_rows (default rows), out_dim]."""
    program = schedule if isinstance(schedule, TPProgram) else build_program(schedule, backward=False)
    count = x.shape[0] if rows is None else rows
    kernel = _Kernel(program, layout, _rows(layout, count, rowptr, perm, xidx, oidx), x, y, w)
    out = x.new_zeros(count if out_rows is None else out_rows, program.schedule.problem.irreps_out.dim)

    def init(sc):
        return [x.new_zeros(count, sc.segment.c1 - sc.segment.c0, sc.segment.dim)]

    def edge(sc, state, r, eid, with_y):
        sm = kernel.stage(r, eid, sc, with_y)
        c = torch.arange(sc.segment.c0, sc.segment.c1)
        acc = state[0][r]
        wr = kernel.weights(eid)
        for tc in sc.terms:
            acc = _forward_term(kernel, sm, wr, tc, c, acc)
        if layout.atomic:  # scatter this edge's block, keep nothing
            kernel.store(r, sm, acc, sc, out, oidx[eid].long(), atomic=True)
        else:
            state[0][r] = acc

    def finish(sc, state, everyone):
        if not layout.atomic:
            kernel.store(everyone, kernel.smem[everyone], state[0], sc, out, everyone, atomic=False)

    _loop(kernel, program, init, edge, finish)
    return out


def _backward_term(kernel: _Kernel, sm, wr, gwr, tc: TermCode, c, xv, gxa, gya, slots):
    """One term of one backward segment for one edge: updates gxa [R, n, d1], gya [R, n, S], gwr."""
    t, s = tc.term, kernel.s
    shared = kernel.p.shared_weights
    for v in range(t.mul2):
        yv = kernel.read(sm, s.y_smem + t.y_offset + v * t.d2, t.d2)[:, None, :].expand(-1, c.shape[0], -1)
        env: dict = {}
        _bind(env, "xv", xv)
        _bind(env, "yv", yv)
        _bind(env, "dx", torch.zeros_like(xv))
        _bind(env, "dy", torch.zeros_like(yv))
        if t.mode == "uvu":
            _bind(env, "gv", kernel.read(sm, t.g_smem + (c - t.g_base) * t.d3, t.d3))
            run((st for grp in tc.products for st in grp), env)
            dy = _collect(env, "dy", yv)
            dw = (dy * yv).sum(-1)
            if t.has_weight:
                widx = t.w_offset + c * t.mul2 + v
                wv = wr[:, widx]
                gwr[:, widx] = gwr[:, widx] + dw if shared else dw
            else:
                wv = torch.ones_like(dw)
            gxa = gxa + wv[..., None] * _collect(env, "dx", xv)
            env["wv"] = wv
        else:
            zero3 = xv.new_zeros(*xv.shape[:2], t.d3)
            _bind(env, "t3", zero3)
            run((st for grp in tc.products for st in grp), env)
            t3 = _collect(env, "t3", zero3)
            gs = kernel.read(sm, t.g_smem + (torch.arange(t.mul_out) - t.g_base) * t.d3, t.d3)  # [R, W, d3]
            widx = t.w_offset + (c[:, None] * t.mul2 + v) * t.mul_out + torch.arange(t.mul_out)  # [n, W]
            wv = wr[:, widx]  # [R, n, W]
            _bind(env, "h", torch.einsum("rnw,rwm->rnm", wv, gs))
            dw = torch.einsum("rwm,rnm->rnw", gs, t3)
            gwr[:, widx] = gwr[:, widx] + dw if shared else dw
            run((st for grp in tc.adjoint for st in grp), env)
            gxa = gxa + _collect(env, "dx", xv)
        _bind(env, "gya", gya)
        run((st for grp in tc.gy[v] for st in grp), env)
        gya = _collect(env, "gya", gya)
    return gxa, gya


def run_backward(schedule: Schedule | TPProgram, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, grad: torch.Tensor,
                 layout: Layout = TP_LAYOUT, rows: int | None = None, rowptr: torch.Tensor | None = None,
                 perm: torch.Tensor | None = None, xidx: torch.Tensor | None = None,
                 gidx: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward kernel of `layout` on CPU tensors: (grad x, grad y, grad weight)."""
    program = schedule if isinstance(schedule, TPProgram) else build_program(schedule, backward=True)
    p = program.schedule.problem
    count = x.shape[0] if rows is None else rows
    kernel = _Kernel(program, layout, _rows(layout, count, rowptr, perm, xidx, gidx), x, y, w)
    gx, gy = torch.zeros_like(x), torch.zeros_like(y)
    gw = x.new_zeros(1 if p.shared_weights else w.shape[0], p.weight_numel)

    def init(sc):
        return [x.new_zeros(count, sc.segment.c1 - sc.segment.c0, sc.segment.dim)]

    row_grad_once = program.schedule.row_grad_once(layout)

    def edge(sc, state, r, eid, with_y):
        seg = sc.segment
        sm = kernel.stage(r, eid, sc, with_y, grad, ("x",) if row_grad_once else ("x", "g"))
        c = torch.arange(seg.c0, seg.c1)
        xv = kernel.read(sm, seg.x_smem + (c - seg.c0) * seg.dim, seg.dim)
        gxa = state[0][r]
        gya = x.new_zeros(r.shape[0], c.shape[0], len(sc.gy_slots))
        gwr = gw.expand(r.shape[0], -1).clone() if p.shared_weights else gw[eid]
        wr = kernel.weights(eid)
        for tc in sc.terms:
            gxa, gya = _backward_term(kernel, sm, wr, gwr, tc, c, xv, gxa, gya, sc.gy_slots)
        if p.shared_weights:
            gw[0] += (gwr - gw).sum(0)  # each row's partial sums
        else:
            gw[eid] = gwr
        for i, yi in enumerate(sc.gy_slots):  # warp_sum over the lanes' channels, added per edge
            gy[eid, yi] += gya[:, :, i].sum(1)
        if layout.atomic:
            kernel.store(r, sm, gxa, sc, gx, _index(r, kernel.rows.xidx, eid), atomic=True)
            gxa = torch.zeros_like(gxa)
        state[0][r] = gxa

    def finish(sc, state, everyone):
        if not layout.atomic:
            kernel.store(everyone, kernel.smem[everyone], state[0], sc, gx, everyone, atomic=False)

    _loop(kernel, program, init, edge, finish, (lambda sc: kernel.stage_row_grad(sc, grad)) if row_grad_once else None)
    return gx, gy, (gw[0] if p.shared_weights else gw)
