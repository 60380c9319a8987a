"""The arithmetic of the tensor-product kernels as statements (core.ir): stage 4, problem -> program.

Per segment and term: what one lane runs for one owned channel and one in2 multiplicity index v, one statement per
CG nonzero (path weight folded in), named as the template's registers:

forward   uvu: acc[j][k] += cg * xv[i] * yw[j']      (yw = y * w, xv the staged in1 channel)
          uvw: t3[k] += cg * xs[i] * ys[j']          (then acc += w t3 per output channel)
backward  uvu: { cg = c * gv[k]; dx[i] += cg * yv[j']; dy[j'] += cg * xv[i]; }
          uvw: t3[k] += c * xv[i] * yv[j'], then { cg = c * h[k]; dx[i] += ...; dy[j'] += ...; }
          grad y: gya[s] += wv * dy[j'] into register slot s of in2 element y_offset + v d2 + j'
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.ir import Group, Statement
from .schedule import Schedule, Segment, Term, loop_group


@dataclass(frozen=True)
class TermCode:
    term: Term
    products: tuple[Group, ...]  # see the module docstring
    adjoint: tuple[Group, ...] = ()  # backward uvw: the CG blocks on h
    gy: tuple[tuple[Group, ...], ...] = ()  # backward: per v, the grad-y register adds


@dataclass(frozen=True)
class SegmentCode:
    segment: Segment
    terms: tuple[TermCode, ...]
    gy_slots: tuple[int, ...] = ()  # backward: in2-row elements whose gradient is held in registers


@dataclass(frozen=True)
class TPProgram:
    schedule: Schedule
    backward: bool
    segments: tuple[SegmentCode, ...]

    def summary(self) -> dict[str, int]:
        """Counts per row and edge: segments, terms, CG statements and multiply-adds of the statements
        (each term's statements run once per v, uvw ones also once per in1 channel u)."""
        statements = fmas = 0
        for sc in self.segments:
            for tc in sc.terms:
                t = tc.term
                groups = tc.products + tc.adjoint
                reps = t.mul2 * (t.mul1 if t.mode == "uvw" and not self.backward else 1)
                statements += sum(len(g) for g in groups)
                fmas += reps * (sc.segment.c1 - sc.segment.c0) * sum(s.multiply_adds for g in groups for s in g)
        return {"segments": len(self.segments), "terms": sum(len(s.terms) for s in self.segments),
                "cg_statements": statements, "cg_multiply_adds": fmas}


def segment_groups(program: TPProgram, order: str) -> list[list[tuple[int, SegmentCode]]]:
    """The segments (with their index) that share one edge loop (``schedule.loop_group``)."""
    groups: dict = {}
    for i, sc in enumerate(program.segments):
        groups.setdefault(loop_group(order, i, sc.segment.c0, sc.segment.c1), []).append((i, sc))
    return list(groups.values())


def gy_slots(segments: tuple[Segment, ...] | list[Segment]) -> tuple[int, ...]:
    """The in2-row indices whose gradient these backward segments touch (register slots)."""
    idx = set()
    for seg in segments:
        for t in seg.terms:
            idx.update(range(t.y_offset, t.y_offset + t.mul2 * t.d2))
    return tuple(sorted(idx))


def _fma(dst: str, coef: float | None, a: str, b: str | None) -> Group:
    return (Statement(dst, True, ((coef, a, b),)),)


def _adjoint_block(val: float, k: int, i: int, j: int, source: str) -> Group:
    """One CG entry of a backward coupling: its coefficient times the adjoint, into dx and dy."""
    return (Statement("cg", False, ((val, f"{source}[{k}]", None),)),
            Statement(f"dx[{i}]", True, ((None, "cg", f"yv[{j}]"),)),
            Statement(f"dy[{j}]", True, ((None, "cg", f"xv[{i}]"),)))


def _forward_term(t: Term) -> TermCode:
    if t.mode == "uvu":
        return TermCode(t, tuple(_fma(f"acc[j][{k}]", v, f"xv[{i}]", f"yw[{j}]") for i, j, k, v in t.cg))
    return TermCode(t, tuple(_fma(f"t3[{k}]", v, f"xs[{i}]", f"ys[{j}]") for i, j, k, v in t.cg))


def _backward_term(t: Term, slots: tuple[int, ...]) -> TermCode:
    def gy(v: int) -> tuple[Group, ...]:
        slot = [slots.index(t.y_offset + v * t.d2 + j) for j in range(t.d2)]
        if t.mode == "uvu":
            return tuple(_fma(f"gya[{slot[j]}]", None, "wv", f"dy[{j}]") for j in range(t.d2))
        return tuple(_fma(f"gya[{slot[j]}]", None, f"dy[{j}]", None) for j in range(t.d2))  # w is inside h

    per_v = tuple(gy(v) for v in range(t.mul2))
    if t.mode == "uvu":
        return TermCode(t, tuple(_adjoint_block(v, k, i, j, "gv") for i, j, k, v in t.cg), (), per_v)
    products = tuple(_fma(f"t3[{k}]", v, f"xv[{i}]", f"yv[{j}]") for i, j, k, v in t.cg)
    return TermCode(t, products, tuple(_adjoint_block(v, k, i, j, "h") for i, j, k, v in t.cg), per_v)


def build_program(schedule: Schedule, backward: bool) -> TPProgram:
    """The program of one direction. Backward: the segments that share an edge loop (the schedule's loop order)
    share grad y's register slots, so the warp reduces an edge's grad y once per group, not once per segment."""
    if not backward:
        segs = tuple(SegmentCode(s, tuple(_forward_term(t) for t in s.terms)) for s in schedule.forward)
        return TPProgram(schedule, backward, segs)
    order = schedule.loop_order(True)
    members: dict = {}
    for i, s in enumerate(schedule.backward):
        members.setdefault(loop_group(order, i, s.c0, s.c1), []).append(s)
    slots = [gy_slots(members[loop_group(order, i, s.c0, s.c1)]) for i, s in enumerate(schedule.backward)]
    segs = tuple(SegmentCode(s, tuple(_backward_term(t, sl) for t in s.terms), sl)
                 for s, sl in zip(schedule.backward, slots))
    return TPProgram(schedule, backward, segs)
