"""Sums of several per-lane partials over a warp, each sum ending in some lanes: the reduce-scatter plan.

The template's ``reduce_scatter<P>`` sums P = 2^p partials in P - 1 + (5 - p) shuffles, not 5 P: each of p steps
hands half a lane's partials to its partner, then one butterfly spans the lanes sharing one; partial s ends in
lanes l with ``l >> (5 - p) == s``. ``plan(S)`` groups S partials at the fewest shuffles; ``simulate`` runs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

WARP = 32
# Groups of at most 8: fewer values in flight than groups of 16, which spilled (docs/measured-constants.md).
_WIDTHS = (1, 2, 4, 8)


def shuffles(width: int) -> int:
    """Shuffles of one ``reduce_scatter<width>``."""
    return width - 1 + (5 - width.bit_length() + 1)


@dataclass(frozen=True)
class ReduceGroup:
    """Partials ``first .. first + size - 1`` summed by one ``reduce_scatter<width>`` (zeros pad to ``width``)."""

    first: int
    size: int
    width: int

    @property
    def shift(self) -> int:
        """Lane ``l`` ends with partial ``l >> shift``; lanes with ``l % 2**shift == 0`` write it."""
        return 5 - (self.width.bit_length() - 1)


@cache
def _best(count: int) -> tuple[int, tuple[int, ...]]:
    """(shuffles, group widths in order) of the cheapest split of ``count`` partials; ties: fewer groups."""
    if count == 0:
        return 0, ()
    options = []
    for width in _WIDTHS:
        cost, rest = _best(count - min(width, count))
        options.append((shuffles(width) + cost, 1 + len(rest), (width, *rest)))
    cost, _, widths = min(options)
    return cost, widths


def plan(count: int) -> tuple[ReduceGroup, ...]:
    """The groups that sum ``count`` partials over a warp at the fewest shuffles (``_best``)."""
    if count < 0:
        raise ValueError(f"warp_reduce.plan: {count} partials")
    groups, first = [], 0
    for width in sorted(_best(count)[1], reverse=True):  # the widest first: a lone last partial (grad r) alone
        size = min(width, count - first)
        groups.append(ReduceGroup(first, size, width))
        first += size
    return tuple(groups)


def simulate(values: list[list[float]], width: int) -> list[float]:
    """What ``reduce_scatter<width>`` returns in each lane, given ``values[lane][k]`` (32 lanes x width partials),
    step by step as the template's loops run (the same additions in the same order)."""
    if len(values) != WARP or any(len(v) != width for v in values) or width not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"simulate: 32 lanes of {width} partials, width a power of two <= 32")
    v = [list(row) for row in values]
    h, offset = width // 2, 16
    while h >= 1:
        new = []
        for lane in range(WARP):
            upper = bool(lane & offset)
            partner = v[lane ^ offset]
            row = list(v[lane])
            for i in range(h):
                give = partner[i + h] if upper else partner[i]  # the partner hands over the half this lane keeps
                row[i] = (v[lane][i + h] if upper else v[lane][i]) + give
            new.append(row)
        v, h, offset = new, h // 2, offset // 2
    s = [row[0] for row in v]
    offset = 16 // width
    while offset > 0:
        s = [s[lane] + s[lane ^ offset] for lane in range(WARP)]
        offset //= 2
    return s
