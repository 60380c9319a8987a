"""Where each block of a row starts: the one running sum behind every layout offset of the generator."""

from __future__ import annotations

from collections.abc import Iterable


def running_offsets(sizes: Iterable[int]) -> tuple[int, ...]:
    """(0, s0, s0 + s1, ...): the start of each block, one per size."""
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += size
    return tuple(offsets)
