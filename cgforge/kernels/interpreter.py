"""A CPU interpreter of a `Schedule`: executes it segment by segment the way the generated kernel
does (shared-memory window per row, staged slices, owned channels, CG lists), vectorised over
rows and channels. It checks the scheduler (offsets, chunks, coverage) against e3nn without a GPU.
"""

from __future__ import annotations

import torch

from .schedule import Schedule, Segment, Term


def _stage(smem: torch.Tensor, seg: Segment, src: torch.Tensor) -> None:
    for ld in seg.loads:
        smem[:, ld.smem_offset:ld.smem_offset + ld.count] = src[:, ld.global_offset:ld.global_offset + ld.count]


def _rows(smem: torch.Tensor, offset: int, base: int, first: int, count: int, dim: int) -> torch.Tensor:
    """[B, count, dim] view of channels first..first+count staged at `offset` for channel `base`."""
    start = offset + (first - base) * dim
    return smem[:, start:start + count * dim].reshape(-1, count, dim)


def _weights(schedule: Schedule, w: torch.Tensor, t: Term, rows: int) -> torch.Tensor:
    p = schedule.problem
    wr = w.reshape(1, -1).expand(rows, -1) if p.shared_weights else w
    shape = (t.mul1, t.mul2, t.mul_out) if t.mode == "uvw" else (t.mul1, t.mul2)
    n = 1
    for s in shape:
        n *= s
    return wr[:, t.w_offset:t.w_offset + n].reshape(rows, *shape)


def _pair(t: Term, xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
    """CG product of xs [B, U, d1] and ys [B, V, d2] -> [B, U, V, d3] from the sparse list."""
    out = xs.new_zeros(xs.shape[0], xs.shape[1], ys.shape[1], t.d3)
    for a, b, c, val in t.cg:
        out[..., c] += val * xs[:, :, None, a] * ys[:, None, :, b]
    return out


def run_forward(schedule: Schedule, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    p = schedule.problem
    rows = x.shape[0]
    smem = x.new_zeros(rows, schedule.smem_per_warp)
    smem[:, schedule.y_smem:schedule.y_smem + p.irreps_in2.dim] = y
    out = x.new_zeros(rows, p.irreps_out.dim)
    for seg in schedule.forward:
        _stage(smem, seg, x)
        n = seg.c1 - seg.c0
        acc = x.new_zeros(rows, n, seg.dim)
        for t in seg.terms:
            ys = smem[:, schedule.y_smem + t.y_offset:][:, :t.mul2 * t.d2].reshape(rows, t.mul2, t.d2)
            if t.mode == "uvu":
                xs = _rows(smem, t.x_smem, t.x_base, seg.c0, n, t.d1)
                xy = _pair(t, xs, ys)  # [B, n, V, d3]
                if t.has_weight:
                    wt = _weights(schedule, w, t, rows)[:, seg.c0:seg.c1]  # [B, n, V]
                    acc += (xy * wt[..., None]).sum(2)
                else:
                    acc += xy.sum(2)
            else:
                xs = _rows(smem, t.x_smem, t.x_base, 0, t.mul1, t.d1)
                xy = _pair(t, xs, ys)  # [B, U, V, d3]
                wt = _weights(schedule, w, t, rows)[:, :, :, seg.c0:seg.c1]  # [B, U, V, n]
                acc += torch.einsum("buvk,buvn->bnk", xy, wt)
        smem[:, seg.stage_smem:seg.stage_smem + n * seg.dim] = acc.reshape(rows, -1)
        lo = seg.row_offset + seg.c0 * seg.dim
        out[:, lo:lo + n * seg.dim] = smem[:, seg.stage_smem:seg.stage_smem + n * seg.dim]
    return out


def run_backward(schedule: Schedule, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor,
                 grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    p = schedule.problem
    rows = x.shape[0]
    smem = x.new_zeros(rows, schedule.smem_per_warp)
    smem[:, schedule.y_smem:schedule.y_smem + p.irreps_in2.dim] = y
    gx = torch.zeros_like(x)
    gy = torch.zeros_like(y)
    gw_rows = x.new_zeros(rows, p.weight_numel)
    for seg in schedule.backward:
        n = seg.c1 - seg.c0
        # the first load is the in1 slice, the others grad-out slices
        _stage(smem, Segment(seg.irrep, seg.c0, seg.c1, seg.dim, seg.row_offset, seg.stage_smem,
                             seg.loads[:1], ()), x)
        _stage(smem, Segment(seg.irrep, seg.c0, seg.c1, seg.dim, seg.row_offset, seg.stage_smem,
                             seg.loads[1:], ()), grad)
        gx_acc = x.new_zeros(rows, n, seg.dim)
        xs = _rows(smem, seg.terms[0].x_smem, seg.c0, seg.c0, n, seg.dim) if seg.terms else None
        for t in seg.terms:
            ys = smem[:, schedule.y_smem + t.y_offset:][:, :t.mul2 * t.d2].reshape(rows, t.mul2, t.d2)
            cg = torch.zeros(t.d1, t.d2, t.d3, dtype=x.dtype)
            for a, b, c, val in t.cg:
                cg[a, b, c] = val
            if t.mode == "uvu":
                gs = _rows(smem, t.g_smem, t.g_base, seg.c0, n, t.d3)  # [B, n, d3]
                wt = (_weights(schedule, w, t, rows)[:, seg.c0:seg.c1] if t.has_weight
                      else x.new_ones(rows, n, t.mul2))
                gx_acc += torch.einsum("bnv,bvj,bnk,ijk->bni", wt, ys, gs, cg)
                gy_part = torch.einsum("bnv,bni,bnk,ijk->bvj", wt, xs, gs, cg)
                if t.has_weight:
                    gwt = torch.einsum("bni,bvj,bnk,ijk->bnv", xs, ys, gs, cg)
                    span = gw_rows[:, t.w_offset:t.w_offset + t.mul1 * t.mul2].view(rows, t.mul1, t.mul2)
                    span[:, seg.c0:seg.c1] = gwt
            else:
                gs = _rows(smem, t.g_smem, t.g_base, 0, t.mul_out, t.d3)  # [B, W, d3]
                wt = _weights(schedule, w, t, rows)[:, seg.c0:seg.c1]  # [B, n, V, W]
                h = torch.einsum("bnvw,bwk->bnvk", wt, gs)
                gx_acc += torch.einsum("bnvk,bvj,ijk->bni", h, ys, cg)
                gy_part = torch.einsum("bnvk,bni,ijk->bvj", h, xs, cg)
                gwt = torch.einsum("bni,bvj,ijk,bwk->bnvw", xs, ys, cg, gs)
                span = gw_rows[:, t.w_offset:t.w_offset + t.mul1 * t.mul2 * t.mul_out]
                span.view(rows, t.mul1, t.mul2, t.mul_out)[:, seg.c0:seg.c1] = gwt
            gy[:, t.y_offset:t.y_offset + t.mul2 * t.d2] += gy_part.reshape(rows, -1)
        smem[:, seg.stage_smem:seg.stage_smem + n * seg.dim] = gx_acc.reshape(rows, -1)
        lo = seg.row_offset + seg.c0 * seg.dim
        gx[:, lo:lo + n * seg.dim] = smem[:, seg.stage_smem:seg.stage_smem + n * seg.dim]
    gw = gw_rows.sum(0) if p.shared_weights else gw_rows
    return gx, gy, gw
