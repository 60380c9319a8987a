"""The runtime's policy knobs as one typed value, passed to ``load`` / ``Potential`` / ``Calculator(options=...)``."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RuntimeOptions:
    """Memory, atom-order, compile and precision policy of a ``Potential``.

    streaming_auto_fraction: with ``streaming=None``, stream when the stored path's estimated peak exceeds this
    fraction of the free device memory (``memory_plan``; the allocator keeps a little of the rest for itself).
    expandable_above_fraction: above this fraction turn on torch's expandable allocator segments for the process
    (near a full device fragmentation, not size, decides whether a call fits).
    uncaptured_above_fraction: above this fraction run the step without a CUDA graph unless one was asked for
    (a graph's private pool is memory the eager step would not hold, and such steps take seconds).
    order_above_atoms: systems of more atoms run in the Z-curve order of their positions (``atom_order``);
    None: never.
    compile_backend: the ``torch.compile`` backend of ``compile=...`` and of the MD engine's fused integrator
    (``"inductor"``; ``"aot_eager"`` traces the same graphs without code generation, for tests).
    radial_tf32_tol: the largest relative change of the forces a TF32 radial-MLP mode may make before the
    potential keeps FP32 (``radial_precision``).
    tile_atoms: with tiles (``workspace``; ``runtime.tiled``), the most atoms a tile owns; None: as many as the
    memory budget allows (100,000 off CUDA).
    tile_memory_fraction: the share of the free device memory one tile's working set may take.
    """

    streaming_auto_fraction: float = 0.92
    expandable_above_fraction: float = 0.4
    uncaptured_above_fraction: float = 0.6
    order_above_atoms: int | None = 100_000
    compile_backend: str | Callable[..., Any] = "inductor"
    radial_tf32_tol: float = 1e-4
    tile_atoms: int | None = None
    tile_memory_fraction: float = 0.7

    def __post_init__(self) -> None:
        for name in ("streaming_auto_fraction", "expandable_above_fraction", "uncaptured_above_fraction",
                     "radial_tf32_tol", "tile_memory_fraction"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name}: expected a finite number >= 0, got {value!r}")
        above = self.order_above_atoms
        if above is not None and (isinstance(above, bool) or not isinstance(above, int) or above < 0):
            raise ValueError(f"order_above_atoms: expected None or an int >= 0, got {above!r}")
        tile = self.tile_atoms
        if tile is not None and (isinstance(tile, bool) or not isinstance(tile, int) or tile < 1):
            raise ValueError(f"tile_atoms: expected None or an int >= 1, got {tile!r}")
        if not 0 < self.tile_memory_fraction <= 1:
            raise ValueError(f"tile_memory_fraction: expected a number in (0, 1], got {self.tile_memory_fraction!r}")
        backend = self.compile_backend
        if not (isinstance(backend, str) and backend) and not callable(backend):
            raise TypeError(f"compile_backend: expected a backend name or a callable, got {backend!r}")

