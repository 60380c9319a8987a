"""The runtime's policy knobs as one typed value, passed to ``load`` / ``Potential`` / ``Calculator(options=...)``."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RuntimeOptions:
    """Memory, atom-order, compile and precision policy of a ``Potential`` (docs/calculator.md).

    Fractions of the free device memory a call's estimated peak may exceed before it streams
    (``streaming_auto_fraction``), turns on expandable allocator segments (``expandable_above_fraction``) or runs
    without a CUDA graph (``uncaptured_above_fraction``); ``tile_memory_fraction``: one tile's share.
    order_above_atoms: larger systems run in Z-curve order (``atom_order``; None: never). compile_backend: the
    ``torch.compile`` backend (``"aot_eager"``: no code generation, for tests). radial_tf32_tol: the largest
    relative force change a TF32 radial mode may make. tile_atoms: the most atoms a tile owns (None: the budget's).
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

