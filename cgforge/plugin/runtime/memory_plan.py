"""How a structure's force call will use the GPU's memory: stored path or streaming, and the allocator's mode.

The stored path (per-edge weights never stored when the radial tables are read in the kernels; row chunks for
the largest boxes) is ~1.8x faster than streaming at a million atoms (H100, MACE-MP-medium shape: 3.6 vs 6.5 s a
step) and, since the row chunks, hardly larger (73.4 vs 70.6 GB). So the calculator takes it wherever its peak,
estimated from the exact edge count, fits ``STREAMING_AUTO_FRACTION`` of the free memory; an estimate that proves
optimistic costs one call (the out-of-memory retry streams).

Near a full device, torch's caching allocator fails from fragmentation rather than size: at 1.03 M atoms the
second force call of the stored path asked for 19.6 GiB with 63 of 85 GB allocated and failed, as did streaming
in bench_md's steps, while both ran with ``expandable_segments`` (segments that grow in place instead of new
fixed blocks). A call whose estimate exceeds ``EXPANDABLE_ABOVE_FRACTION`` of the free memory turns that mode on
for the process, unless the user configured the allocator (``PYTORCH_CUDA_ALLOC_CONF``): the user's choice wins.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

__all__ = ["EXPANDABLE_ABOVE_FRACTION", "STREAMING_AUTO_FRACTION", "UNCAPTURED_ABOVE_FRACTION", "MemoryPlan",
           "plan_memory", "use_expandable_segments"]

# Stream when the stored path's estimated peak exceeds this of the free memory. The estimate is measured at the
# sizes that need it (row chunks: 860 B per edge, 847 measured at 1.03 M atoms: 74.5 GB estimated, 73.4 GB
# measured of the ~84 GB free on an H100 80GB), and the allocator keeps a little of the rest for itself.
STREAMING_AUTO_FRACTION = 0.92
EXPANDABLE_ABOVE_FRACTION = 0.4  # from here fragmentation can decide whether a call fits (1M: 0.87 of free)
# From here no CUDA graph (unless asked for): a graph's private pool is memory the eager step would not hold, and
# such steps take seconds (H100: 1.03 M atoms, 0.89 of free, ran out of memory capturing; 499k atoms, 0.43 of free:
# 1.720 s a step captured, 1.732 s eager).
UNCAPTURED_ABOVE_FRACTION = 0.6
_ALLOCATOR_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


@dataclass(frozen=True)
class MemoryPlan:
    """``estimate_bytes``: the stored path's peak for ``edges`` edges; ``stream``: too large for it;
    ``expandable``: near enough to full that the allocator should grow its segments in place; ``capture``: far
    enough from full for a CUDA graph's own memory pool; ``atoms``: the system size it was made for (0: not said)."""

    edges: int
    estimate_bytes: int
    free_bytes: int
    stream: bool
    expandable: bool
    capture: bool
    atoms: int = 0


def plan_memory(edges: int, edge_bytes: int, free_bytes: int, atoms: int = 0) -> MemoryPlan:
    """The plan for a force call over ``edges`` edges at ``edge_bytes`` peak bytes each (``stored_edge_bytes``;
    0: not known, never streams) with ``free_bytes`` free on the device, for a system of ``atoms`` atoms."""
    for name, value in (("edges", edges), ("edge_bytes", edge_bytes), ("free_bytes", free_bytes), ("atoms", atoms)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"plan_memory: {name} must be an int >= 0, got {value!r}")
    estimate = edges * edge_bytes
    return MemoryPlan(edges, estimate, free_bytes, stream=estimate > STREAMING_AUTO_FRACTION * free_bytes,
                      expandable=estimate > EXPANDABLE_ABOVE_FRACTION * free_bytes,
                      capture=estimate <= UNCAPTURED_ABOVE_FRACTION * free_bytes, atoms=atoms)


def use_expandable_segments() -> bool:
    """Turn on torch's expandable CUDA segments for this process unless the user configured the allocator (then
    theirs stands). True when they are on afterwards (as far as the configuration says)."""
    for name in _ALLOCATOR_VARIABLES:
        conf = os.environ.get(name)
        if conf:
            return "expandable_segments:true" in conf.replace(" ", "").lower()
    # torch's runtime switch (private; the older spelling is deprecated from torch 2.12)
    setter = (getattr(torch._C, "_accelerator_setAllocatorSettings", None)
              or getattr(torch.cuda.memory, "_set_allocator_settings", None))
    if setter is None:  # a torch without the runtime switch: the out-of-memory retry is what is left
        return False
    setter("expandable_segments:True")
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"  # said once: child processes inherit it
    return True
