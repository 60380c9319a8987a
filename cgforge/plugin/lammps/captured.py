"""The padded LAMMPS step: each call's pair list on static buffers, laid out without a sort, captured on CUDA.

``PaddedStep.run(data)`` does one ``compute_forces`` in ghost-neighbour mode, or in exchange mode on a domain whose
ghosts are all images of its local atoms (``owners``). The host grows the buffers (a growth drops the captured
graph), copies LAMMPS's arrays in as they are and the call's counts in one copy; the step, which reads nothing
back, maps each atom to its node (exchange mode: its owner, a local atom; ghost mode: its place in the listed atoms'
receptive field, ``receptive``'s cut made on the device: the pairs centred within layers - 1 hops of a listed atom
and the atoms they touch, the other pairs' ``fij`` exactly zero), checks a kept owners' map against the positions
(``owners.displaced``), lays the pairs out as edges ``pair_j -> pair_i`` in their
own order (``layout_listed``: padding self-edges beyond the cutoff, the model must be ``inert_beyond_cutoff``), pins a
``ConvGraph.trusted`` without a sort (LAMMPS lists pairs by ascending centre; a device flag says when not, and the
caller then runs eagerly), groups the species in fixed rooms (``Potential.species_room``; an overflow runs again
with more) and returns per-atom energies, ``fij = dE/drij`` and one status row the host reads in one copy.

Capacities: padding pairs are computed like real ones, so the pairs' room starts small and doubles at each growth
(``PAIR_MARGIN`` to ``MAX_PAIR_MARGIN``, the engine's rule); exchange mode's nodes, listed atoms and species rooms
are the local atoms' own counts (fixed while no atom is lost); ghost mode's, which change at every
re-neighbouring, get ``MARGIN``. Ghost mode's receptive field is sized from the last call's (the first call runs on
every pair and atom): a call whose field outgrows its room runs again with more, a field far smaller than its room
gets a smaller one at the next call.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from cgforge.plugin.runtime.capture import conv_graph, layout_listed, pad_offset_vector, replay_or_capture, room

from .arrays import LammpsArrays, write_results
from .exchange import GhostMap
from .owners import TOLERANCE, OwnerCheck, displaced
from .receptive import field_masks
from .timers import OFF

if TYPE_CHECKING:
    from cgforge.plugin.runtime.potential import Potential

__all__ = ["PaddedStep", "STALE", "UNSORTED"]

MARGIN = 0.1  # spare capacity of counts that change at every re-neighbouring (ghost mode's atoms, all atoms)
PAIR_MARGIN = 0.02  # the pairs' first room; each growth doubles it up to MAX_PAIR_MARGIN
MAX_PAIR_MARGIN = 0.08
UNSORTED = "LAMMPS's pairs are not in ascending centre order"  # ``PaddedStep.run``'s reasons for writing nothing
STALE = "the ghosts' owners given are stale"
_STATUS = 5  # the status row's entries before the species counts: energy, unsorted, stale, edges, nodes
_COUNTS = ("npairs", "nodes", "nlist", "ntotal", "check")  # the call's counts, one int64 row on the device


@dataclass
class _Buffers:
    """The step's static inputs: LAMMPS's arrays as given (entries past the counts: earlier calls', in range)."""

    pair_i: Tensor  # int64 [P]: the centres (receivers)
    pair_j: Tensor  # int64 [P]: the neighbours (atoms; their nodes are ``node_of[pair_j]``)
    rij: Tensor  # [P, 3] model dtype
    elems: Tensor  # int64 [T]: each atom's element
    listed: Tensor  # int64 [L]
    node_of: Tensor  # int64 [T]: each atom's node (exchange mode: its owner; ghost mode: itself, or the field's)
    x: Tensor  # float64 [T, 3]: the positions a kept owners' map is checked against
    shift: Tensor  # float64 [T, 3]: each atom's shift from its owner when the map was found
    counts: Tensor  # int64 [len(_COUNTS)]
    positions: Tensor  # zeros [N, 3]: the model's N node rows (the adapters take positions for their shape)
    edges: int  # E: the layout's slots

    @property
    def capacities(self) -> tuple[int, int, int]:
        return self.pair_i.shape[0], self.positions.shape[0], self.listed.shape[0]

    @property
    def atoms(self) -> int:
        return self.node_of.shape[0]


@dataclass
class _Outputs:
    fij: Tensor  # [P, 3] float64: dE/drij (rows past npairs: anything; pairs out of the field: zero)
    eatoms: Tensor  # [L] float64 (entries past nlistatoms: zero)
    status: Tensor  # float64 [_STATUS + n_species]: energy, receivers-not-ascending flag, stale-owners flag, the
    # edges and nodes the model ran on, species counts


class PaddedStep:
    """One ``compute_forces`` on static buffers (module doc), captured in a CUDA graph when ``cuda_graph`` (the
    potential's, by the runtime's rule), else run eagerly on the same buffers (CPU tests run it).

    ``capture_error`` says why a capture failed; ``n_captures`` counts captures, ``n_growths`` growths of the buffers
    or species rooms; ``timers`` times each call's phases (``timers.PhaseTimers``; ``OFF``: not); ``last_field``,
    after a ghost-mode call of a model of two layers or more, ((nodes, edges) the model ran on, (atoms, pairs)
    LAMMPS gave), else None.
    """

    def __init__(self, potential: Potential, *, cuda_graph: bool) -> None:
        adapter = potential.adapter
        reason = potential.inert_edges_reason
        if reason is not None:
            raise ValueError("the padded step pads the edges, which needs a model whose edges beyond the cutoff "
                             f"contribute zero; for this one that is not known: {reason}")
        self.potential, self.adapter, self.caches = potential, adapter, list(potential.graph_caches)
        self.layers = len(adapter.message_layers())
        self.cuda_graph = bool(cuda_graph)
        self.capture_error: str | None = None
        self.n_captures = self.n_growths = 0
        self.last_field: tuple[tuple[int, int], tuple[int, int]] | None = None
        self.pad_vector = pad_offset_vector(adapter.cutoff, adapter.dtype, adapter.device)
        self._buf: _Buffers | None = None
        self._room: Any = None  # ``Potential.species_room``: fixed rooms per species
        self._graph: torch.cuda.CUDAGraph | None = None
        self._out: _Outputs | None = None
        self._pool = None
        self._pair_margin = PAIR_MARGIN
        self._field = False  # ghost mode's receptive field cut on the device (a constant of the capture)
        self._loaded: tuple[Any, Any] = (None, None)  # the (node map, shifts) in the buffers now
        self._tolerance = TOLERANCE  # the owners' check's (``OwnerCheck.tolerance``), a constant of the capture
        self._host_counts = torch.zeros(len(_COUNTS), dtype=torch.int64, pin_memory=self.device.type == "cuda")
        self.timers: Any = OFF

    @property
    def device(self) -> torch.device:
        return self.adapter.device

    @property
    def capacities(self) -> tuple[int, int, int] | None:
        """(pairs, nodes, listed atoms) the buffers hold now, or None before the first call."""
        return None if self._buf is None else self._buf.capacities

    def invalidate(self) -> None:
        """Drop the captured graph (the next call captures again) and the graph pinned from its pool."""
        self._graph = self._out = None
        self._pool = None
        for cache in self.caches:
            cache.unpin()

    # --- the call ------------------------------------------------------------------------------------

    def run(self, data: Any, arrays: LammpsArrays, ghosts: GhostMap | None = None,
            check: OwnerCheck | None = None) -> str | None:
        """One call into ``data`` (``arrays``: ``lammps_arrays``, at least one listed atom): ghost-neighbour mode, or
        with ``ghosts`` (a one-domain map: every ghost an image of a local atom) one-rank exchange mode; ``check``:
        the kept map's check, made inside the step. None when the results were written; else nothing was:
        ``UNSORTED`` (run the call another way) or ``STALE`` (run it again on owners found afresh)."""
        exchange = ghosts is not None
        field = not exchange and self.layers > 1
        if field != self._field:  # another graph: the field's cut is in it or not
            self._field = field
            self._buf = None
            self.invalidate()
        nodes = arrays.nlocal if exchange else arrays.ntotal
        timers = self.timers
        with timers.phase("arrays"):
            self._fit(arrays, nodes, exchange)
            self._load(arrays, nodes, ghosts, check)
        while True:
            with timers.phase("model"):
                out = self._execute()
            with timers.wait():
                status = out.status.cpu()  # one sync: the energy and the checks
            if status[2] != 0:
                return STALE
            if status[1] != 0:
                return UNSORTED
            edges, field_nodes = int(status[3]), int(status[4])
            counts = [int(c) for c in status[_STATUS:].tolist()]
            if edges > self._buf.edges or field_nodes > self._buf.positions.shape[0]:  # the field outgrew its room
                self._resize(edges, field_nodes, counts, grow=True)
                continue
            if self._room is None or self._room.fits(counts):
                break
            # some species overflowed its room: again, with more
            self._room = self.potential.species_room([self._grown(c, r, MARGIN)
                                                      for c, r in zip(counts, self._room.capacities)])
            self.n_growths += 1
            self.invalidate()
        with timers.phase("forces"):
            write_results(data, out.eatoms[:arrays.nlist], status[0], out.fij[:arrays.npairs], timers)
        self.last_field = ((field_nodes, edges), (arrays.ntotal, arrays.npairs)) if field else None
        if field and (self._buf.edges > 1.5 * edges + 256 or self._buf.positions.shape[0] > 1.5 * field_nodes + 256):
            self._resize(edges, field_nodes, counts, grow=False)  # far more room than the field: less, next call
        return None

    @staticmethod
    def _grown(count: int, current: int, margin: float | None) -> int:
        """``current`` while ``count`` fits; else room for ``count`` with ``margin`` to spare (None: exactly)."""
        if count <= current:
            return current
        return count if margin is None else room(count, margin)

    def _fit(self, a: LammpsArrays, nodes: int, exchange: bool) -> None:
        """New buffers when a count exceeds its capacity (and species rooms at the first call): module doc."""
        wanted = (a.npairs, max(a.ntotal, 1), a.nlist)
        old = None if self._buf is None else (self._buf.capacities[0], self._buf.atoms, self._buf.capacities[2])
        if old is not None:
            if all(n <= c for n, c in zip(wanted, old)) and (self._field or nodes <= self._buf.capacities[1]):
                return
            self.n_growths += 1
            if a.npairs > old[0]:  # the pairs outgrew their room: leave more next time
                self._pair_margin = min(2 * self._pair_margin, MAX_PAIR_MARGIN)
        local = None if exchange else MARGIN  # exchange mode: the local atoms' counts exactly
        p, t, listed = (self._grown(w, c, m) for w, c, m in zip(wanted, old or (0, 0, 0),
                                                                  (self._pair_margin, MARGIN, local)))
        if self._field and self._buf is not None:  # the field's rooms stay (they follow the field)
            n, edges = self._buf.positions.shape[0], self._buf.edges
        else:  # every pair an edge; the nodes: the local atoms (exchange), or every atom
            n, edges = (self._grown(nodes, 0 if self._buf is None else self._buf.capacities[1], None) if exchange
                        else t), p
        dev, dt = self.device, self.adapter.dtype
        ints, f64 = {"dtype": torch.int64, "device": dev}, {"dtype": torch.float64, "device": dev}
        self._buf = _Buffers(torch.zeros(p, **ints), torch.zeros(p, **ints), torch.zeros(p, 3, dtype=dt, device=dev),
                             torch.zeros(t, **ints), torch.zeros(listed, **ints), torch.zeros(t, **ints),
                             torch.zeros(t, 3, **f64), torch.zeros(t, 3, **f64), torch.zeros(len(_COUNTS), **ints),
                             torch.zeros(n, 3, dtype=dt, device=dev), edges)
        self._loaded = (None, None)
        if self.caches and self._room is None:
            # the first call: rooms from its counts (one host read, outside any step)
            counts = torch.bincount(a.elems[:nodes].to(torch.int64).clamp(min=0), minlength=self.adapter.n_species)
            self._room = self.potential.species_room([self._grown(int(c), 0, local) if c else 0
                                                      for c in counts.tolist()])
        # the widest rows in chunks where this many nodes need it (as the calculator plans them), before a capture
        self.adapter.set_row_chunks(n)
        self.invalidate()

    def _resize(self, edges: int, nodes: int, counts: list[int], grow: bool) -> None:
        """Ghost mode's field rooms for ``edges`` and ``nodes`` (and its species ``counts``): grown for a call that
        outgrew them (run again), or made smaller for the next call."""
        b = self._buf
        if grow and edges > b.edges:
            self._pair_margin = min(2 * self._pair_margin, MAX_PAIR_MARGIN)
        n = room(nodes, MARGIN) if (not grow or nodes > b.positions.shape[0]) else b.positions.shape[0]
        b.edges = room(edges, self._pair_margin) if (not grow or edges > b.edges) else b.edges
        b.positions = torch.zeros(n, 3, dtype=b.positions.dtype, device=self.device)
        if self.caches and not grow:  # the rooms from the field's own species counts
            self._room = self.potential.species_room([room(c, MARGIN) if c else 0 for c in counts])
        self.n_growths += 1
        self.adapter.set_row_chunks(n)
        self.invalidate()

    def _load(self, a: LammpsArrays, nodes: int, ghosts: GhostMap | None, check: OwnerCheck | None) -> None:
        """LAMMPS's arrays into the buffers as they are (the step converts them), the node map and shifts when they
        changed, the counts in one copy."""
        b = self._buf
        b.pair_i[:a.npairs].copy_(a.pair_i[:a.npairs])
        b.pair_j[:a.npairs].copy_(a.pair_j[:a.npairs])
        b.rij[:a.npairs].copy_(a.rij[:a.npairs])
        b.elems[:a.ntotal].copy_(a.elems[:a.ntotal])
        b.listed[:a.nlist].copy_(a.iatoms[:a.nlist])
        node_map = "itself" if ghosts is None else ghosts
        if self._loaded[0] is not node_map:
            if ghosts is None:
                b.node_of.copy_(torch.arange(b.atoms, device=self.device))
            else:
                b.node_of[:a.ntotal].copy_(ghosts.node_of)
            self._loaded = (node_map, None)
        if check is not None:
            if check.tolerance != self._tolerance:
                self._tolerance = check.tolerance
                self.invalidate()
            b.x[:a.ntotal].copy_(check.x)
            if self._loaded[1] is not check.shift:
                b.shift[:a.ntotal].copy_(check.shift)
                self._loaded = (node_map, check.shift)
        host = self._host_counts
        for k, value in enumerate((a.npairs, nodes, a.nlist, a.ntotal, check is not None)):
            host[k] = int(value)
        b.counts.copy_(host, non_blocking=True)  # pinned: the last call's copy ended at its status read

    def _execute(self) -> _Outputs:
        return replay_or_capture(self, self._compute, "the LAMMPS step")

    # --- the step (capture-safe: no host reads) ----------------------------------------------------------

    def _receptive(self, valid: Tensor, nlist: Tensor, ntotal: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Ghost mode's receptive field (``receptive``'s, on the device): each atom's node (an atom left out: its
        predecessor's, for the rows), each node's atom, the pairs that are edges, and the field's atoms."""
        b, device = self._buf, self.device
        t, n = b.atoms, b.positions.shape[0]
        listed = torch.where(torch.arange(b.listed.shape[0], device=device) < nlist, b.listed, t)  # t: none
        edges, touched = field_masks(b.pair_i, b.pair_j, listed, t, self.layers, valid)
        touched = touched & (torch.arange(t, device=device) < ntotal)
        rank = torch.cumsum(touched, 0)
        node_of = (rank - 1).clamp(min=0, max=n - 1)  # past the room: the call runs again with more
        atom_of_node = torch.zeros(n + 1, dtype=torch.int64, device=device).index_copy_(
            0, torch.where(touched & (rank <= n), rank - 1, n), torch.arange(t, device=device))[:n]
        return node_of, atom_of_node, edges, rank[-1]

    def _compute(self) -> _Outputs:
        adapter, b, device = self.adapter, self._buf, self.device
        p, n, listed_cap = b.capacities
        npairs, nodes, nlist, ntotal, check = b.counts.unbind()
        with torch.no_grad():
            valid = torch.arange(p, device=device) < npairs
            unsorted = ((b.pair_i[1:] < b.pair_i[:-1]) & valid[1:]).any()
            # a kept owners' map (exchange mode) checked; ghost mode's field graph has none
            moved = (check != 0) if self._field else (check != 0) & displaced(b.x, b.node_of, b.shift,
                                                                              self._tolerance, ntotal)
            if self._field:
                node_of, atom_of_node, edges, nodes = self._receptive(valid, nlist, ntotal)
                atom_elems = b.elems.index_select(0, atom_of_node)
            else:  # node k is atom k
                node_of, edges, atom_elems = b.node_of, None, b.elems[:n]
            sender, receiver = node_of.index_select(0, b.pair_j), node_of.index_select(0, b.pair_i)
            # unsorted pairs would make rows that are no CSR (the kernels would read out of bounds): lay out none,
            # the call's results are not used
            laid = torch.where(unsorted, 0, npairs)
            layout = layout_listed(sender, receiver, -b.rij, laid, n, b.edges, self.pad_vector, bool(self.caches),
                                   edges)
            edge_index = adapter.edge_index(layout.sender, layout.receiver)
            if self.caches:
                graph = conv_graph(layout, n)
                src, dst = edge_index[adapter.sender_row], edge_index[1 - adapter.sender_row]
                for cache in self.caches:
                    cache.pin(src, dst, graph)
            # NULL types (-1) as 0, as the eager path reads them; padding nodes species 0
            elems = torch.where(torch.arange(n, device=device) < nodes, atom_elems, 0).clamp(min=0)
            species = adapter.species_from_index(elems)
            groups, counts = None, torch.zeros(0, dtype=torch.int64, device=device)
            if self._room is not None:
                groups, counts = self._room.groups(elems, nodes)
        with torch.enable_grad(), ExitStack() as stack:
            if groups is not None:
                for cache in self.caches:
                    stack.enter_context(cache.use_species(groups))
            vectors = (layout.unit_shifts + layout.pad_offset).requires_grad_(True)  # -rij, or the padding vector
            _, node_energy = adapter.energy(b.positions, vectors, species, edge_index, True)
            if node_energy is None:
                raise ValueError("model: it returns no per-atom energies, which LAMMPS needs (eatoms)")
            listed = torch.arange(listed_cap, device=device) < nlist
            eatoms = torch.where(listed, node_energy.reshape(-1).index_select(0, node_of.index_select(0, b.listed)),
                                 0.0)
            energy = eatoms.sum()
            grad = torch.autograd.grad(energy, vectors, allow_unused=True)[0]
        if grad is None:
            grad = torch.zeros_like(vectors)
        # dE/drij = -dE/dvector, from slots to pairs; a pair left out of the field (slot past the layout): zero
        slot = layout.slot
        fij = torch.where((slot < b.edges)[:, None], -grad.index_select(0, slot.clamp(max=b.edges - 1)), 0.0)
        status = torch.cat([energy.detach().reshape(1).to(torch.float64), unsorted.reshape(1).to(torch.float64),
                            moved.reshape(1).to(torch.float64), layout.count.reshape(1).to(torch.float64),
                            torch.as_tensor(nodes, device=device).reshape(1).to(torch.float64),
                            counts.to(torch.float64)])
        # float64, as LAMMPS takes them: no conversion on the host side of the call
        return _Outputs(fij.detach().to(torch.float64), eatoms.detach().to(torch.float64), status)
