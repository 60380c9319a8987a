"""The ghosts' owners of one-rank exchange mode, found by one exchange and kept while LAMMPS's ghosts stand.

A map found by ``exchange.ghost_map`` stays right while ``x[a] - x[node_of[a]] == shift[a]`` holds for every atom
to ``TOLERANCE`` (``displaced``); ``GhostMapCache.lookup`` returns the kept map with that check still to make
(``OwnerCheck``: the eager path makes it at once, the padded step inside its captured graph), and a call whose check
fails runs again on a map found afresh (``refresh``). When and why: docs/lammps.md, section 2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .arrays import to_tensor
from .exchange import GhostMap, ghost_map

__all__ = ["GhostMapCache", "OwnerCheck", "TOLERANCE", "displaced", "positions"]

TOLERANCE = 1e-6  # A: |x[a] - x[owner] - shift| of a ghost that is still the same image (rounding: ~1e-12)


def positions(data: Any, ntotal: int, device: torch.device) -> Tensor | None:
    """The ``ntotal`` atoms' positions [ntotal, 3] float64 on ``device`` (LAMMPS's memory where it is there already),
    or None when the data object has none (LAMMPS's couples before 22 Jul 2025)."""
    x = getattr(data, "x", None)
    if x is None:
        return None
    x = to_tensor(x)
    if x.dim() != 2 or x.shape[1] != 3 or x.shape[0] < ntotal:
        raise ValueError(f"LAMMPS data: x has shape {tuple(x.shape)}, expected at least ({ntotal}, 3)")
    return x[:ntotal].to(device=device, dtype=torch.float64)


def displaced(x: Tensor, node_of: Tensor, shift: Tensor, tolerance: float, count: Tensor | None = None) -> Tensor:
    """A 0-d bool tensor, True when some atom ``a`` (of the first ``count``, a device scalar; None: all) is off
    ``x[node_of[a]] + shift[a]`` by more than ``tolerance`` in some coordinate, or at NaN. No host read."""
    near = ((x - x.index_select(0, node_of) - shift).abs() <= tolerance).all(1)
    if count is not None:  # rows past the count: stale buffer entries, not atoms
        near = near | (torch.arange(x.shape[0], device=x.device) >= count)
    return ~near.all()


@dataclass(frozen=True)
class OwnerCheck:
    """A kept map's check, not yet made: this call's positions ``x`` [ntotal, 3] float64, the map's ``node_of`` and
    each atom's ``shift`` from its owner when the map was found."""

    x: Tensor
    node_of: Tensor
    shift: Tensor
    tolerance: float

    def moved(self) -> Tensor:
        """The check made now (``displaced``): a 0-d bool device tensor, True when the map is stale."""
        return displaced(self.x, self.node_of, self.shift, self.tolerance)


class GhostMapCache:
    """One rank's ``GhostMap``, kept across calls while it stays right (module doc). ``exchanges``, ``reuses`` and
    ``refreshes`` count maps found, kept maps given and kept maps found stale; ``box_changes``: nothing is kept."""

    def __init__(self, tolerance: float = TOLERANCE) -> None:
        self.tolerance = float(tolerance)
        self.exchanges = self.reuses = self.refreshes = 0
        self.box_changes = False
        self._map = self._shift = None  # the kept GhostMap and each atom's periodic shift

    def lookup(self, data: Any, nlocal: int, ntotal: int, device: torch.device) -> tuple[GhostMap, OwnerCheck | None]:
        """This call's map and, for a kept one, the check it must pass (``OwnerCheck``; None for a map found now);
        ``data``'s arrays synchronised (``arrays.lammps_arrays``)."""
        x = positions(data, ntotal, device)
        kept = self._map
        if x is None or kept is None or (kept.nlocal, kept.ntotal) != (nlocal, ntotal):
            return self._found(data, nlocal, ntotal, device, x), None
        self.reuses += 1
        return kept, OwnerCheck(x, kept.node_of, self._shift, self.tolerance)

    def refresh(self, data: Any, nlocal: int, ntotal: int, device: torch.device) -> GhostMap:
        """A map found by an exchange now, for a kept one found stale (kept for later calls where it can be)."""
        self.refreshes += 1
        stale = self._map
        ghosts = self._found(data, nlocal, ntotal, device, positions(data, ntotal, device))
        if stale is not None and torch.equal(stale.node_of, ghosts.node_of):  # the same owners, other shifts
            self.box_changes = True
            self.clear()
        return ghosts

    def clear(self) -> None:
        """Keep no map: the next call exchanges."""
        self._map = self._shift = None

    def _found(self, data: Any, nlocal: int, ntotal: int, device: torch.device, x: Tensor | None) -> GhostMap:
        ghosts = ghost_map(data, nlocal, ntotal, device)
        self.exchanges += 1
        if x is None or not ghosts.one_domain or self.box_changes:  # not kept: no x, others' ghosts, a moving box
            self.clear()
        else:
            self._map, self._shift = ghosts, x - x.index_select(0, ghosts.node_of)
        return ghosts
