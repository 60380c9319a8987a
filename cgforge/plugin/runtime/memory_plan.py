"""How a structure's force call will use the GPU's memory: stored path or streaming, and the allocator's mode.

The thresholds are ``RuntimeOptions`` fractions of the free memory (docs/calculator.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .options import RuntimeOptions

_DEFAULTS = RuntimeOptions()
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


def plan_memory(edges: int, edge_bytes: int, free_bytes: int, atoms: int = 0,
                options: RuntimeOptions = _DEFAULTS) -> MemoryPlan:
    """The plan for a call over ``edges`` edges at ``edge_bytes`` peak bytes each (0: not known, never streams)
    with ``free_bytes`` free, for ``atoms`` atoms, by the fractions of ``options``."""
    for name, value in (("edges", edges), ("edge_bytes", edge_bytes), ("free_bytes", free_bytes), ("atoms", atoms)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"plan_memory: {name} must be an int >= 0, got {value!r}")
    estimate = edges * edge_bytes
    return MemoryPlan(edges, estimate, free_bytes, stream=estimate > options.streaming_auto_fraction * free_bytes,
                      expandable=estimate > options.expandable_above_fraction * free_bytes,
                      capture=estimate <= options.uncaptured_above_fraction * free_bytes, atoms=atoms)


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
