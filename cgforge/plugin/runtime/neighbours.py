"""Neighbour lists: one cell-list (binning) search in torch (``cgforge.kernels.cell_search`` for the candidates).

matscipy's ``neighbour_list("ijS")`` conventions: an edge is (sender i, receiver j, integer image S) with
``vector = positions[j] - positions[i] + S @ cell`` (cell rows), ``|vector| < cutoff``; every pair in both
directions, (i, i, 0) never; positions need not be wrapped. Edges come sorted by (receiver, sender).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from cgforge.kernels.cell_search import Bins, candidate_pairs, empty_pairs
from cgforge.kernels.edge_layout import edges_within

PbcLike = bool | Sequence[bool] | Tensor | np.ndarray

# Candidate pairs examined per chunk. Bounds the transient memory (~60 bytes a candidate) whatever N is.
_CANDIDATES_PER_CHUNK = 1 << 22
# A cell much thinner than the cutoff needs (2 reach + 1)^3 images; refuse absurd requests clearly.
_MAX_BIN_OFFSETS = 1 << 20


def _as_pbc(pbc: PbcLike) -> tuple[bool, bool, bool]:
    if isinstance(pbc, bool | np.bool_):
        return (bool(pbc),) * 3
    values = pbc.detach().cpu().reshape(-1).tolist() if isinstance(pbc, Tensor) else np.asarray(pbc).reshape(-1)
    if len(values) != 3 or not all(v in (0, 1) for v in values):
        raise ValueError(f"pbc must be a bool or three bools, got {pbc!r}")
    return tuple(bool(v) for v in values)  # type: ignore[return-value]


def _check_cutoff(cutoff: float, name: str = "cutoff") -> float:
    try:
        value = float(cutoff)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number, got {type(cutoff).__name__}") from None
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"{name} must be a finite number > 0, got {cutoff!r}")
    return value


def _check_positions_and_cell(positions: Tensor, cell: Tensor) -> None:
    for name, value in (("positions", positions), ("cell", cell)):
        if not isinstance(value, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if positions.ndim != 2 or positions.shape[1] != 3:
        raise ValueError(f"positions must have shape [N, 3], got {tuple(positions.shape)}")
    if positions.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"positions must be float32 or float64, got {positions.dtype}")
    if tuple(cell.shape) != (3, 3):
        raise ValueError(f"cell must have shape [3, 3] (lattice vectors as rows), got {tuple(cell.shape)}")
    if cell.dtype != positions.dtype:
        raise ValueError(f"cell dtype {cell.dtype} does not match positions dtype {positions.dtype}")
    if cell.device != positions.device:
        raise ValueError(f"cell is on {cell.device} but positions are on {positions.device}")


def _binning_basis(cell: np.ndarray, pbc: tuple[bool, bool, bool]) -> np.ndarray:
    """Rows: the periodic lattice vectors, completed by an orthonormal basis of their complement (non-periodic
    cell vectors are never used for shifts, so they may be zero, parallel or anything)."""
    periodic_rows = [d for d in range(3) if pbc[d]]
    if not periodic_rows:
        return np.eye(3)
    lattice = cell[periodic_rows]
    singular_values = np.linalg.svd(lattice, compute_uv=False)
    if singular_values.max() == 0.0 or singular_values.min() <= 1e-9 * singular_values.max():
        raise ValueError(f"cell is singular along its periodic directions (pbc={pbc}): "
                         f"lattice vectors {lattice.tolist()} are not linearly independent")
    _, _, right = np.linalg.svd(lattice)
    complement = iter(right[len(periodic_rows):])
    return np.stack([cell[d] if pbc[d] else next(complement) for d in range(3)])


def _bins_per_direction(lengths: np.ndarray, cutoff: float, n_atoms: int) -> list[int]:
    """Bins at least `cutoff` wide, coarsened when the box is mostly vacuum so memory stays O(N)."""
    max_bins = 2 * n_atoms + 64
    width = cutoff
    while True:
        bins = [max(1, int(length // width)) for length in lengths]
        total = math.prod(bins)
        if total <= max_bins:
            return bins
        width *= max(1.01, (total / max_bins) ** (1 / 3))


def _search(positions: Tensor, cell: Tensor, pbc: tuple[bool, bool, bool], cutoff: float,
            candidates_per_chunk: int) -> tuple[Tensor, Tensor, Tensor]:
    """The search of ``neighbour_list``: the atoms binned here, the candidate loop ``candidate_pairs`` (CUDA
    kernels on a GPU, torch elsewhere), then the exact cut."""
    if positions.shape[0] == 0:
        return empty_pairs(positions.device)
    binned = _bin_atoms(positions, cell, pbc, cutoff)
    sender, receiver, shift = candidate_pairs(binned, cell, pbc, candidates_per_chunk)
    # The exact cut, as edges_within() computes it from the positions as given, so that both always agree.
    inside = torch.nonzero(edges_within(positions, cell, sender, receiver, shift, cutoff)[2]).squeeze(1)
    return tuple(t.index_select(0, inside) for t in (sender, receiver, shift))


def _to_device(values: object, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A few host values on ``device``: on CUDA a non-blocking copy from pinned memory (a pageable copy syncs)."""
    host = torch.as_tensor(np.asarray(values), dtype=dtype)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)


def _bin_atoms(positions: Tensor, cell: Tensor, pbc: tuple[bool, bool, bool], cutoff: float) -> Bins:
    """Bins at least ``cutoff`` wide over the cell (periodic directions) or the atoms' extent (others)."""
    n_atoms, device, dtype = positions.shape[0], positions.device, positions.dtype
    # Two reads of the device (each a host sync on CUDA): the cell with the positions' finiteness, then the bounds.
    head = torch.cat([cell.reshape(9).to(torch.float64), torch.isfinite(positions).all().to(torch.float64).reshape(1)])
    head = head.cpu().numpy()
    if not head[9]:
        raise ValueError("positions contain NaN or inf")
    cell_host = head[:9].reshape(3, 3)
    if not np.isfinite(cell_host).all():
        raise ValueError(f"cell contains NaN or inf: {cell_host.tolist()}")

    # Fractional coordinates in the binning basis (float64 whatever the input dtype: wrapping must be exact).
    basis = _binning_basis(cell_host, pbc)
    inverse = np.linalg.inv(basis)
    heights = 1.0 / np.linalg.norm(inverse, axis=0)  # spacing of lattice planes per direction, in Å
    frac = positions.to(torch.float64) @ _to_device(inverse, torch.float64, device)
    periodic = _to_device(pbc, torch.bool, device)
    wrap = torch.where(periodic, -torch.floor(frac), torch.zeros_like(frac))  # integer images into the cell
    frac = frac + wrap
    wrapped = positions.detach() + wrap.to(dtype) @ cell
    scale = torch.maximum(positions.abs().max(), wrapped.abs().max()).to(torch.float64).reshape(1)
    bounds = torch.cat([frac.amin(0), frac.amax(0), scale]).cpu().numpy()
    low, high = bounds[:3], bounds[3:6]
    origin = np.where(pbc, 0.0, low)
    extent = np.where(pbc, 1.0, high - low)

    bins = _bins_per_direction(extent * heights, cutoff, n_atoms)
    bin_width = np.where(extent > 0, extent / np.asarray(bins), 1.0)
    # How many bins each side can hold a neighbour: one when bins are >= cutoff wide, more for a thin cell.
    reach = [math.ceil(cutoff * bins[d] / (extent[d] * heights[d]) - 1e-9) if pbc[d] else min(1, bins[d] - 1)
             for d in range(3)]
    n_offsets = math.prod(2 * r + 1 for r in reach)
    if n_offsets > _MAX_BIN_OFFSETS:
        raise ValueError(f"cutoff {cutoff} is too large for a cell with plane spacings {heights.tolist()} Å: "
                         f"the search would need {n_offsets} periodic images")

    bins_t = _to_device(bins, torch.int64, device)
    coord = (frac - _to_device(origin, torch.float64, device)) / _to_device(bin_width, torch.float64, device)
    # Clamped: a wrapped coordinate that rounds to exactly 1.0 stays in the last bin.
    coord = torch.minimum(torch.floor(coord).long().clamp_(min=0), bins_t - 1)
    bin_of_atom = (coord[:, 0] * bins[1] + coord[:, 1]) * bins[2] + coord[:, 2]
    atoms_by_bin = torch.argsort(bin_of_atom, stable=True)
    atoms_in_bin = torch.bincount(bin_of_atom, minlength=math.prod(bins))
    first_in_bin = torch.cumsum(atoms_in_bin, 0) - atoms_in_bin

    search_cutoff = cutoff * (1 + 1e-4) + 64 * torch.finfo(dtype).eps * float(bounds[6])
    return Bins(wrapped, wrap.long(), coord, bin_of_atom, atoms_by_bin, atoms_in_bin, first_in_bin,
                 (bins[0], bins[1], bins[2]), (reach[0], reach[1], reach[2]), search_cutoff)


def neighbour_list(positions: Tensor, cell: Tensor, pbc: PbcLike, cutoff: float, *, return_vectors: bool = False,
                   candidates_per_chunk: int = _CANDIDATES_PER_CHUNK) -> tuple[Tensor, ...]:
    """All pairs closer than `cutoff`, as matscipy's ``neighbour_list("ijS", ...)`` finds them.

    positions [N, 3] and cell [3, 3] (rows; ignored along non-periodic directions) share dtype and device; pbc:
    three bools (a tuple avoids a device sync). Returns (sender, receiver, shifts) int64 [E], [E], [E, 3] (the
    module doc's convention), with ``return_vectors`` also (vectors, lengths), differentiable in positions and
    cell. O(N) at a fixed density; off CUDA the candidates go in chunks of ``candidates_per_chunk``.
    """
    _check_positions_and_cell(positions, cell)
    pbc = _as_pbc(pbc)
    cutoff = _check_cutoff(cutoff)
    if int(candidates_per_chunk) < 1:
        raise ValueError(f"candidates_per_chunk must be >= 1, got {candidates_per_chunk}")
    with torch.no_grad():
        sender, receiver, shifts = _search(positions.detach(), cell.detach(), pbc, cutoff,
                                           int(candidates_per_chunk))
    if not return_vectors:
        return sender, receiver, shifts
    vectors, lengths, _ = edges_within(positions, cell, sender, receiver, shifts, cutoff)
    return sender, receiver, shifts, vectors, lengths


def check_skin(skin: object) -> float:
    """The Verlet skin in Å: a number >= 0 (TypeError for another type)."""
    if isinstance(skin, bool) or not isinstance(skin, int | float | np.integer | np.floating):
        raise TypeError(f"skin: expected a number of Å >= 0, got {type(skin).__name__} {skin!r}")
    if not math.isfinite(skin) or skin < 0:
        raise ValueError(f"skin: expected a finite number of Å >= 0, got {skin!r}")
    return float(skin)


class VerletNeighbourList:
    """A neighbour list at ``cutoff + skin``, rebuilt by ``update`` when an atom moved more than skin/2 since the
    last build or the cell, pbc, atom count, dtype or device changed (one device-to-host bool otherwise)."""

    def __init__(self, cutoff: float, skin: float = 0.5) -> None:
        self.cutoff = _check_cutoff(cutoff)
        self.skin = check_skin(skin)
        self.sender = self.receiver = self.shifts = None  # the list: [E], [E], [E, 3]
        self.n_builds = 0
        self._positions = self._cell = self._pbc = None  # what the list was built for

    @property
    def list_cutoff(self) -> float:
        return self.cutoff + self.skin

    def update(self, positions: Tensor, cell: Tensor, pbc: PbcLike) -> bool:
        """Rebuild if needed; returns True when the list was rebuilt."""
        _check_positions_and_cell(positions, cell)
        pbc = _as_pbc(pbc)
        if not self._is_stale(positions, cell, pbc):
            return False
        self.rebuild(positions, cell, pbc)
        return True

    def rebuild(self, positions: Tensor, cell: Tensor, pbc: PbcLike) -> None:
        """Build the list now at these positions and cell, stale or not (the MD engine decides staleness on the
        device, from the reference positions it keeps itself). ``neighbour_list`` checks the arguments."""
        self.install(positions, cell, pbc, neighbour_list(positions, cell, pbc, self.list_cutoff))

    def install(self, positions: Tensor, cell: Tensor, pbc: PbcLike, lists: tuple[Tensor, Tensor, Tensor]) -> None:
        """Take (sender, receiver, shifts) that ``neighbour_list`` found at ``list_cutoff`` for these positions
        and cell (possibly computed elsewhere, e.g. on a side stream while MD steps ran) as the list."""
        self.sender, self.receiver, self.shifts = lists
        self._positions = positions.detach().clone()
        self._cell = cell.detach().clone()
        self._pbc = _as_pbc(pbc)
        self.n_builds += 1

    def edges(self, positions: Tensor, cell: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(vectors, lengths, mask) of the current list at the true cutoff; call after update()."""
        if self.sender is None:
            raise RuntimeError("VerletNeighbourList.edges() called before update()")
        return edges_within(positions, cell, self.sender, self.receiver, self.shifts, self.cutoff)

    def _is_stale(self, positions: Tensor, cell: Tensor, pbc: tuple[bool, bool, bool]) -> bool:
        reference = self._positions
        if (reference is None or pbc != self._pbc or reference.shape != positions.shape
                or reference.dtype != positions.dtype or reference.device != positions.device):
            return True
        with torch.no_grad():
            stale = (cell != self._cell).any()
            if positions.shape[0]:
                moved_sq = (positions - reference).square().sum(-1).amax()
                # Written as "not <=" so that NaN positions count as moved and reach the build's checks.
                stale = stale | ~(moved_sq <= (0.5 * self.skin) ** 2)
            return bool(stale)  # the one host sync per step
