"""Two differentiable torch evaluations of a symmetric contraction: ``reference_sc``, the definition from dense U
and MACE's weights (the tests' oracle), and ``interpret_sc``, the schedule's basis chains over W' (the CPU path
and the double-backward fallback).
"""

from __future__ import annotations

import torch

from ..core.cg import dense_numpy
from .problem import SCProblem
from .schedule import Ref, SCSchedule


def reference_sc(problem: SCProblem, x: torch.Tensor, species: torch.Tensor,
                 weights: list[list[torch.Tensor]]) -> torch.Tensor:
    """out [N, out_dim] from x [N, C, D], species [N] (int) and weights[o][nu - 1] [E, K, C]."""
    n, channels = x.shape[0], problem.channels
    outs = []
    for o, ir in enumerate(problem.outputs):
        out = x.new_zeros(n, channels, ir.dim)
        for nu in range(1, problem.correlation[o] + 1):
            u = torch.as_tensor(problem.u[o][nu - 1], dtype=x.dtype, device=x.device)
            for e in torch.unique(species).tolist():
                rows = (species == e).nonzero().flatten()
                xe = x.index_select(0, rows)
                # c[ch, M, i1..inu] = sum_k U[M, i1..inu, k] W[e, k, ch], then contract x once per degree
                t = torch.tensordot(weights[o][nu - 1][e].t(), u, dims=([1], [u.dim() - 1]))
                rest = t.shape[1:-1]
                t = torch.einsum("cpd,ncd->ncp", t.reshape(channels, -1, t.shape[-1]), xe).reshape(-1, channels, *rest)
                for _ in range(nu - 1):
                    t = (t * xe.reshape(xe.shape[0], channels, *([1] * (t.dim() - 3)), -1)).sum(-1)
                out = out.index_add(0, rows, t)
        outs.append(out.reshape(n, channels * ir.dim))
    return torch.cat(outs, dim=1)


def _coupling(cg: tuple, left: torch.Tensor, right: torch.Tensor, l_out: int) -> torch.Tensor:
    dense = torch.as_tensor(dense_numpy(cg, (left.shape[-1], right.shape[-1], 2 * l_out + 1)),
                            dtype=left.dtype, device=left.device)
    return torch.einsum("nca,ncb,abm->ncm", left, right, dense)


def interpret_sc(schedule: SCSchedule, x: torch.Tensor, species: torch.Tensor, wp: torch.Tensor) -> torch.Tensor:
    """out [N, out_dim] from x [N, C, D], species [N] (int) and the transformed weights wp [E, R, C]."""
    p = schedule.problem
    n, channels = x.shape[0], p.channels
    blocks = [x[:, :, off:off + ir.dim] for off, ir in zip(p.coupling_offsets, p.coupling)]
    nodes: list[torch.Tensor] = []

    def value(ref: Ref) -> torch.Tensor:
        return blocks[ref.index] if ref.kind == "x" else nodes[ref.index]

    for node in schedule.nodes:
        nodes.append(_coupling(node.cg, value(node.left), blocks[node.input], node.l))
    species = species.long()

    def weight(slot: int) -> torch.Tensor:  # [N, C, 1]
        return wp[:, slot, :].index_select(0, species).unsqueeze(-1)

    outs = []
    for out in schedule.outputs:
        acc = x.new_zeros(n, channels, out.dim)
        for lin in out.linear:
            acc = acc + weight(lin.slot) * blocks[lin.input]
        for group in out.groups:
            z = sum(weight(t.slot) * value(t.left) for t in group.terms)
            acc = acc + _coupling(group.cg, z, blocks[group.input], out.l)
        outs.append(acc.reshape(n, channels * out.dim))
    return torch.cat(outs, dim=1) if outs else x.new_zeros(n, 0)


def interpret_sc_backward(schedule: SCSchedule, x: torch.Tensor, species: torch.Tensor, wp: torch.Tensor,
                          g: torch.Tensor, need_gw: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """grad x [N, C, D] and (if asked) grad W' [E, R, C] of <g, interpret_sc(...)>, written out by hand (custom-op
    implementations run below autograd)."""
    p = schedule.problem
    n, channels = x.shape[0], p.channels
    blocks = [x[:, :, off:off + ir.dim] for off, ir in zip(p.coupling_offsets, p.coupling)]
    nodes = []
    for node in schedule.nodes:
        left = blocks[node.left.index] if node.left.kind == "x" else nodes[node.left.index]
        nodes.append(_coupling(node.cg, left, blocks[node.input], node.l))
    gblocks = [torch.zeros_like(b) for b in blocks]
    gnodes = [torch.zeros_like(v) for v in nodes]
    species = species.long()
    gw_rows = x.new_zeros(n, schedule.num_slots, channels) if need_gw else None

    def value(ref: Ref) -> torch.Tensor:
        return blocks[ref.index] if ref.kind == "x" else nodes[ref.index]

    def grad(ref: Ref) -> torch.Tensor:
        return gblocks[ref.index] if ref.kind == "x" else gnodes[ref.index]

    def weight(slot: int) -> torch.Tensor:
        return wp[:, slot, :].index_select(0, species).unsqueeze(-1)

    def cg_dense(cg, dims) -> torch.Tensor:
        return torch.as_tensor(dense_numpy(cg, dims), dtype=x.dtype, device=x.device)

    for out in schedule.outputs:
        go = g[:, out.offset:out.offset + channels * out.dim].reshape(n, channels, out.dim)
        for lin in out.linear:
            gblocks[lin.input] += weight(lin.slot) * go
            if need_gw:
                gw_rows[:, lin.slot] += (blocks[lin.input] * go).sum(-1)
        for group in out.groups:
            xi = blocks[group.input]
            cg = cg_dense(group.cg, (2 * group.left_l + 1, xi.shape[-1], out.dim))
            z = sum(weight(t.slot) * value(t.left) for t in group.terms)
            gz = torch.einsum("ncb,ncm,abm->nca", xi, go, cg)
            gblocks[group.input] += torch.einsum("nca,ncm,abm->ncb", z, go, cg)
            for t in group.terms:
                grad(t.left).add_(weight(t.slot) * gz)
                if need_gw:
                    gw_rows[:, t.slot] += (value(t.left) * gz).sum(-1)
    for j in reversed(range(len(schedule.nodes))):
        node = schedule.nodes[j]
        left, xi, gn = value(node.left), blocks[node.input], gnodes[j]
        cg = cg_dense(node.cg, (left.shape[-1], xi.shape[-1], node.dim))
        grad(node.left).add_(torch.einsum("ncb,ncm,abm->nca", xi, gn, cg))
        gblocks[node.input] += torch.einsum("nca,ncm,abm->ncb", left, gn, cg)
    gx = torch.cat(gblocks, dim=-1) if gblocks else torch.zeros_like(x)
    if not need_gw:
        return gx, None
    gw = wp.new_zeros(wp.shape).index_add(0, species, gw_rows)
    return gx, gw
