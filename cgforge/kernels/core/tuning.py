"""Tuning values: the knobs of a schedule as plain frozen dataclasses, part of the schedule.

Nothing is read from the environment at import. A module takes ``tuning=...`` explicitly; without
one, ``from_env()`` reads the sweep variables once, when the module's plan is registered:

- ``CGFORGE_FORWARD_CHUNK``, ``CGFORGE_BACKWARD_CHUNK`` (tensor product / convolution channel chunks),
  ``CGFORGE_LOOP_ORDER`` (``auto``, ``segments``, ``edges`` or ``chunks``), ``CGFORGE_BACKWARD_LOOP_ORDER`` (the
  backward's, if it differs), ``CGFORGE_BACKWARD_MIN_BLOCKS``
  (``auto``, ``0`` for no launch bound, or the blocks per SM to bound to);
- ``CGFORGE_SC_BLOCK``, ``CGFORGE_SC_CHUNK``, ``CGFORGE_SC_PAIRINGS`` (symmetric contraction).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

LOOP_ORDERS = ("auto", "segments", "edges", "chunks")
PAIRINGS = ("pq", "pd", "qd")


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {value!r}") from None


@dataclass(frozen=True)
class TPTuning:
    """Tensor product and convolution kernels.

    forward_chunk / backward_chunk: largest channel chunk per segment (a multiple of 32; None: the
    measured defaults of ``schedule.default_chunks``). loop_order: in a row with several edges (the
    deterministic convolution), ``segments`` walks the edges once per segment (few live registers),
    ``edges`` walks them once and runs every segment per edge (every segment's accumulators live across
    the edge loop; operands staged once per edge rather than once per segment), ``chunks`` the same per channel
    chunk (one edge loop per chunk, fewer live accumulators than ``edges``); ``auto`` (default) picks
    per direction (``Schedule.loop_order``): chunks of 32 channels where ``schedule.chunks_order`` says so (in1
    with several irreps; for the backward of one multiplicity), else edges for a forward whose accumulators fit
    the registers and segments for the backward. backward_loop_order: the backward's
    own order (None: ``loop_order``'s); in the edges and chunks orders the segments of one edge loop reduce an
    edge's grad y over the warp once together.
    backward_min_blocks: the B of the CSR backward's ``__launch_bounds__(threads, B)``: ``auto`` (default) lets
    ``core.occupancy.choose_min_blocks`` pick from the unbounded compile's registers (a bound only where it
    lowers them and adds a resident block), 0 no bound, a positive int that bound.
    """

    forward_chunk: int | None = None
    backward_chunk: int | None = None
    loop_order: str = "auto"
    backward_min_blocks: int | str = "auto"
    backward_loop_order: str | None = None

    def __post_init__(self) -> None:
        for name in ("forward_chunk", "backward_chunk"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 32 or value % 32):
                raise ValueError(f"{name} must be None or a positive multiple of 32, got {value!r}")
        if self.loop_order not in LOOP_ORDERS:
            raise ValueError(f"loop_order must be one of {LOOP_ORDERS}, got {self.loop_order!r}")
        if self.backward_loop_order not in (None, *LOOP_ORDERS):
            raise ValueError(f"backward_loop_order must be None or one of {LOOP_ORDERS}, got "
                             f"{self.backward_loop_order!r}")
        bound = self.backward_min_blocks
        if bound != "auto" and (not isinstance(bound, int) or isinstance(bound, bool) or not 0 <= bound <= 32):
            raise ValueError(f"backward_min_blocks must be 'auto' or an int in [0, 32], got {bound!r}")

    def order(self, backward: bool) -> str:
        """The loop order set for one direction (the backward's own where set); ``auto`` is resolved by the
        schedule (``Schedule.loop_order``)."""
        return (self.backward_loop_order if backward else None) or self.loop_order

    @classmethod
    def from_env(cls) -> TPTuning:
        bound = os.environ.get("CGFORGE_BACKWARD_MIN_BLOCKS") or "auto"
        return cls(_env_int("CGFORGE_FORWARD_CHUNK"), _env_int("CGFORGE_BACKWARD_CHUNK"),
                   os.environ.get("CGFORGE_LOOP_ORDER") or "auto",
                   bound if bound == "auto" else _env_int("CGFORGE_BACKWARD_MIN_BLOCKS"),
                   os.environ.get("CGFORGE_BACKWARD_LOOP_ORDER") or None)

    def key(self) -> str:
        # fields added later enter the key only when set, so that older keys stay as they were
        bound = "" if self.backward_min_blocks == "auto" else f"|{self.backward_min_blocks}"
        order = "" if self.backward_loop_order is None else f"|b:{self.backward_loop_order}"
        return f"{self.forward_chunk}|{self.backward_chunk}|{self.loop_order}{bound}{order}"


@dataclass(frozen=True)
class SCTuning:
    """Symmetric contraction kernels.

    block: threads per block (one atom's channels for C = 128). chunk: atoms per thread in the
    grad-W' kernel (amortises the per-species atomics). pairings: how bilinear sums share partial
    results (``pq`` only: the partial sums ``pd``/``qd`` save 3-5% of the statements on MACE-MP
    shapes but raised ptxas's register count by 50-80%; off until measured on a GPU).
    """

    block: int = 128
    chunk: int = 16
    pairings: tuple[str, ...] = ("pq",)

    def __post_init__(self) -> None:
        if not isinstance(self.block, int) or not 32 <= self.block <= 1024 or self.block % 32:
            raise ValueError(f"block must be a multiple of 32 in [32, 1024], got {self.block!r}")
        if not isinstance(self.chunk, int) or self.chunk < 1:
            raise ValueError(f"chunk must be a positive int, got {self.chunk!r}")
        if not self.pairings or any(p not in PAIRINGS for p in self.pairings):
            raise ValueError(f"pairings must be a non-empty subset of {PAIRINGS}, got {self.pairings!r}")

    @classmethod
    def from_env(cls) -> SCTuning:
        default = cls()
        pairings = os.environ.get("CGFORGE_SC_PAIRINGS")
        return cls(_env_int("CGFORGE_SC_BLOCK") or default.block, _env_int("CGFORGE_SC_CHUNK") or default.chunk,
                   tuple(pairings.split(",")) if pairings else default.pairings)

    def key(self) -> str:
        return f"{self.block}|{self.chunk}|{','.join(self.pairings)}"
