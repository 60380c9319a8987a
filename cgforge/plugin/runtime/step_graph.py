"""One model step (energy, forces, stress) on static device buffers, optionally captured in a CUDA graph.

Per call: positions in, the Verlet list's staleness (one host sync), the step, results out (with the edge
count). Edges are the Verlet list cut to the cutoff on the device and laid out in padded slots
(``edge_layout``); forces and virial come from autograd (``graph_derivatives``). With ``cuda_graph`` the step is
captured once per (capacities, properties) and replayed; a step whose edges overflowed is run again with more
room. Padding needs ``inert_beyond_cutoff``; without it the step runs eagerly with exact edge counts.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor
from torch.profiler import record_function

from cgforge.kernels.edge_layout import (
    EdgeLayout,
    EdgeTopology,
    conv_graph,
    edge_topology,
    edges_within,
    layout_edges,
    layout_within,
    pad_offset_vector,
)
from cgforge.kernels.segment_sum import segment_sum
from cgforge.patches.graph_cache import graph_caches
from cgforge.patches.species_linear import SpeciesGroups

from .adapters import ModelAdapter
from .capture import capture_or_fall_back, room
from .compiled import CompiledEnergy
from .edge_vectors import edge_differences, rows_times
from .neighbours import VerletNeighbourList

Phase = Callable[[str], AbstractContextManager]
MAX_GROW_MARGIN = 0.08  # the most room an overflow leaves: padding edges are computed like real ones
LIST_ROOM = 0.04  # the least room the Verlet list's buffers keep: padding pairs are cheap, recaptures are not


class PreparedList(NamedTuple):
    """What loading a searched Verlet list needs, made ahead on the search's stream (``ModelStep.list_topology``):
    the list buffers' capacity, its topology, and (padded, filtering) its pairs within the cutoff at the positions
    it was searched for, which refit the model-edge capacity (read there, so that loading it reads nothing)."""

    capacity: int
    topology: EdgeTopology | None
    within: int | None


def _no_phase(name: str) -> AbstractContextManager:
    return nullcontext()


@dataclass
class StepOutput:
    """One step's results on the device: energy [] ([B] for a batch), forces [N, 3], virial [3, 3] ([B, 3, 3]) =
    sym(dE/d strain), energies [N] (each None when not asked for) and count [] int64: the edges laid out within
    the cutoff (more than ``ModelStep.capacity`` when padded: the layout overflowed, the step is invalid)."""

    energy: Tensor
    forces: Tensor | None
    virial: Tensor | None
    energies: Tensor | None
    count: Tensor


EnergyFn = Callable[[Tensor, Tensor, Tensor, bool], tuple[Tensor, Tensor | None]]


def graph_derivatives(adapter: ModelAdapter, caches: list, layout: EdgeLayout, num_nodes: int, pos: Tensor,
                      cell: Tensor, energy_fn: EnergyFn, key: tuple[bool, bool, bool], phase: Phase = _no_phase, *,
                      groups: SpeciesGroups | None = None, serve_pinned: bool = False,
                      weights: Tensor | None = None, structure: Tensor | None = None) -> StepOutput:
    """The energy of one laid-out graph and its derivatives (capture-safe: no host reads).

    ``energy_fn(positions, vectors, edge_index, per_atom)``: the model's energy; ``key`` = (forces, stress,
    per_atom). vectors = pos[receiver] - pos[sender] + S @ cell (+ the padding offset), strained by (I + strain)
    for the virial sym(dE/d strain); forces = -dE/dpos (``edge_vectors``). ``weights`` [N]: the energy is
    sum_i weights_i e_i instead (``runtime.tiled``). ``structure`` [N]: the structure of each atom of a batch
    (``runtime.batch``), with ``cell`` [B, 3, 3]; energy and virial are then per structure."""
    grad, stress, per_atom = key
    with phase("edges"), torch.no_grad(), record_function("cgforge.edge_layout"):
        edge_index = adapter.edge_index(layout.sender, layout.receiver)
        if caches:
            graph = conv_graph(layout, num_nodes)
            src, dst = edge_index[adapter.sender_row], edge_index[1 - adapter.sender_row]
            for cache in caches:
                cache.pin(src, dst, graph)
    with torch.set_grad_enabled(grad):
        pos = pos.detach().requires_grad_(grad)
        edge_structure = None if structure is None else structure.index_select(0, layout.receiver)
        with record_function("cgforge.edge_vectors"):  # the forces come back through CSR row sums
            vectors = (edge_differences(pos, layout.sender, layout.receiver, layout.graph)
                       + _times(layout.unit_shifts, cell, edge_structure) + layout.pad_offset)
        strain = None
        positions = pos
        if stress:
            # E(pos (I + eps), cell (I + eps)): every vector is strained alike; dE/d eps is the virial. In a batch
            # each structure has its own eps, so dE/d eps_b is structure b's virial.
            shape = (3, 3) if structure is None else (cell.shape[0], 3, 3)
            strain = torch.zeros(shape, dtype=pos.dtype, device=pos.device, requires_grad=True)
            deform = torch.eye(3, dtype=pos.dtype, device=pos.device) + strain
            if structure is None:
                vectors, positions = rows_times(vectors, deform), rows_times(pos, deform)
            else:
                vectors, positions = _times(vectors, deform, edge_structure), _times(pos, deform, structure)
        with phase("forward"), record_function("cgforge.model_forward"), ExitStack() as grouped:
            for cache in caches:
                grouped.enter_context(cache.use_species(groups))
                if serve_pinned:
                    grouped.enter_context(cache.serve_pinned())
            energy, energies = energy_fn(positions, vectors, edge_index,
                                         per_atom or weights is not None or structure is not None)
            if weights is not None:
                energy = (energies.reshape(-1) * weights).sum()
        total = energy.detach().reshape(())
        if structure is not None:
            total = _per_structure(energies.detach().reshape(-1), structure, cell.shape[0])
        out = StepOutput(energy=total, forces=None, virial=None, energies=None,
                         count=layout.count.reshape(()).to(torch.int64))
        if grad:
            with phase("backward"), record_function("cgforge.backward"):
                inputs = [pos] if strain is None else [pos, strain]
                grads = torch.autograd.grad(energy, inputs, allow_unused=True)
            out.forces = -(grads[0] if grads[0] is not None else torch.zeros_like(pos))
            if strain is not None:
                virial = grads[1] if grads[1] is not None else torch.zeros_like(strain)
                out.virial = 0.5 * (virial + virial.transpose(-1, -2))
        if per_atom:
            out.energies = energies.detach().reshape(-1)
    return out


def _per_structure(values: Tensor, structure: Tensor, count: int) -> Tensor:
    """[B] sums of per-atom ``values`` over each structure's atoms (``structure`` ascending), in a fixed order:
    the segment-sum kernel on CUDA (FP64 accumulation, no atomics), index_add (sequential) elsewhere."""
    if values.is_cuda:
        rowptr = torch.searchsorted(structure, torch.arange(count + 1, device=structure.device))
        return segment_sum(values.unsqueeze(1), rowptr).squeeze(1)
    return values.new_zeros(count).index_add_(0, structure, values)


def _times(rows: Tensor, matrix: Tensor, index: Tensor | None) -> Tensor:
    """rows @ matrix ([M, 3] x [3, 3]), or with ``index`` each row times its own matrix[index] ([B, 3, 3])."""
    return rows @ matrix if index is None else (rows.unsqueeze(1) @ matrix.index_select(0, index)).squeeze(1)


class ModelStep:
    """Energy (and forces, stress, per-atom energies) of one structure per ``run``; see the module doc.

    filter_edges: cut the Verlet list to the cutoff every step rather than feed the model all of it. padded:
    fixed capacities with padding edges (implied by ``cuda_graph``). margin: spare capacity (a fraction) of edge
    buffers. use_topology: lay edges out from the list's reverse edges (``EdgeTopology``); False sorts. compile:
    None or the Inductor mode (``compiled.MODES``, checked by the caller), with ``compile_backend``.
    """

    def __init__(self, adapter: ModelAdapter, neighbours: VerletNeighbourList, *, filter_edges: bool = True,
                 cuda_graph: bool = False, padded: bool | None = None, margin: float = 0.01,
                 compile: str | None = None, compile_backend: str | Callable = "inductor") -> None:
        self.adapter = adapter
        self.device, self.dtype = adapter.device, adapter.dtype
        self.neighbours = neighbours
        self.cutoff = float(adapter.cutoff)
        self.filter_edges = bool(filter_edges)
        self.cuda_graph = bool(cuda_graph)
        self.padded = self.cuda_graph if padded is None else bool(padded) or self.cuda_graph
        if not math.isfinite(margin) or margin < 0:
            raise ValueError(f"margin must be a finite number >= 0, got {margin!r}")
        self.margin = float(margin)
        self._grow_margin = self.margin  # the room the next overflow leaves (see _grown)
        self.use_topology = True
        self.caches = graph_caches(adapter.model)
        self.compile_backend = compile_backend
        self.compiled = None if compile is None else CompiledEnergy(adapter.energy, compile, compile_backend)
        self.pad_vector = pad_offset_vector(self.cutoff, self.dtype, self.device)
        self.phase: Phase = _no_phase
        self.n_edges = 0  # edges within the cutoff at the last step (all Verlet edges when not filtering)
        self.n_captures = 0
        self.generation = 0  # +1 at every invalidate(): graphs captured over these buffers (the MD engine's) are stale
        self.invalidations: Counter[str] = Counter()  # invalidate() calls by reason
        self.capture_error: str | None = None
        self._n: int | None = None
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self._pool = None
        self._capacity: int | None = None  # model edge slots (filtered, padded)
        self._verlet: tuple[Tensor, Tensor, Tensor, Tensor] | None = None  # sender, receiver, shifts, valid
        self._topology: EdgeTopology | None = None  # row pointers and reverse edges of the Verlet list
        self._layout: EdgeLayout | None = None  # the model layout of the whole Verlet list (not filtering)
        self._groups: SpeciesGroups | None = None  # atoms by species, for the per-species self-connections

    @property
    def capacity(self) -> int | None:
        """Model edge slots (including padding) of the current layout."""
        if not self.filter_edges:
            return None if self._layout is None else self._layout.capacity
        return self._capacity

    def set_compile(self, mode: str | None) -> None:
        """Compile the model's energy with this Inductor mode from the next step on (None: eager)."""
        self.compiled = None if mode is None else CompiledEnergy(self.adapter.energy, mode, self.compile_backend)
        self.invalidate("compile mode")

    @property
    def compile_error(self) -> str | None:
        """Why compilation failed (the step then runs the model eagerly), or None."""
        return None if self.compiled is None else self.compiled.error

    def invalidate(self, reason: str = "asked") -> None:
        """Drop every captured graph and the pinned edge graph (the next step pins a new one); ``invalidations``
        counts the reasons (each costs a recapture)."""
        self.invalidations[reason] += 1
        self._graphs.clear()
        self._pool = None
        self.generation += 1
        for cache in self.caches:
            cache.unpin()

    def run(self, positions: np.ndarray, cell: np.ndarray, pbc: tuple[bool, bool, bool], species: Tensor, *,
            forces: bool, stress: bool, per_atom: bool) -> np.ndarray:
        """[energy, forces (3N) if forces or stress, virial (9) if stress, per-atom energies (N) if per_atom]
        as float64 on the host. The virial is sym(dE/d strain) (stress = virial / volume)."""
        self._load_structure(positions, cell, species)
        self._refresh_list(pbc)
        key = (bool(forces or stress), bool(stress), bool(per_atom))
        while True:
            with self.phase("model") if self.cuda_graph else nullcontext():  # eager: edges/forward/backward
                out = self._execute(key)
            with self.phase("copy_out"):
                host = out.cpu().numpy()
            count = int(host[-1])
            if not (self.padded and self.filter_edges and count > self._capacity):
                break
            self.grow(count)  # overflow: the layout was not valid; again, with room
        self.n_edges = count
        return host[:-1]

    def prepare(self, positions: np.ndarray, cell: np.ndarray, pbc: tuple[bool, bool, bool], species: Tensor
                ) -> int:
        """Load a structure and bring its Verlet list up to date, as ``run`` begins (``run`` then finds it fresh);
        returns the number of edges the model will see (one host sync): what a memory plan needs to know."""
        self._load_structure(positions, cell, species)
        self._refresh_list(pbc)
        return self.edge_count()

    def edge_count(self) -> int:
        """Edges the model sees at the loaded positions with the loaded Verlet list (one host sync)."""
        if self._verlet is None:
            raise RuntimeError("edge_count: no Verlet list loaded yet (run, prepare or rebuild first)")
        if not self.filter_edges:
            return int(self.neighbours.sender.shape[0])
        with torch.no_grad():
            return int(self._keep().sum())

    def _refresh_list(self, pbc: tuple[bool, bool, bool]) -> None:
        """Rebuild the Verlet list when it is stale (one host sync) and load it into the static buffers."""
        with self.phase("neighbour_list"):
            rebuilt = self.neighbours.update(self.positions, self.cell, pbc)
            if rebuilt or self._verlet is None:
                self._load_verlet()

    def load(self, positions: Tensor, cell: Tensor, species: Tensor) -> None:
        """Copy device positions [N, 3] and cell [3, 3] into the static buffers (no host copy); new buffers
        (and no captured graph) when the atom count or species changed."""
        if positions.ndim != 2 or positions.shape[1] != 3 or tuple(cell.shape) != (3, 3):
            raise ValueError(f"positions must be [N, 3] and cell [3, 3], got {tuple(positions.shape)} and "
                             f"{tuple(cell.shape)}")
        self._ensure_structure(int(positions.shape[0]), species)
        self.positions.copy_(positions)
        self.cell.copy_(cell)
        self._host_cell = None  # the host path compares against the last host cell: it no longer holds

    def rebuild(self, pbc: tuple[bool, bool, bool]) -> None:
        """Rebuild the Verlet list at the positions and cell in the buffers now, and load it (host syncs)."""
        self.neighbours.rebuild(self.positions, self.cell, pbc)
        self._load_verlet()

    def install_list(self, positions: Tensor, cell: Tensor, pbc: tuple[bool, bool, bool],
                     lists: tuple[Tensor, Tensor, Tensor], topology: PreparedList | None = None) -> None:
        """Load a Verlet list found at ``positions`` and ``cell`` (not the buffers', which stay as they are), with
        its ``list_topology`` when that was made."""
        self.neighbours.install(positions, cell, pbc, lists)
        self._load_verlet(topology)

    def list_topology(self, lists: tuple[Tensor, Tensor, Tensor], positions: Tensor | None = None,
                      cell: Tensor | None = None) -> PreparedList:
        """What loading ``lists`` (found at ``positions`` and ``cell``, model dtype) needs, made ahead: its sort and
        host reads can run on another stream while the current list is still in use; nothing of the step changes."""
        sender, receiver, shifts = lists
        capacity, _ = self._list_capacity(sender.shape[0])
        topology = edge_topology(sender, receiver, shifts, self._n, capacity) if self.use_topology else None
        within = None
        if self.padded and self.filter_edges and positions is not None:
            within = int(edges_within(positions, cell, sender, receiver, shifts, self.cutoff)[2].sum())
        return PreparedList(capacity, topology, within)

    def keeps_list_capacity(self, capacity: int) -> bool:
        """Whether loading a list made for ``capacity`` (``list_topology``'s first value) keeps the Verlet buffers."""
        return self._verlet is not None and self._verlet[0].shape[0] == capacity

    def grow(self, count: int) -> None:
        """Room for ``count`` model edges (after a step whose edge count exceeded the capacity)."""
        if self.padded and self.filter_edges and count > self._capacity:
            self._capacity = self._grown(count)
            self.invalidate("model edges overflowed")

    def compute(self, *, forces: bool, stress: bool = False, per_atom: bool = False) -> StepOutput:
        """One step on the buffers as they are, eagerly (capture-safe when padded: no host reads), for callers
        that capture it themselves. Results in the model's dtype, count as int64."""
        return self._compute_parts((bool(forces or stress), bool(stress), bool(per_atom)), _no_phase)

    def _load_structure(self, positions: np.ndarray, cell: np.ndarray, species: Tensor) -> None:
        self._ensure_structure(int(positions.shape[0]), species)
        self._host_pos.numpy()[:] = positions
        self.positions.copy_(self._host_pos, non_blocking=True)  # the step's syncs order the next overwrite
        if self._host_cell is None or not np.array_equal(self._host_cell, cell):
            self._host_cell = np.array(cell, dtype=np.float64)
            self.cell.copy_(torch.as_tensor(self._host_cell, dtype=self.dtype))

    def _ensure_structure(self, n: int, species: Tensor) -> None:
        if n != self._n:
            self.invalidate("atom count")
            self._n = n
            # the static buffers (model dtype) that ``compute`` reads: written in place
            self.positions = torch.zeros(n, 3, dtype=self.dtype, device=self.device)
            self.cell = torch.zeros(3, 3, dtype=self.dtype, device=self.device)
            self._host_cell = self._verlet = self._topology = self._layout = self._capacity = None
            self._species = species.clone()
            self._species_source = species
            self._groups = self._species_groups()
            self._host_pos = torch.zeros(n, 3, dtype=self.dtype, pin_memory=self.device.type == "cuda")
        if species is not self._species_source:
            if species.shape != self._species.shape or species.dtype != self._species.dtype:
                raise ValueError(f"species: expected shape {tuple(self._species.shape)} for {n} atoms, got "
                                 f"{tuple(species.shape)}")
            same = bool(torch.equal(species.to(self._species.device), self._species))  # another tensor, same values
            self._species_source = species
            if not same:
                self._species.copy_(species)
                self.invalidate("species groups")  # a capture holds the species groups as they were
                self._groups = self._species_groups()

    def _species_groups(self) -> SpeciesGroups | None:
        # the model's node attributes are a function of the species index (the adapter builds them)
        return SpeciesGroups.from_species(self.adapter.species_index(self._species)) if self.caches else None

    def _fit(self, current: int | None, needed: int) -> int:
        """Capacity for `needed` edges: kept while it fits and is not far too large; grown with room when outgrown;
        else needed + margin."""
        if not self.padded:
            return needed
        if current is not None and needed <= current <= needed * (1 + 4 * max(self.margin, self._grow_margin)) + 256:
            return current
        if current is not None and needed > current:
            return self._grown(needed)  # outgrown at a rebuild (a compressing NPT box): with room, as an overflow
        return room(needed, self.margin)

    def _grown(self, count: int) -> int:
        """Model-edge capacity after ``count`` edges overflowed it. Each growth doubles the room it leaves (from
        ``margin`` up to ``MAX_GROW_MARGIN``; the Verlet list's buffers share it), and ``_fit`` keeps that room: a box
        whose edge count drifts up stops overflowing (and recapturing) after a few growths."""
        self._grow_margin = self._next_room()
        return room(count, self._grow_margin)

    def _next_room(self) -> float:
        return min(max(2 * self._grow_margin, self.margin), MAX_GROW_MARGIN)

    def _list_capacity(self, count: int) -> tuple[int, float]:
        """(capacity, room after) of the Verlet list's buffers for ``count`` pairs (at least ``LIST_ROOM`` to spare;
        grown with room when outgrown, as the model edges); nothing changes until ``_load_verlet``."""
        current = None if self._verlet is None else self._verlet[0].shape[0]
        if not self.padded:
            return count, self._grow_margin
        spare = max(self._grow_margin, LIST_ROOM)
        if current is not None and count <= current <= count * (1 + 4 * spare) + 256:
            return current, self._grow_margin
        if current is not None and count > current:
            grown = self._next_room()
            return room(count, max(grown, LIST_ROOM)), grown
        return room(count, spare), self._grow_margin

    def _load_verlet(self, prepared: PreparedList | None = None) -> None:
        """Copy a freshly built Verlet list into the static buffers (and lay it out when not filtering);
        ``prepared``: ``list_topology`` of it, used when made for the capacity chosen now."""
        nl = self.neighbours
        count = nl.sender.shape[0]
        old = self._verlet
        capacity, self._grow_margin = self._list_capacity(count)
        if prepared is not None and prepared.capacity != capacity:
            prepared = None
        if old is None or old[0].shape[0] != capacity:
            self.invalidate("Verlet list capacity")
            kw = {"dtype": torch.int64, "device": self.device}
            old = (torch.zeros(capacity, **kw), torch.zeros(capacity, **kw),
                   torch.zeros(capacity, 3, dtype=self.dtype, device=self.device),
                   torch.zeros(capacity, dtype=torch.bool, device=self.device))
            self._verlet = old
        sender, receiver, shifts, valid = old
        for buf, src in ((sender, nl.sender), (receiver, nl.receiver), (shifts, nl.shifts)):
            buf[:count].copy_(src)
            buf[count:].zero_()  # padding entries: (0, 0, 0), never kept (valid is False)
        valid.copy_(torch.arange(capacity, device=self.device) < count)
        self._load_topology(capacity, prepared)
        # The list lives on in the static buffers (its own tensors go: 40 bytes a pair; shifts as exact floats).
        nl.sender, nl.receiver, nl.shifts = sender[:count], receiver[:count], shifts[:count]
        with torch.no_grad():
            if not self.filter_edges:
                layout = layout_edges(valid, sender, receiver, shifts, self._n, self._fit(
                    None if self._layout is None else self._layout.capacity, count), self.pad_vector,
                    with_graph=bool(self.caches), topology=self._topology)
                if self._layout is not None and self._layout.capacity == layout.capacity:
                    self._layout.copy_(layout)
                else:
                    self.invalidate("Verlet list capacity")
                    self._layout = layout
            elif self.padded:
                # a rebuild syncs anyway; a list searched ahead counted its pairs within where it was found
                within = prepared.within if prepared is not None and prepared.within is not None else int(
                    self._keep().sum())
                capacity = self._fit(self._capacity, within)
                if capacity != self._capacity:
                    self.invalidate("model edge capacity refit")
                    self._capacity = capacity

    def _load_topology(self, capacity: int, prepared: PreparedList | None = None) -> None:
        """The Verlet list's row pointers and reverse edges, into static buffers (a capture reads them)."""
        nl = self.neighbours
        topology = (prepared.topology if prepared is not None else
                    edge_topology(nl.sender, nl.receiver, nl.shifts, self._n, capacity) if self.use_topology else None)
        if topology is None or self._topology is None:
            if (topology is None) != (self._topology is None):
                self.invalidate("edge topology path")  # the other layout path from now on
            self._topology = topology
            return
        try:
            self._topology.copy_(topology)
        except ValueError:  # another list capacity
            self.invalidate("Verlet list capacity")
            self._topology = topology

    def _keep(self) -> Tensor:
        sender, receiver, shifts, valid = self._verlet
        _, _, inside = edges_within(self.positions, self.cell, sender, receiver, shifts, self.cutoff)
        return inside & valid

    def _step_layout(self) -> EdgeLayout:
        if not self.filter_edges:
            return self._layout
        sender, receiver, shifts, valid = self._verlet
        if self.padded:
            return layout_within(self.positions, self.cell, sender, receiver, shifts, valid, self.cutoff, self._n,
                                 self._capacity, self.pad_vector, bool(self.caches), self._topology)
        # eager: exact, one sync; counted as layout_edges keeps them (with their reverses)
        keep = self._keep()
        if self._topology is not None:
            keep = keep & keep.index_select(0, self._topology.reverse)
        return layout_edges(keep, sender, receiver, shifts, self._n, int(keep.sum()), self.pad_vector,
                            with_graph=bool(self.caches), topology=self._topology)

    def _compute(self, key: tuple[bool, bool, bool], phase: Phase) -> Tensor:
        """The step's results in one float64 tensor: energy, forces, virial, per-atom energies, edge count."""
        out = self._compute_parts(key, phase)
        parts = [out.energy.reshape(1)]
        parts += [t.reshape(-1) for t in (out.forces, out.virial, out.energies) if t is not None]
        parts.append(out.count.reshape(1))
        return torch.cat([p.to(torch.float64) for p in parts])

    def _compute_parts(self, key: tuple[bool, bool, bool], phase: Phase) -> StepOutput:
        with record_function("cgforge.step"):  # profiler markers, host-side only: harmless inside a capture
            with phase("edges"), torch.no_grad(), record_function("cgforge.edge_layout"):
                layout = self._step_layout()
            return graph_derivatives(self.adapter, self.caches, layout, self._n, self.positions, self.cell,
                                     lambda p, v, e, per_atom: self._energy(p, v, e, layout, per_atom), key, phase,
                                     groups=self._groups, serve_pinned=self.compiled is not None)

    def _energy(self, positions: Tensor, vectors: Tensor, edge_index: Tensor, layout: EdgeLayout,
                per_atom: bool) -> tuple[Tensor, Tensor | None]:
        if self.compiled is None:
            return self.adapter.energy(positions, vectors, self._species, edge_index, per_atom)
        # The edge count is symbolic from the first compilation: no recompilation at a capacity change mid-run.
        g = layout.graph
        dynamic = () if g is None else (g.sender, g.receiver, g.perm_t)
        return self.compiled(positions, vectors, self._species, edge_index, per_atom, edges_dynamic=dynamic)

    def _execute(self, key: tuple[bool, bool, bool]) -> Tensor:
        if not self.cuda_graph:
            return self._compute(key, self.phase)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._capture(key)
            if entry is None:  # capture failed: run eagerly from now on (the reason is kept)
                return self._compute(key, self.phase)
        graph, out = entry
        graph.replay()
        return out

    def _capture(self, key: tuple[bool, bool, bool]) -> tuple[torch.cuda.CUDAGraph, Tensor] | None:
        if self._pool is None:
            # one pool for all keys: a step's output is read right after its replay, before another reuses it
            self._pool = torch.cuda.graph_pool_handle()
        entry = capture_or_fall_back(self, lambda: self._compute(key, _no_phase), self._pool, "the model step")
        if entry is not None:
            self._graphs[key] = entry
            self.n_captures += 1
        return entry
