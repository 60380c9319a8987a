"""Static schedule of a tensor product for the generated kernels: plain values.

A warp computes one row (a batch row or a convolution's node); lanes own channels. Forward segments group the
instructions by output irrep, a chunk of its channels each, accumulated in registers; backward segments group by
in1 irrep (grad x in registers, grad W per term, grad y reduced over the warp). Each segment's operands are staged
in shared memory (``Load``); offsets are in elements of one warp's window.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.cg import sparse_cg
from ..core.errors import SharedMemoryError
from ..core.offsets import running_offsets
from ..core.tuning import TPTuning
from .problem import TPProblem

WARP = 32


@dataclass(frozen=True)
class Load:
    """A coalesced copy of `count` elements of a row of `source` into the warp's shared memory."""

    source: str  # "x" (an in1 row) or "g" (a grad-out row, backward)
    global_offset: int  # element offset inside the row
    smem_offset: int
    count: int


@dataclass(frozen=True)
class Term:
    """One instruction's work inside a segment."""

    ins: int
    mode: str  # "uvu" or "uvw"
    has_weight: bool
    mul1: int
    mul2: int
    mul_out: int
    d1: int
    d2: int
    d3: int
    x_smem: int  # smem offset of in1 channel `x_base`
    x_base: int  # first in1 channel staged (uvu: the chunk start; uvw: 0)
    y_offset: int  # offset of the in2 irrep inside the (fully staged) in2 row
    g_smem: int  # backward only: smem offset of grad-out channel `g_base` (-1 forward)
    g_base: int
    w_offset: int  # offset of this instruction's weights in a weight row
    cg: tuple[tuple[int, int, int, float], ...]  # (m1, m2, m3, value), path weight folded in


@dataclass(frozen=True)
class Segment:
    """Channels [c0, c1) of one irrep (out irrep forward, in1 irrep backward)."""

    irrep: int
    c0: int
    c1: int
    dim: int  # 2l+1 of that irrep
    row_offset: int  # offset of channel 0 of that irrep in its row
    stage_smem: int  # smem offset where results are staged for a coalesced store
    loads: tuple[Load, ...]  # operands staged before the terms run
    terms: tuple[Term, ...]

    @property
    def lane_iters(self) -> int:
        return -(-(self.c1 - self.c0) // WARP)

    @property
    def x_smem(self) -> int:
        """Backward: where the segment's own in1 channels are staged."""
        return next(ld.smem_offset for ld in self.loads if ld.source == "x")


@dataclass(frozen=True)
class Launch:
    """How one direction's kernel is launched: its channel chunk and its own shared-memory window
    (a forward kernel never pays for the larger backward window, which would cut its occupancy)."""

    chunk: int
    smem_per_warp: int  # elements
    warps_per_block: int


@dataclass(frozen=True)
class Schedule:
    problem: TPProblem
    forward: tuple[Segment, ...]
    backward: tuple[Segment, ...]
    y_smem: int  # the whole in2 row is staged at this offset
    forward_launch: Launch
    backward_launch: Launch
    tuning: TPTuning = TPTuning()
    rows_are_nodes: bool = False  # rows are CSR nodes (deterministic convolution), else edges / batch rows
    itemsize: int = 4
    stacked_backward: bool = False  # the backward windows of one edge loop lie side by side (``stacked_windows``)

    def row_grad_once(self, layout) -> bool:
        """Whether the backward kernel of ``layout`` stages each row's grad-out block once per edge loop rather than per
        edge: CSR without ``gidx`` and a window no other segment of the loop writes (segments order, or
        ``stacked_windows``)."""
        return layout.csr and not layout.gidx and (self.loop_order(True) == "segments" or self.stacked_backward)

    def backward_passes(self) -> int:
        """Channel chunks the backward kernel can run as separate launches (group_pass): the chunks order's over CSR
        rows where ``backward_chunk_passes`` allows it; else 1."""
        if not (self.tuning.backward_chunk_passes and self.rows_are_nodes and self.loop_order(True) == "chunks"):
            return 1
        return len({(seg.c0, seg.c1) for seg in self.backward})

    def loop_order(self, backward: bool) -> str:
        """One direction's loop order: the tuning's, or for ``auto`` (after ``chunks_order``) edges outermost in a CSR
        forward whose accumulators take at most ``EDGES_FORWARD_WORDS`` registers per lane, else segments."""
        if backward:
            return backward_order(self.problem, self.itemsize, self.rows_are_nodes, self.tuning)
        order = self.tuning.order(False)
        if order != "auto":
            return order
        if chunks_order(self.problem, self.itemsize, self.rows_are_nodes, False):
            return "chunks"
        if not self.rows_are_nodes:
            return "segments"
        words = sum(s.lane_iters * s.dim for s in self.forward) * max(self.itemsize // 4, 1)
        return "edges" if words <= EDGES_FORWARD_WORDS else "segments"

    @property
    def smem_per_warp(self) -> int:
        """The larger window (enough for either direction; what the CPU interpreter allocates)."""
        return max(self.forward_launch.smem_per_warp, self.backward_launch.smem_per_warp)

    def launch(self, backward: bool) -> Launch:
        return self.backward_launch if backward else self.forward_launch


def _cg_terms(problem: TPProblem, k: int) -> tuple[tuple[int, int, int, float], ...]:
    ins = problem.instructions[k]
    l1, l2, l3 = (problem.irreps_in1[ins.i_in1].ir.l, problem.irreps_in2[ins.i_in2].ir.l,
                  problem.irreps_out[ins.i_out].ir.l)
    return tuple((a, b, c, v * ins.path_weight) for a, b, c, v in sparse_cg(l1, l2, l3))


def _offsets(irreps) -> list[int]:
    return list(running_offsets(mul * ir.dim for mul, ir in irreps))


def _segment(problem: TPProblem, backward: bool, i: int, c0: int, c1: int, base: int) -> tuple[Segment, int]:
    """(segment, its window's end) for channels [c0, c1) of irrep `i` (out forward, in1 backward), its window from
    `base`: the terms of every instruction writing (forward) or reading (backward) them, operands staged."""
    p = problem
    off1, off2, offo = _offsets(p.irreps_in1), _offsets(p.irreps_in2), _offsets(p.irreps_out)
    own, own_offsets = (p.irreps_in1, off1) if backward else (p.irreps_out, offo)
    dim = own[i].ir.dim
    cursor = base
    loads: list[Load] = []
    if backward:
        loads.append(Load("x", off1[i] + c0 * dim, cursor, (c1 - c0) * dim))
        cursor += (c1 - c0) * dim
    staged: dict[tuple[int, int, int], int] = {}  # (irrep, first channel, count) -> smem offset
    terms = []
    for k, (ins, woff) in enumerate(zip(p.instructions, p.weight_offsets)):
        if (ins.i_in1 if backward else ins.i_out) != i:
            continue
        (mul1, ir1), (mul2, ir2), (mul_o, ir_o) = (p.irreps_in1[ins.i_in1], p.irreps_in2[ins.i_in2],
                                                   p.irreps_out[ins.i_out])
        # the operand staged per instruction: grad-out channels (backward) or in1 channels (forward)
        source, j, mul_s, dim_s, offsets = (("g", ins.i_out, mul_o, ir_o.dim, offo) if backward
                                            else ("x", ins.i_in1, mul1, ir1.dim, off1))
        first, count = (c0, c1 - c0) if ins.mode == "uvu" else (0, mul_s)
        key = (j, first, count)
        if key not in staged:
            staged[key] = cursor
            loads.append(Load(source, offsets[j] + first * dim_s, cursor, count * dim_s))
            cursor += count * dim_s
        x_smem, x_base, g_smem, g_base = (base, c0, staged[key], first) if backward else (staged[key], first, -1, 0)
        terms.append(Term(k, ins.mode, ins.has_weight, mul1, mul2, mul_o, ir1.dim, ir2.dim, ir_o.dim,
                          x_smem, x_base, off2[ins.i_in2], g_smem, g_base, woff, _cg_terms(p, k)))
    seg = Segment(i, c0, c1, dim, own_offsets[i], cursor, tuple(loads), tuple(terms))
    return seg, cursor + (c1 - c0) * dim


def loop_group(order: str, index: int, c0: int, c1: int) -> object:
    """The edge loop of segment ``index`` (channels [c0, c1)): segments with equal keys share one, all of them
    (``edges``), one channel chunk's (``chunks``), or each its own (``segments``)."""
    return 0 if order == "edges" else (c0, c1) if order == "chunks" else index


def _segments(problem: TPProblem, chunk: int, base: int, backward: bool,
              stacked_order: str | None = None) -> tuple[list[Segment], int]:
    """The segments of one direction and the end of the largest window; with ``stacked_order`` the segments sharing an
    edge loop get windows side by side, else every window starts at ``base``."""
    irreps = problem.irreps_in1 if backward else problem.irreps_out
    used = {(ins.i_in1 if backward else ins.i_out) for ins in problem.instructions}
    segments, peak = [], base
    ends: dict[object, int] = {}  # loop group -> end of its windows so far (stacked)
    for i, (mul, _) in enumerate(irreps):
        if i not in used:
            continue  # never written: the op zero-fills these (forward) or they get no gradient
        for c0 in range(0, mul, chunk):
            c1 = min(mul, c0 + chunk)
            group = None if stacked_order is None else loop_group(stacked_order, len(segments), c0, c1)
            seg, end = _segment(problem, backward, i, c0, c1, ends.get(group, base))
            if group is not None:
                ends[group] = end
            segments.append(seg)
            peak = max(peak, end)
    return segments, peak


# Default chunks and limits, measured: docs/measured-constants.md. Backward segments end in warp reductions of
# grad y, so wide ones win until the window (BACKWARD_WINDOW_BYTES) cuts occupancy. EDGES_FORWARD_WORDS: the most
# 32-bit accumulator words per lane of a CSR forward that ``auto`` runs in the edges order.
EDGES_FORWARD_WORDS = 160
NODE_FORWARD_CHUNK = 128
EDGE_FORWARD_CHUNK = 64
BACKWARD_CHUNK = 64
BACKWARD_WINDOW_BYTES = 8 * 1024
CHUNKS_ORDER_CHUNK = 32
# One in1 irrep, FP32, CSR rows: TPTuning.single_irrep_backward_chunk's window may reach SINGLE_IRREP_WINDOW_BYTES.
SINGLE_IRREP_WINDOW_BYTES = 10 * 1024


def chunks_order(problem: TPProblem, itemsize: int, rows_are_nodes: bool, backward: bool) -> bool:
    """Whether ``auto`` runs one direction of an FP32 CSR kernel in the ``chunks`` order with
    ``CHUNKS_ORDER_CHUNK``-channel chunks: the forward where in1 has two or more irreps, the backward where they also
    share one multiplicity (an edge's operands are staged and its grad y reduced once per chunk, not per segment)."""
    if not (rows_are_nodes and itemsize == 4 and len(problem.irreps_in1) > 1):
        return False
    return not backward or len({mul for mul, _ in problem.irreps_in1}) == 1


def backward_order(problem: TPProblem, itemsize: int, rows_are_nodes: bool, tuning: TPTuning) -> str:
    """The backward's loop order: the tuning's, or for ``auto`` chunks where ``chunks_order`` says so, else
    segments (``Schedule.loop_order``)."""
    order = tuning.order(True)
    if order != "auto":
        return order
    return "chunks" if chunks_order(problem, itemsize, rows_are_nodes, True) else "segments"


def stacked_windows(problem: TPProblem, itemsize: int, rows_are_nodes: bool, tuning: TPTuning) -> bool:
    """Whether the backward segments that share an edge loop may get shared-memory windows side by side, so that a
    walk over the forward's rows stages each row's grad-out block once per loop (``TPTuning.row_grad_once``; CSR rows,
    chunks or edges order; ``build_schedule`` keeps them within ``TPTuning.stacked_window_bytes``)."""
    return (tuning.row_grad_once and rows_are_nodes
            and backward_order(problem, itemsize, rows_are_nodes, tuning) in ("chunks", "edges"))


def default_chunks(problem: TPProblem, itemsize: int, rows_are_nodes: bool, tuning: TPTuning) -> tuple[int, int]:
    """(forward, backward) channel chunks for a kernel whose rows are nodes (CSR) or edges/batch rows: a
    direction that ``auto`` runs in the chunks order (``chunks_order``) takes ``CHUNKS_ORDER_CHUNK``."""
    forward = NODE_FORWARD_CHUNK if rows_are_nodes else EDGE_FORWARD_CHUNK
    backward = BACKWARD_CHUNK
    y_dim = problem.irreps_in2.dim
    while backward > WARP and _segments(problem, backward, y_dim, True)[1] * itemsize > BACKWARD_WINDOW_BYTES:
        backward //= 2
    single = tuning.single_irrep_backward_chunk
    if (single is not None and rows_are_nodes and itemsize == 4 and len(problem.irreps_in1) == 1
            and problem.irreps_in1[0].mul > backward
            and _segments(problem, single, y_dim, True)[1] * itemsize <= SINGLE_IRREP_WINDOW_BYTES):
        backward = single

    def auto_chunks(direction_backward: bool) -> bool:
        return (tuning.order(direction_backward) == "auto"
                and chunks_order(problem, itemsize, rows_are_nodes, direction_backward))

    return (CHUNKS_ORDER_CHUNK if auto_chunks(False) else forward,
            CHUNKS_ORDER_CHUNK if auto_chunks(True) else backward)


def build_schedule(problem: TPProblem, itemsize: int = 4, smem_bytes_per_block: int = 96 * 1024,
                   warps_per_block: int = 4, max_chunk: int | None = None, max_chunk_backward: int | None = None, *,
                   tuning: TPTuning | None = None, rows_are_nodes: bool = False) -> Schedule:
    """Each direction's channel chunk: the largest multiple of 32 up to ``max_chunk`` / ``max_chunk_backward`` (else the
    tuning's, else ``default_chunks``) whose window fits the block budget."""
    problem.validate()
    tuning = tuning if tuning is not None else TPTuning()
    y_dim = problem.irreps_in2.dim
    auto_fwd, auto_bwd = default_chunks(problem, itemsize, rows_are_nodes, tuning)
    fwd_max = next(c for c in (max_chunk, tuning.forward_chunk, auto_fwd) if c is not None)
    bwd_max = next(c for c in (max_chunk_backward, max_chunk, tuning.backward_chunk, auto_bwd) if c is not None)
    forward, f_launch = _fit(problem, fwd_max, y_dim, False, itemsize, smem_bytes_per_block, warps_per_block)
    backward, b_launch = _fit(problem, bwd_max, y_dim, True, itemsize, smem_bytes_per_block, warps_per_block)
    stacked = False
    if stacked_windows(problem, itemsize, rows_are_nodes, tuning):  # same chunk and warps, wider windows
        order = backward_order(problem, itemsize, rows_are_nodes, tuning)
        segments, peak = _segments(problem, b_launch.chunk, y_dim, True, order)
        window = max(peak, y_dim)
        if (window * itemsize <= tuning.stacked_window_bytes
                and window * itemsize * b_launch.warps_per_block <= smem_bytes_per_block):
            backward, b_launch = segments, Launch(b_launch.chunk, window, b_launch.warps_per_block)
            stacked = True
    return Schedule(problem, tuple(forward), tuple(backward), 0, f_launch, b_launch, tuning, rows_are_nodes,
                    itemsize, stacked)


def _fit(problem: TPProblem, chunk: int, y_dim: int, backward: bool, itemsize: int, smem_bytes_per_block: int,
         warps_per_block: int) -> tuple[list[Segment], Launch]:
    if chunk < WARP or chunk % WARP:
        raise ValueError(f"max_chunk must be a positive multiple of {WARP}, got {chunk}")
    while True:
        segments, peak = _segments(problem, chunk, y_dim, backward)
        per_warp = max(peak, y_dim)
        for wpb in (warps_per_block, 2, 1):
            if per_warp * itemsize * wpb <= smem_bytes_per_block:
                return segments, Launch(chunk, per_warp, wpb)
        if chunk == WARP:
            raise SharedMemoryError(
                f"problem too large for shared memory: one warp needs {per_warp * itemsize} bytes "
                f"(budget {smem_bytes_per_block} per block) even with {WARP}-channel chunks; "
                "uvw instructions with very large in1/out multiplicities are not supported")
        chunk = max(WARP, chunk // 2)
