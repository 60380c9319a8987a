"""Fixed-workspace force evaluation: the system in tiles, each evaluated with its halo.

A tile is a cluster without a cell: the atoms it owns and every periodic image within ``hops x cutoff`` of them.
Only the owned atoms' energies are differentiated, so the tiles' energies, forces and virials sum to the whole
system's; no array over all edges exists. Deterministic (fixed orders throughout); docs/calculator.md.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from cgforge.kernels.edge_layout import layout_edges, pad_offset_vector
from cgforge.kernels.segment_sum import segment_sum
from cgforge.patches.graph_cache import graph_caches
from cgforge.patches.species_linear import SpeciesGroups

from .adapters import ModelAdapter
from .neighbours import _as_pbc, _binning_basis, neighbour_list
from .options import RuntimeOptions
from .step_graph import StepOutput, graph_derivatives

Pbc = tuple[bool, bool, bool]
_HALO_MARGIN = 1e-6  # relative: the halo is a hair wider than hops x cutoff (rounding of the search's lengths)
_SMALLEST_TILE = 64  # owned atoms: a budget that needs smaller tiles cannot be met (the halo would dominate)
_CPU_TILE_ATOMS = 100_000  # owned atoms a tile takes where no memory budget applies (off CUDA)


@dataclass(frozen=True)
class Frame:
    """The system in lattice coordinates: ``fractional`` [N, 3] (of ``basis``, ``neighbours._binning_basis``),
    wrapped into [0, 1) along periodic directions (wrapped = positions + ``image`` @ cell), their lower bound
    ``low`` and extent ``span`` [3], and ``per_angstrom`` [3] (the inverse spacing of each direction's planes)."""

    fractional: Tensor
    image: Tensor
    basis: np.ndarray
    low: np.ndarray
    span: np.ndarray
    per_angstrom: np.ndarray
    pbc: Pbc

    @classmethod
    def of(cls, positions: Tensor, cell: np.ndarray, pbc: Pbc) -> Frame:
        """The frame of float64 ``positions`` [N, 3] (on their device) in ``cell`` (rows) with ``pbc``."""
        basis = _binning_basis(np.asarray(cell, dtype=np.float64), pbc)
        inverse = np.linalg.inv(basis)
        frac = positions @ torch.as_tensor(inverse, dtype=positions.dtype, device=positions.device)
        periodic = torch.tensor(pbc, device=positions.device)
        shift = torch.where(periodic, torch.floor(frac), torch.zeros_like(frac))
        frac = frac - shift
        low, span = np.zeros(3), np.ones(3)
        if not all(pbc):
            lo, hi = frac.min(0).values.cpu().numpy(), frac.max(0).values.cpu().numpy()
            for d in range(3):
                if not pbc[d]:
                    low[d], span[d] = lo[d], max(hi[d] - lo[d], 1e-9)
        return cls(frac, -shift.to(torch.int64), basis, low, span, np.linalg.norm(inverse, axis=0), pbc)


@dataclass(frozen=True)
class TileGrid:
    """``counts`` tiles along each lattice direction; ``halo`` in Å (hops x cutoff, and a hair)."""

    counts: tuple[int, int, int]
    halo: float

    @property
    def n_tiles(self) -> int:
        return math.prod(self.counts)


def plan_grid(frame: Frame, n_atoms: int, hops: int, cutoff: float, *, tile_atoms: int | None = None,
              budget_bytes: int | None = None, edge_bytes: int = 0, edges_per_atom: float | None = None) -> TileGrid:
    """The coarsest grid whose tiles own at most ``tile_atoms`` atoms and whose estimated working set
    (``edge_bytes`` per edge: a tile's receivers, its atoms and those within ``hops - 1`` cutoffs, times
    ``edges_per_atom``, needed with a budget) fits ``budget_bytes`` (None: no such bounds).
    Tiles split where thickest; MemoryError when the budget needs tiles of fewer than ``_SMALLEST_TILE`` atoms."""
    if hops < 1:
        raise ValueError(f"hops must be >= 1, got {hops}")
    if tile_atoms is not None and (isinstance(tile_atoms, bool) or not isinstance(tile_atoms, int) or tile_atoms < 1):
        raise ValueError(f"tile_atoms: expected None or an int >= 1, got {tile_atoms!r}")
    thickness = frame.span / frame.per_angstrom  # Å across each direction's lattice planes
    if budget_bytes is not None and edges_per_atom is None:
        raise ValueError("plan_grid: a memory budget needs edges_per_atom (sampled_edges_per_atom)")
    reach = (hops - 1) * cutoff  # Å beyond a tile whose receivers the tile evaluates

    def cost(counts: list[int]) -> tuple[float, float]:
        owned = n_atoms / math.prod(counts)
        grow = 1.0
        for d in range(3):
            if frame.pbc[d] or counts[d] > 1:
                grow *= 1.0 + 2.0 * reach * counts[d] / thickness[d]
        return owned, owned * grow * (edges_per_atom or 0.0) * edge_bytes

    counts = [1, 1, 1]
    while True:
        owned, bytes_ = cost(counts)
        if (tile_atoms is None or owned <= tile_atoms) and (budget_bytes is None or bytes_ <= budget_bytes):
            break
        if owned < _SMALLEST_TILE and (tile_atoms is None or owned <= tile_atoms):
            raise MemoryError(f"tiles: {bytes_ / 1e9:.2f} GB for a tile of {owned:.0f} atoms exceeds the budget of "
                              f"{(budget_bytes or 0) / 1e9:.2f} GB; the halo alone does not fit")
        widest = int(np.argmax(thickness / np.asarray(counts)))
        counts[widest] += 1
    return TileGrid((counts[0], counts[1], counts[2]), hops * cutoff * (1.0 + _HALO_MARGIN) + 1e-9)


@dataclass
class Cluster:
    """One tile as the model sees it: its atoms' ``index`` into the system [M], their positions [M, 3] (model
    dtype, relative to the tile's centre), ``owned`` [M] bool, and edges (receiver-sorted) in cluster indices."""

    index: Tensor
    positions: Tensor
    owned: Tensor
    sender: Tensor
    receiver: Tensor


class TiledEvaluation:
    """Energy, forces, virial and per-atom energies of a system, tile by tile (module doc), with ``adapter``'s
    model; a patched model's self-connections run per species (as in ``ModelStep``)."""

    def __init__(self, adapter: ModelAdapter) -> None:
        self.adapter = adapter
        self.hops = int(adapter.hops)
        self.cutoff = float(adapter.cutoff)
        self.caches = graph_caches(adapter.model)
        self.pad_vector = pad_offset_vector(self.cutoff, adapter.dtype, adapter.device)
        self.n_edges = 0  # edges evaluated at the last call, over all tiles (halo receivers counted again)
        self.n_tiles = 0
        self.largest_cluster = 0  # atoms of the largest cluster at the last call

    def run(self, positions: Tensor, cell: np.ndarray, species: Tensor, grid: TileGrid, frame: Frame, *,
            forces: bool = True, stress: bool = False, per_atom: bool = False) -> np.ndarray:
        """``ModelStep.run``'s host result for float64 ``positions`` [N, 3] on the model's device and the adapter's
        ``species``, tile by tile (``frame``: ``Frame.of`` the positions; ``grid``: ``plan_grid`` of it)."""
        n = positions.shape[0]
        forces = forces or stress
        device, dtype = positions.device, self.adapter.dtype
        cell_t = torch.as_tensor(np.asarray(cell, dtype=np.float64), device=device)
        species_index = self.adapter.species_index(species)
        wrapped = positions + frame.image.to(positions.dtype) @ cell_t
        owner = owner_of(frame, grid)
        energy = torch.zeros((), dtype=torch.float64, device=device)
        total_forces = torch.zeros(n, 3, dtype=torch.float64, device=device) if forces else None
        virial = torch.zeros(3, 3, dtype=torch.float64, device=device) if stress else None
        energies = torch.zeros(n, dtype=torch.float64, device=device) if per_atom else None
        self.n_edges, self.n_tiles, self.largest_cluster = 0, grid.n_tiles, 0
        zero_cell = torch.zeros(3, 3, dtype=dtype, device=device)
        key = (forces, stress, per_atom)
        try:
            for tile in itertools.product(*(range(c) for c in grid.counts)):
                cluster = cluster_of(frame, grid, tile, owner, wrapped, cell_t, dtype, self.cutoff, self.hops)
                if cluster is None:
                    continue
                out = self._evaluate(cluster, species_index, zero_cell, key)
                own = cluster.owned
                atom_energies = out.energies.to(torch.float64)
                energy += atom_energies[own].sum()
                if forces:
                    add_rows(total_forces, cluster.index, out.forces.to(torch.float64))
                if stress:
                    virial += out.virial.to(torch.float64)
                if per_atom:
                    energies.index_copy_(0, cluster.index[own], atom_energies[own])
                self.n_edges += int(cluster.sender.shape[0])
                self.largest_cluster = max(self.largest_cluster, int(cluster.index.shape[0]))
        finally:
            for cache in self.caches:
                cache.unpin()
        parts = [energy.reshape(1)] + [t.reshape(-1) for t in (total_forces, virial, energies) if t is not None]
        return torch.cat(parts).cpu().numpy()

    def _evaluate(self, cluster: Cluster, species_index: Tensor, zero_cell: Tensor, key: tuple[bool, bool, bool]
                  ) -> StepOutput:
        """The cluster's energy weighted to its owned atoms, and its derivatives (``graph_derivatives``)."""
        adapter = self.adapter
        m, count = cluster.index.shape[0], cluster.sender.shape[0]
        kind = species_index.index_select(0, cluster.index)
        species = adapter.species_from_index(kind)
        with torch.no_grad():
            keep = torch.ones(count, dtype=torch.bool, device=zero_cell.device)
            layout = layout_edges(keep, cluster.sender, cluster.receiver, zero_cell.new_zeros(count, 3), m, count,
                                  self.pad_vector, with_graph=bool(self.caches))
        groups = SpeciesGroups.from_species(kind) if self.caches else None
        weights = cluster.owned.to(cluster.positions.dtype)
        return graph_derivatives(adapter, self.caches, layout, m, cluster.positions, zero_cell,
                                 lambda p, v, e, per_atom: adapter.energy(p, v, species, e, per_atom),
                                 (key[0], key[1], True), groups=groups, weights=weights)


def owner_of(frame: Frame, grid: TileGrid) -> Tensor:
    """[N, 3] int64: the tile of each atom along each direction."""
    counts = torch.tensor(grid.counts, device=frame.fractional.device)
    low = torch.as_tensor(frame.low, device=frame.fractional.device)
    span = torch.as_tensor(frame.span, device=frame.fractional.device)
    cell_of = torch.floor((frame.fractional - low) / span * counts).to(torch.int64)
    return torch.minimum(cell_of.clamp(min=0), counts - 1)


def cluster_of(frame: Frame, grid: TileGrid, tile: tuple[int, int, int], owner: Tensor, wrapped: Tensor,
               cell: Tensor, dtype: torch.dtype, cutoff: float, hops: int) -> Cluster | None:
    """``tile`` and its halo (periodic images included) as a cluster in ``dtype``, its edges within ``cutoff`` pruned
    to the receivers within ``hops - 1`` graph steps of an owned atom; None for a tile that owns no atom."""
    device = wrapped.device
    frac = frame.fractional
    halo = grid.halo * frame.per_angstrom  # in each direction's coordinate
    per_direction = []
    for d in range(3):
        width = frame.span[d] / grid.counts[d]
        lo = frame.low[d] + tile[d] * width - halo[d]
        hi = frame.low[d] + (tile[d] + 1) * width + halo[d]
        images = range(math.floor(lo), math.floor(hi) + 1) if frame.pbc[d] else (0,)
        per_direction.append([(k, (frac[:, d] + k >= lo) & (frac[:, d] + k <= hi)) for k in images])
    centre = np.array([frame.low[d] + (tile[d] + 0.5) * frame.span[d] / grid.counts[d] for d in range(3)])
    centre = torch.as_tensor(centre @ frame.basis, device=device)
    tile_t = torch.tensor(tile, device=device)
    mine = (owner == tile_t).all(1)
    index, shifts, owned = [], [], []
    for combo in itertools.product(*per_direction):
        inside = combo[0][1] & combo[1][1] & combo[2][1]
        picked = torch.nonzero(inside).reshape(-1)
        if picked.numel() == 0:
            continue
        k = torch.tensor([c[0] for c in combo], dtype=torch.float64, device=device)
        index.append(picked)
        shifts.append((k @ cell).expand(picked.shape[0], 3))
        owned.append(mine.index_select(0, picked) if all(c[0] == 0 for c in combo)
                     else torch.zeros(picked.shape[0], dtype=torch.bool, device=device))
    if not index:
        return None
    index_t, owned_t = torch.cat(index), torch.cat(owned)
    if not bool(owned_t.any()):
        return None
    positions = (wrapped.index_select(0, index_t) + torch.cat(shifts) - centre).to(dtype)
    sender, receiver, _ = neighbour_list(positions, torch.zeros(3, 3, dtype=dtype, device=device),
                                         (False, False, False), cutoff)
    # Receivers within hops - 1 graph steps of an owned atom; the atoms they hear from.
    needed = owned_t.clone()
    for _ in range(hops - 1):
        needed[sender[needed.index_select(0, receiver)]] = True
    keep = needed.index_select(0, receiver)
    sender, receiver = sender[keep], receiver[keep]
    used = needed.clone()
    used[sender] = True
    renumber = torch.cumsum(used.to(torch.int64), 0) - 1
    nodes = torch.nonzero(used).reshape(-1)
    return Cluster(index_t.index_select(0, nodes), positions.index_select(0, nodes),
                   owned_t.index_select(0, nodes), renumber.index_select(0, sender),
                   renumber.index_select(0, receiver))


def sampled_edges_per_atom(frame: Frame, wrapped: Tensor, cell: Tensor, cutoff: float, dtype: torch.dtype,
                           sample_atoms: int = 20_000) -> float:
    """Edges within ``cutoff`` per atom, counted on the most populated tile of a grid of about ``sample_atoms``
    atoms a tile: the system's own structure (a uniform system's mean) at the cost of one small search."""
    n = wrapped.shape[0]
    grid = plan_grid(frame, n, 1, cutoff, tile_atoms=min(sample_atoms, n))
    grid = TileGrid(grid.counts, cutoff * (1.0 + _HALO_MARGIN) + 1e-9)
    owner = owner_of(frame, grid)
    counts = torch.tensor(grid.counts, device=owner.device)
    flat = (owner[:, 0] * counts[1] + owner[:, 1]) * counts[2] + owner[:, 2]
    fullest = int(torch.bincount(flat).argmax())
    tile = tuple(int(i) for i in np.unravel_index(fullest, grid.counts))
    cluster = cluster_of(frame, grid, tile, owner, wrapped, cell, dtype, cutoff, 1)
    return float(cluster.sender.shape[0]) / max(int(cluster.owned.sum()), 1)


def add_rows(total: Tensor, index: Tensor, rows: Tensor) -> None:
    """total[index[k]] += rows[k] for every k, in an order fixed for every run: a stable sort of ``index`` and
    segment sums over its runs (``index_add_`` would add repeated indices with atomics, in any order)."""
    order = torch.argsort(index, stable=True)
    ordered = index.index_select(0, order)
    unique, counts = torch.unique_consecutive(ordered, return_counts=True)
    rowptr = torch.zeros(unique.shape[0] + 1, dtype=torch.int64, device=index.device)
    rowptr[1:] = torch.cumsum(counts, 0)
    total.index_add_(0, unique, segment_sum(rows.index_select(0, order), rowptr))


WORKSPACES = ("auto", "whole", "tiled")


def check_workspace(workspace: object) -> str:
    """``workspace`` checked: one of ``WORKSPACES``."""
    if not isinstance(workspace, str):
        raise TypeError(f"workspace: expected one of {', '.join(map(repr, WORKSPACES))}, got "
                        f"{type(workspace).__name__}")
    if workspace not in WORKSPACES:
        raise ValueError(f"workspace: expected one of {', '.join(map(repr, WORKSPACES))}, got {workspace!r}")
    return str(workspace)


class Workspace:
    """How a ``Potential`` evaluates a system (``mode``): ``"whole"`` (one graph), ``"tiled"``
    (``TiledEvaluation``), or ``"auto"``: tiles on CUDA where the whole graph's estimated peak exceeds
    ``options.streaming_auto_fraction`` of the free memory, decided once per atom count before any neighbour list.
    Tiles get ``options.tile_memory_fraction`` of the free memory; a tile out of memory halves it and restarts."""

    def __init__(self, mode: str, adapter: ModelAdapter, options_of: Callable[[], RuntimeOptions]) -> None:
        self.mode = check_workspace(mode)
        self.adapter = adapter
        self._options_of = options_of  # the potential's options, read when a decision is made
        self.evaluation: TiledEvaluation | None = None
        self.grid: TileGrid | None = None  # the grid of the last tiled call
        self.budget_bytes: int | None = None
        self._decided: tuple[int, bool] | None = None  # (atom count, tiles)
        self.tiled_last = False  # whether the potential's last call ran in tiles
        self.edges_per_atom: float | None = None  # sampled when auto decides (``sampled_edges_per_atom``)

    def uses_tiles(self, positions: np.ndarray, cell: np.ndarray, pbc: Pbc) -> bool:
        """Whether a system of these positions runs in tiles (decided once per atom count)."""
        n = positions.shape[0]
        if self.mode != "auto":
            return self.mode == "tiled"
        if self._decided is not None and self._decided[0] == n:
            return self._decided[1]
        tiles = False
        if self.adapter.device.type == "cuda":
            self.edges_per_atom = self._sample(positions, cell, pbc)
            tiles = tiles_needed(n, self.edges_per_atom, self.adapter.stored_edge_bytes(n),
                                 _free_bytes(self.adapter.device), self._options_of().streaming_auto_fraction)
        self._decided = (n, tiles)
        return tiles

    def _sample(self, positions: np.ndarray, cell: np.ndarray, pbc: Pbc) -> float:
        device = self.adapter.device
        pos = torch.as_tensor(np.asarray(positions, dtype=np.float64), device=device)
        frame = Frame.of(pos, cell, _as_pbc(pbc))
        cell_t = torch.as_tensor(np.asarray(cell, dtype=np.float64), device=device)
        wrapped = pos + frame.image.to(pos.dtype) @ cell_t
        return sampled_edges_per_atom(frame, wrapped, cell_t, self.adapter.cutoff, self.adapter.dtype)

    def run(self, positions: np.ndarray, cell: np.ndarray, pbc: Pbc, species: Tensor, *, forces: bool,
            stress: bool, per_atom: bool) -> np.ndarray:
        """``TiledEvaluation.run`` of host ``positions`` [N, 3] (the layout of ``ModelStep.run``)."""
        if self.evaluation is None:
            self.evaluation = TiledEvaluation(self.adapter)
        device = self.adapter.device
        pos = torch.as_tensor(np.asarray(positions, dtype=np.float64), device=device)
        pbc = _as_pbc(pbc)
        frame = Frame.of(pos, cell, pbc)
        options = self._options_of()
        while True:
            tile_atoms = options.tile_atoms
            budget = None
            if device.type == "cuda":
                if self._decided is None or self._decided[0] != pos.shape[0]:  # tiles asked for: not sampled yet
                    self.edges_per_atom = self._sample(positions, cell, pbc)
                    self._decided = (pos.shape[0], True)
                if self.budget_bytes is None:
                    self.budget_bytes = int(options.tile_memory_fraction * _free_bytes(device))
                budget = self.budget_bytes
            elif tile_atoms is None:
                tile_atoms = _CPU_TILE_ATOMS
            self.grid = plan_grid(frame, pos.shape[0], self.evaluation.hops, self.evaluation.cutoff,
                                  tile_atoms=tile_atoms, budget_bytes=budget,
                                  edge_bytes=self.adapter.stored_edge_bytes(pos.shape[0]) if budget else 0,
                                  edges_per_atom=self.edges_per_atom)
            try:
                return self.evaluation.run(pos, cell, species, self.grid, frame, forces=forces, stress=stress,
                                           per_atom=per_atom)
            except torch.cuda.OutOfMemoryError:
                if budget is None or budget < (64 << 20):
                    raise
                self.budget_bytes = budget // 2
                torch.cuda.empty_cache()

    @property
    def n_edges(self) -> int:
        return 0 if self.evaluation is None else self.evaluation.n_edges

    @property
    def tiles_chosen(self) -> bool:
        """Whether the last system decided runs in tiles (``mode="tiled"``, or auto's decision)."""
        return self.mode == "tiled" or (self._decided is not None and self._decided[1])


def tiles_needed(n_atoms: int, edges_per_atom: float, edge_bytes: int, free_bytes: int, fraction: float) -> bool:
    """Whether the whole graph's estimated peak, ``edge_bytes`` per edge, exceeds ``fraction`` of ``free_bytes``."""
    return n_atoms * edges_per_atom * edge_bytes > fraction * free_bytes


def _free_bytes(device: torch.device) -> int:
    """Free device memory, counting what torch's caching allocator holds unused."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))

