"""Many structures in one graph: energies, forces, virials and per-atom energies of a batch in one model call.

    from cgforge.plugin.runtime.batch import BatchStructure
    results = potential.evaluate_batch([BatchStructure(numbers, positions, cell, pbc), ...], stress=True)

The atoms lie end to end (structure b owns atoms ptr[b] .. ptr[b + 1] - 1) in one graph whose edges never join two
structures; one neighbour search (``batch_neighbour_list``), a Verlet list kept per structure (``BatchNeighbours``)
and one model call, with one strain per structure for its virial (``step_graph.graph_derivatives``). docs/batch.md
says how; a bad structure raises ``BatchStructureError`` naming its index. ``BatchStep.run`` runs eagerly (exact
edge counts, host reads); batched MD's fixed-cell steps run padded and captured (``batch_capture``).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from cgforge.kernels.edge_layout import EdgeLayout, EdgeTopology, edge_topology, layout_edges, pad_offset_vector
from cgforge.patches.graph_cache import graph_caches
from cgforge.patches.species_linear import SpeciesGroups

from .diagnosis import NonFiniteOutputError
from .neighbours import _binning_basis, neighbour_list
from .step_graph import StepOutput, graph_derivatives

if TYPE_CHECKING:
    from .adapters import ModelAdapter

__all__ = ["BatchStructure", "BatchStructureError", "BatchNeighbours", "BatchStep", "batch_neighbour_list",
           "check_finite", "check_shapes", "non_finite", "pair_lengths"]

Pbc = tuple[bool, bool, bool]
# Images of a cell the search may need per atom, at most (a cell far thinner than the cutoff).
_MAX_IMAGES = 1 << 12


class BatchStructureError(ValueError):
    """A structure of a batch that cannot be evaluated; ``index`` is its position in the batch."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(f"structure {index}: {message}")
        self.index = index
        self.reason = message


@dataclass(frozen=True)
class BatchStructure:
    """One structure of a batch: atomic numbers [N], positions [N, 3] (Å), cell [3, 3] (lattice vectors as
    rows; ignored along non-periodic directions) and pbc."""

    numbers: np.ndarray
    positions: np.ndarray
    cell: np.ndarray
    pbc: Pbc


def check_shapes(index: int, structure: BatchStructure) -> None:
    """What one structure's shapes say: at least one atom, positions [N, 3], cell [3, 3], three pbc flags."""
    numbers, positions, cell = (np.shape(a) for a in (structure.numbers, structure.positions, structure.cell))
    if len(numbers) != 1 or numbers[0] == 0:
        raise BatchStructureError(index, f"expected a structure with at least one atom, got numbers of shape "
                                         f"{numbers}")
    if positions != (numbers[0], 3):
        raise BatchStructureError(index, f"positions of shape {positions} for {numbers[0]} atoms")
    if cell != (3, 3):
        raise BatchStructureError(index, f"cell of shape {cell}, expected (3, 3)")
    if len(structure.pbc) != 3:
        raise BatchStructureError(index, f"pbc must be three bools, got {structure.pbc!r}")


def non_finite(index: int) -> NonFiniteOutputError:
    """The error for NaN or inf in the results of structure ``index`` (which it keeps as ``index``)."""
    error = NonFiniteOutputError(f"structure {index}: the model returned NaN or inf (check its atoms for overlaps "
                                 "and the model file)")
    error.index = index
    return error


def check_finite(positions: np.ndarray, cells: np.ndarray, ptr: Sequence[int]) -> None:
    """NaN or inf in the batch's positions [N, 3] or cells [B, 3, 3] names the first structure holding one."""
    bad_atoms = ~np.isfinite(positions).all(1)
    if bad_atoms.any():
        first = int(np.argmax(bad_atoms))
        b = int(np.searchsorted(ptr, first, side="right")) - 1
        atoms = np.nonzero(bad_atoms[ptr[b]:ptr[b + 1]])[0]
        raise BatchStructureError(b, f"positions contain NaN or inf (atoms {atoms[:5].tolist()})")
    bad_cells = ~np.isfinite(cells).reshape(len(cells), -1).all(1)
    if bad_cells.any():
        b = int(np.argmax(bad_cells))
        raise BatchStructureError(b, f"cell contains NaN or inf: {cells[b].tolist()}")


def batch_neighbour_list(positions: Tensor, cells: Tensor, pbcs: Sequence[Pbc], ptr: Sequence[int],
                         cutoff: float) -> tuple[Tensor, Tensor, Tensor]:
    """Every pair closer than ``cutoff`` within each structure of a batch (positions [N, 3] end to end, cells
    [B, 3, 3], pbcs), as ``neighbours.neighbour_list`` finds them for each alone: (sender, receiver, shifts) with
    batch-wide indices, sorted by (receiver, sender, shift); the search runs in float64 (docs/batch.md says how)."""
    device = positions.device
    n, count = positions.shape[0], len(pbcs)
    sizes = torch.as_tensor(np.diff(np.asarray(ptr)), device=device)
    structure = torch.repeat_interleave(torch.arange(count, device=device), sizes)
    cells_host = cells.detach().to("cpu", torch.float64).numpy()
    periodic_host = np.array(pbcs, dtype=bool).reshape(count, 3)
    basis = np.empty((count, 3, 3))
    for b in range(count):
        try:
            basis[b] = _binning_basis(cells_host[b], tuple(periodic_host[b]))
        except ValueError as err:  # a singular periodic cell
            raise BatchStructureError(b, str(err)) from None
    inverse = np.linalg.inv(basis)
    heights = 1.0 / np.linalg.norm(inverse, axis=1)  # [B, 3] lattice-plane spacings (Å)
    reach = np.where(periodic_host, np.floor(cutoff / heights) + 1, 0).astype(np.int64)  # images each side
    images_each = np.prod(2 * reach + 1, axis=1)
    if (images_each > _MAX_IMAGES).any():
        worst = int(np.argmax(images_each))
        raise BatchStructureError(worst, f"cutoff {cutoff} is too large for a cell with plane spacings "
                                         f"{heights[worst].tolist()} Å: {int(images_each[worst])} periodic images")

    f64 = {"dtype": torch.float64, "device": device}
    pos = positions.detach().to(torch.float64)
    cells64 = torch.as_tensor(cells_host, **f64)
    periodic = torch.as_tensor(periodic_host, device=device)
    frac = (pos.unsqueeze(1) @ torch.as_tensor(inverse, **f64).index_select(0, structure)).squeeze(1)
    wrap = torch.where(periodic.index_select(0, structure), -torch.floor(frac), torch.zeros_like(frac))
    frac = frac + wrap
    atom_cell = cells64.index_select(0, structure)
    wrapped = pos + (wrap.unsqueeze(1) @ atom_cell).squeeze(1)

    # Periodic images near the cell: atom i shifted by image T when frac_i + T lies within cutoff of [0, 1); the
    # images a structure may need depend on its reach, so structures are taken by reach (a tiny cell's many
    # images are tried for its own atoms only).
    margin = torch.as_tensor(cutoff / heights + 1e-6, **f64)  # [B, 3], in cell fractions
    lo, hi = -margin.index_select(0, structure), 1 + margin.index_select(0, structure)
    open_axes = ~periodic.index_select(0, structure)
    structure_host = np.repeat(np.arange(count), np.diff(np.asarray(ptr)))
    ghost_atoms, ghost_shifts = [], []
    for row in np.unique(reach, axis=0):
        if not row.any():
            continue  # no periodic direction: no images
        members = torch.as_tensor(np.nonzero((reach[structure_host] == row).all(1))[0], device=device)
        axes = [torch.arange(-r, r + 1, device=device) for r in row.tolist()]
        images = torch.stack(torch.meshgrid(*axes, indexing="ij"), -1).reshape(-1, 3)
        images = images[(images != 0).any(1)]
        moved = frac.index_select(0, members).unsqueeze(1) + images.unsqueeze(0).to(torch.float64)  # [n, K, 3]
        near = (moved >= lo.index_select(0, members).unsqueeze(1)) & (moved <= hi.index_select(0, members).unsqueeze(1))
        near = (near | open_axes.index_select(0, members).unsqueeze(1)).all(-1)
        atom, image = torch.nonzero(near).unbind(1)
        ghost_atoms.append(members.index_select(0, atom))
        ghost_shifts.append(images.index_select(0, image))
    ghost_atom = torch.cat(ghost_atoms) if ghost_atoms else structure.new_zeros(0)
    ghost_shift = torch.cat(ghost_shifts) if ghost_shifts else structure.new_zeros(0, 3)
    ghosts = wrapped.index_select(0, ghost_atom) + (ghost_shift.to(torch.float64).unsqueeze(1)
                                                    @ atom_cell.index_select(0, ghost_atom)).squeeze(1)

    # Each structure in its own place: a grid of boxes wider than any structure by two cutoffs.
    points = torch.cat([wrapped, ghosts])
    point_structure = torch.cat([structure, structure.index_select(0, ghost_atom)])
    index3 = point_structure.unsqueeze(1).expand(-1, 3)
    low = torch.full((count, 3), math.inf, **f64).scatter_reduce(0, index3, points, "amin")
    high = torch.full((count, 3), -math.inf, **f64).scatter_reduce(0, index3, points, "amax")
    box = float((high - low).max()) + 2 * cutoff
    side = max(1, math.ceil(count ** (1 / 3) - 1e-9))
    b = torch.arange(count, device=device)
    place = torch.stack([b % side, (b // side) % side, b // (side * side)], 1).to(torch.float64) * box - low
    points = points + place.index_select(0, point_structure)
    sender, receiver, _ = neighbour_list(points, torch.zeros(3, 3, **f64), False, cutoff)

    keep = receiver < n  # pairs into the structures' own atoms; images only send
    sender, receiver = sender[keep], receiver[keep]
    is_ghost = sender >= n
    ghost = (sender - n).clamp(min=0)
    # One spare entry, so that a batch without images still indexes in range.
    ghost_atom = torch.cat([ghost_atom, ghost_atom.new_zeros(1)])
    ghost_shift = torch.cat([ghost_shift, ghost_shift.new_zeros(1, 3)])
    atom = torch.where(is_ghost, ghost_atom.index_select(0, ghost), sender)
    image = torch.where(is_ghost.unsqueeze(1), ghost_shift.index_select(0, ghost), 0)
    wrap_int = wrap.to(torch.int64)
    # wrapped = positions + wrap @ cell, so positions[r] - (wrapped[s] + T @ cell) = positions[r] - positions[s]
    # + (wrap[r] - wrap[s] - T) @ cell
    shifts = wrap_int.index_select(0, receiver) - wrap_int.index_select(0, atom) - image
    return _sorted(atom, receiver, shifts, n)


def pair_lengths(positions: Tensor, cells: Tensor, structure: Tensor, sender: Tensor, receiver: Tensor,
                 shifts: Tensor) -> Tensor:
    """|pos[r] - pos[s] + S @ cell of r's structure| of each listed pair (``structure`` [N]: each atom's)."""
    vectors = (positions.index_select(0, receiver) - positions.index_select(0, sender)
               + (shifts.unsqueeze(1) @ cells.index_select(0, structure.index_select(0, receiver))).squeeze(1))
    return torch.linalg.vector_norm(vectors, dim=-1)


def _sorted(sender: Tensor, receiver: Tensor, shifts: Tensor, n: int) -> tuple[Tensor, Tensor, Tensor]:
    """The pairs in (receiver, sender, shift) order: a fixed order, whatever the search's."""
    if sender.numel() == 0:
        return sender, receiver, shifts.reshape(0, 3)
    reach = int(shifts.abs().max())
    side = 2 * reach + 1
    code = ((shifts[:, 0] + reach) * side + shifts[:, 1] + reach) * side + shifts[:, 2] + reach
    order = torch.argsort(code, stable=True)
    order = order.index_select(0, torch.argsort((receiver * n + sender).index_select(0, order), stable=True))
    return sender.index_select(0, order), receiver.index_select(0, order), shifts.index_select(0, order)


@dataclass
class _Kept:
    """One structure's Verlet list in its own atom indices, with what it was built for."""

    sender: Tensor
    receiver: Tensor
    shifts: Tensor
    positions: Tensor  # where its atoms were at the build
    cell: np.ndarray
    pbc: Pbc


class BatchNeighbours:
    """The batch's Verlet list at ``cutoff + skin``, kept per structure: a structure is searched again (all such in
    one ``batch_neighbour_list``) only when it is new, its atom count, cell or pbc changed, or an atom moved more
    than skin/2."""

    def __init__(self, cutoff: float, skin: float) -> None:
        self.cutoff, self.skin = float(cutoff), float(skin)
        self.sender = self.receiver = self.shifts = None
        self.topology: EdgeTopology | None = None
        self.n_builds = 0  # updates that searched
        self.n_searched = 0  # structures searched, over all updates
        self._kept: dict[Hashable, _Kept] = {}
        self._order: tuple | None = None
        self._ptr: list[int] | None = None
        self._reference: Tensor | None = None  # built_at() of the list in ``_order``

    def update(self, positions: Tensor, cells: np.ndarray, pbcs: Sequence[Pbc], ptr: Sequence[int],
               keys: Sequence[Hashable] | None = None, search: Collection[int] = ()) -> int:
        """Bring the list up to date for these structures (``keys``: one per structure, naming it from call
        to call; None: its place in the batch; ``search``: structures searched again whatever they moved); the
        number of structures searched."""
        count = len(pbcs)
        keys = tuple(range(count)) if keys is None else tuple(keys)
        if len(keys) != count or len(set(keys)) != count:
            raise ValueError(f"keys: expected {count} distinct keys, one per structure, got {len(keys)} "
                             f"({len(set(keys))} distinct)")
        kept = [self._kept.get(k) for k in keys]
        usable = [k is not None and k.positions.shape[0] == ptr[b + 1] - ptr[b] and k.pbc == pbcs[b]
                  and k.positions.dtype == positions.dtype and np.array_equal(k.cell, cells[b]) and b not in search
                  for b, k in enumerate(kept)]
        same = keys == self._order and list(ptr) == self._ptr  # the batch of the last update, moved on
        if any(usable):
            # a structure not usable is stale whatever it moved: its rows of the reference are never read
            reference = self._reference if same else torch.cat([
                k.positions if use else positions[ptr[b]:ptr[b + 1]] for b, (k, use) in enumerate(zip(kept, usable))])
            structure = torch.repeat_interleave(torch.arange(count, device=positions.device),
                                                torch.as_tensor(np.diff(ptr), device=positions.device))
            moved = (positions.detach() - reference).square().sum(-1)
            worst = moved.new_zeros(count).scatter_reduce(0, structure, moved, "amax")
            # "not <=": NaN counts as moved
            usable = [u and bool(w) for u, w in zip(usable, (worst <= (0.5 * self.skin) ** 2).tolist())]
        stale = [b for b in range(count) if not usable[b]]
        if not stale and same:
            return 0
        if stale:
            self._search(positions, cells, pbcs, ptr, keys, stale)
        self._kept = {k: self._kept[k] for k in keys}
        self._order, self._ptr = keys, list(ptr)
        # the same batch with a few lists new (batched MD: most steps): splice them in, not re-join every structure
        lists = self._splice(stale, ptr, keys) if same and len(stale) < len(keys) else self._join(keys, ptr)
        self.sender, self.receiver, self.shifts, self._reference = lists
        self.topology = edge_topology(self.sender, self.receiver, self.shifts, ptr[-1])
        return len(stale)

    def built_at(self) -> Tensor:
        """[N, 3]: where the atoms of the batch of the last ``update`` were when their lists were searched."""
        return self._reference

    def _join(self, keys: tuple, ptr: Sequence[int]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(sender, receiver, shifts, built_at) of the kept lists of ``keys`` end to end, in batch indices."""
        parts = [self._kept[k] for k in keys]
        return (torch.cat([k.sender + ptr[b] for b, k in enumerate(parts)]),
                torch.cat([k.receiver + ptr[b] for b, k in enumerate(parts)]),
                torch.cat([k.shifts for k in parts]), torch.cat([k.positions for k in parts]))

    def _splice(self, stale: list[int], ptr: Sequence[int], keys: tuple) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``_join``'s result from the last list: the ``stale`` structures' edges dropped, their new ones added, one
        stable sort by receiver (each structure's list is sorted by receiver and a receiver's edges come from one
        list, so every receiver keeps its edges' order: equal to ``_join``)."""
        n = ptr[-1]
        replaced = torch.zeros(n, dtype=torch.bool, device=self.sender.device)
        reference = self._reference.clone()
        for b in stale:
            replaced[ptr[b]:ptr[b + 1]] = True
            reference[ptr[b]:ptr[b + 1]] = self._kept[keys[b]].positions
        keep = ~replaced.index_select(0, self.receiver)
        new = [(b, self._kept[keys[b]]) for b in stale]
        sender = torch.cat([self.sender[keep], *(k.sender + ptr[b] for b, k in new)])
        receiver = torch.cat([self.receiver[keep], *(k.receiver + ptr[b] for b, k in new)])
        shifts = torch.cat([self.shifts[keep], *(k.shifts for _, k in new)])
        order = torch.argsort(receiver, stable=True)
        return sender[order], receiver[order], shifts[order], reference

    def _search(self, positions: Tensor, cells: np.ndarray, pbcs: Sequence[Pbc], ptr: Sequence[int],
                keys: tuple, stale: list[int]) -> None:
        """One search over the ``stale`` structures; their lists kept in their own indices."""
        sizes = [ptr[b + 1] - ptr[b] for b in stale]
        sub_ptr = np.concatenate([[0], np.cumsum(sizes)]).tolist()
        sub_positions = torch.cat([positions[ptr[b]:ptr[b + 1]] for b in stale]).detach()
        sub_cells = torch.as_tensor(np.stack([cells[b] for b in stale]), device=positions.device)
        try:
            sender, receiver, shifts = batch_neighbour_list(sub_positions, sub_cells, [pbcs[b] for b in stale],
                                                            sub_ptr, self.cutoff + self.skin)
        except BatchStructureError as err:  # its index in the batch, not among the stale ones
            raise BatchStructureError(stale[err.index], err.reason) from None
        bounds = torch.searchsorted(receiver, torch.as_tensor(sub_ptr, device=receiver.device)).tolist()
        for i, b in enumerate(stale):
            lo, hi = bounds[i], bounds[i + 1]
            self._kept[keys[b]] = _Kept(sender[lo:hi] - sub_ptr[i], receiver[lo:hi] - sub_ptr[i], shifts[lo:hi],
                                        sub_positions[sub_ptr[i]:sub_ptr[i + 1]].clone(), np.array(cells[b]),
                                        pbcs[b])
        self.n_builds += 1
        self.n_searched += len(stale)


class BatchStep:
    """Energies, forces, virials and per-atom energies of a batch of structures for one model's ``adapter``; skin:
    the Verlet skin (Å); two atoms of a structure closer than ``min_distance`` (Å; None: no check) make it bad."""

    def __init__(self, adapter: ModelAdapter, skin: float, min_distance: float | None = 0.5) -> None:
        self.adapter = adapter
        self.cutoff = float(adapter.cutoff)
        self.neighbours = BatchNeighbours(self.cutoff, skin)
        self.min_distance = min_distance
        self.caches = graph_caches(adapter.model)
        self.pad_vector = pad_offset_vector(self.cutoff, adapter.dtype, adapter.device)
        self.n_edges = 0
        # the padded step of the last batched MD run (``batch_capture.PaddedBatchStep``): its captures, its error
        self.padded = None

    def species(self, numbers: np.ndarray, ptr: Sequence[int]) -> Tensor:
        """The model's species input of every atom of the batch (``numbers`` end to end), in one call; an unknown
        element names its structure."""
        try:
            return self.adapter.species(numbers)
        except ValueError:
            for b in range(len(ptr) - 1):  # which structure: the first whose own numbers fail
                try:
                    self.adapter.species(numbers[ptr[b]:ptr[b + 1]])
                except ValueError as err:
                    raise BatchStructureError(b, str(err)) from None
            raise

    def evaluate(self, structures: Sequence[BatchStructure], *, forces: bool = True, stress: bool = False,
                 per_atom: bool = False, keys: Sequence[Hashable] | None = None) -> list[tuple]:
        """(energy, forces, virial, per-atom energies) of each structure, in the order given, on the host as
        ``Potential.evaluate`` gives them (None where not asked for); ``keys``: a name of each structure that stays
        the same from call to call (its neighbour list is then kept wherever it sits in the batch)."""
        if len(structures) == 0:
            raise ValueError("structures: expected at least one structure, got none")
        for index, structure in enumerate(structures):
            check_shapes(index, structure)
        device, dtype = self.adapter.device, self.adapter.dtype
        sizes = [len(s.numbers) for s in structures]
        ptr = np.concatenate([[0], np.cumsum(sizes)]).tolist()
        pbcs = [tuple(bool(p) for p in s.pbc) for s in structures]
        positions_host = np.concatenate([np.asarray(s.positions, dtype=np.float64) for s in structures])
        cells_host = np.stack([np.asarray(s.cell, dtype=np.float64) for s in structures])
        check_finite(positions_host, cells_host, ptr)
        species = self.species(np.concatenate([np.asarray(s.numbers) for s in structures]), ptr)
        positions = torch.as_tensor(positions_host, dtype=dtype, device=device)
        out = self.run(positions, cells_host, pbcs, ptr, species, forces=forces, stress=stress, per_atom=per_atom,
                       keys=keys)
        energies = out.energy.to("cpu", torch.float64).numpy()
        host = {name: None if t is None else t.detach().to("cpu", torch.float64).numpy()
                for name, t in (("forces", out.forces), ("virial", out.virial), ("energies", out.energies))}
        bad = ~np.isfinite(energies)
        for name, rows in (("forces", ptr[:-1]), ("virial", np.arange(len(structures))), ("energies", ptr[:-1])):
            if host[name] is not None:  # per structure: any of its rows (atoms, or its virial) not finite
                not_finite = ~np.isfinite(host[name]).reshape(len(host[name]), -1).all(1)
                bad |= np.add.reduceat(not_finite.astype(np.int64), rows) > 0
        if bad.any():
            raise non_finite(int(np.argmax(bad)))

        def part(name: str, rows: slice | int) -> np.ndarray | None:
            return None if host[name] is None else host[name][rows].copy()

        return [(float(energies[b]), part("forces", slice(s, e)), part("virial", b), part("energies", slice(s, e)))
                for b, (s, e) in enumerate(zip(ptr[:-1], ptr[1:]))]

    def run(self, positions: Tensor, cells_host: np.ndarray, pbcs: Sequence[Pbc], ptr: Sequence[int], species: Tensor,
            *, forces: bool = True, stress: bool = False, per_atom: bool = False,
            keys: Sequence[Hashable] | None = None) -> StepOutput:
        """The batch on the device (positions [N, 3] on the model's device, host cells [B, 3, 3], pbcs, ptr, the
        species input): a ``StepOutput`` of device tensors (energy [B], virial [B, 3, 3]), not checked for NaN."""
        device, dtype = self.adapter.device, self.adapter.dtype
        n = ptr[-1]
        positions = positions.detach().to(dtype)
        cells = torch.as_tensor(cells_host, dtype=dtype, device=device)
        structure = torch.repeat_interleave(torch.arange(len(pbcs), device=device),
                                            torch.as_tensor(np.diff(np.asarray(ptr)), device=device))
        nl = self.neighbours
        nl.update(positions, cells_host, pbcs, ptr, keys)
        shifts = nl.shifts.to(dtype)
        with torch.no_grad():
            lengths = pair_lengths(positions, cells, structure, nl.sender, nl.receiver, shifts)
        self.check_distances(lengths, structure.index_select(0, nl.receiver), nl.sender, nl.receiver, ptr)
        keep = lengths < self.cutoff
        if nl.topology is not None:
            keep = keep & keep.index_select(0, nl.topology.reverse)
        count = int(keep.sum())
        layout = layout_edges(keep, nl.sender, nl.receiver, shifts, n, count, self.pad_vector,
                              with_graph=bool(self.caches), topology=nl.topology)
        self.n_edges = count
        key = (bool(forces or stress), bool(stress), bool(per_atom))
        try:
            return self.derivatives(layout, positions, cells, structure, species, self.groups(species), key)
        finally:
            self.unpin()

    def groups(self, species: Tensor) -> SpeciesGroups | None:
        """The atoms grouped by species for the model's per-species layers (one host read; None: no caches)."""
        return SpeciesGroups.from_species(self.adapter.species_index(species)) if self.caches else None

    def derivatives(self, layout: EdgeLayout, positions: Tensor, cells: Tensor, structure: Tensor, species: Tensor,
                    groups: SpeciesGroups | None, key: tuple[bool, bool, bool]) -> StepOutput:
        """``graph_derivatives`` of the batch laid out in ``layout`` (capture-safe: no host reads)."""
        return graph_derivatives(self.adapter, self.caches, layout, positions.shape[0], positions, cells,
                                 lambda p, v, e, atoms: self.adapter.energy(p, v, species, e, atoms), key,
                                 groups=groups, structure=structure)

    def unpin(self) -> None:
        """Release the edge graph pinned in the model's caches (the potential's own step pins its graph again)."""
        for cache in self.caches:
            cache.unpin()

    def check_distances(self, lengths: Tensor, edge_structure: Tensor, sender: Tensor, receiver: Tensor,
                        ptr: Sequence[int]) -> None:
        """Two atoms of one structure closer than ``min_distance`` (an atom and its own image too) raise."""
        if self.min_distance is None or lengths.numel() == 0:
            return
        close = torch.nonzero(lengths < self.min_distance).squeeze(1)
        if close.numel() == 0:
            return
        first = int(close[torch.argmin(edge_structure.index_select(0, close))])
        b = int(edge_structure[first])
        i, j = int(sender[first]) - ptr[b], int(receiver[first]) - ptr[b]
        raise BatchStructureError(b, f"atoms {min(i, j)} and {max(i, j)} are {float(lengths[first]):.3g} Å apart, "
                                     f"closer than min_distance={self.min_distance} Å (overlapping atoms)")
