"""The padded LAMMPS step: each call's pair list on static buffers, laid out without a sort, captured on CUDA.

``PaddedStep.run(data)`` does one ``compute_forces`` in ghost-neighbour mode, or in exchange mode on a domain whose
ghosts are all images of its local atoms (``owners``). The host grows the buffers (a growth drops the captured
graph) and copies LAMMPS's arrays in; the step, which reads nothing back, lays the pairs out as edges ``pair_j ->
pair_i`` in their own order (padding self-edges beyond the cutoff: the model must be ``inert_beyond_cutoff``), pins
a ``ConvGraph.trusted`` without a sort (LAMMPS lists pairs by ascending centre; a device flag says when not, and the
caller then runs eagerly), groups the species in fixed rooms (``Potential.species_room``; an overflow runs again
with more) and returns per-atom energies, ``fij = dE/drij`` and one status row the host reads in one copy.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from cgforge.plugin.runtime.capture import conv_graph, layout_edges, pad_offset_vector, replay_or_capture, room

from .arrays import LammpsArrays, write_results
from .timers import OFF

if TYPE_CHECKING:
    from cgforge.plugin.runtime.potential import Potential

__all__ = ["PaddedStep", "STALE", "UNSORTED"]

MARGIN = 0.1  # spare capacity given to every buffer when it grows (``room``)
UNSORTED = "LAMMPS's pairs are not in ascending centre order"  # ``PaddedStep.run``'s reasons for writing nothing
STALE = "the ghosts' owners given are stale"


@dataclass
class _Buffers:
    """The step's static inputs; the counts are device scalars refilled per call."""

    pair_i: Tensor  # int64 [P]
    pair_j: Tensor  # int64 [P]
    vectors: Tensor  # [P, 3] model dtype: -rij
    elems: Tensor  # int64 [N]
    listed: Tensor  # int64 [L]
    positions: Tensor  # zeros [N, 3] (the adapters take positions for their shape)
    npairs: Tensor  # int64 0-d
    nodes: Tensor  # ntotal, or nlocal with owners
    nlist: Tensor
    moved: Tensor  # bool 0-d: the owners given were stale (``owners.GhostMapCache``), the results are not written

    @property
    def capacities(self) -> tuple[int, int, int]:
        return self.pair_i.shape[0], self.elems.shape[0], self.listed.shape[0]


@dataclass
class _Outputs:
    fij: Tensor  # [P, 3] float64: dE/drij (rows past npairs: anything)
    eatoms: Tensor  # [L] float64 (entries past nlistatoms: zero)
    status: Tensor  # float64 [3 + n_species]: energy, receivers-not-ascending flag, stale-owners flag, species counts


class PaddedStep:
    """One ``compute_forces`` on static buffers (module doc), captured in a CUDA graph when ``cuda_graph`` (the
    potential's, by the runtime's rule), else run eagerly on the same buffers (CPU tests run it).

    ``capture_error`` says why a capture failed; ``n_captures`` counts captures, ``n_growths`` growths of the buffers
    or species rooms; ``timers`` times each call's phases (``timers.PhaseTimers``; ``OFF``: not).
    """

    def __init__(self, potential: Potential, *, cuda_graph: bool) -> None:
        adapter = potential.adapter
        reason = potential.inert_edges_reason
        if reason is not None:
            raise ValueError("the padded step pads the edges, which needs a model whose edges beyond the cutoff "
                             f"contribute zero; for this one that is not known: {reason}")
        self.potential, self.adapter, self.caches = potential, adapter, list(potential.graph_caches)
        self.cuda_graph = bool(cuda_graph)
        self.capture_error: str | None = None
        self.n_captures = self.n_growths = 0
        self.pad_vector = pad_offset_vector(adapter.cutoff, adapter.dtype, adapter.device)
        self._buf: _Buffers | None = None
        self._room: Any = None  # ``Potential.species_room``: fixed rooms per species
        self._graph: torch.cuda.CUDAGraph | None = None
        self._out: _Outputs | None = None
        self._pool = None
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

    def run(self, data: Any, arrays: LammpsArrays, owners: Tensor | None = None,
            moved: Tensor | None = None) -> str | None:
        """One call into ``data`` (``arrays``: ``lammps_arrays``, at least one listed atom): ghost-neighbour mode, or
        with ``owners`` ([ntotal] int64: the local atom each atom is an image of) one-domain exchange mode; ``moved``:
        a 0-d bool device tensor, True when ``owners`` are stale. None when the results were written; else nothing
        was: ``UNSORTED`` (run the call another way) or ``STALE`` (run it again on owners found afresh)."""
        nodes = arrays.ntotal if owners is None else arrays.nlocal
        timers = self.timers
        with timers.phase("arrays"):
            self._fit(arrays, nodes)
            self._load(arrays, nodes, owners, moved)
        while True:
            with timers.phase("model"):
                out = self._execute()
            with timers.wait():
                status = out.status.cpu()  # one sync: the energy and the checks
            if status[2] != 0:
                return STALE
            if status[1] != 0:
                return UNSORTED
            counts = [int(c) for c in status[3:].tolist()]
            if self._room is None or self._room.fits(counts):
                break
            # some species overflowed its room: again, with more
            self._room = self.potential.species_room([self._grown(c, r) for c, r in zip(counts, self._room.capacities)])
            self.n_growths += 1
            self.invalidate()
        with timers.phase("forces"):
            write_results(data, out.eatoms[:arrays.nlist], status[0], out.fij[:arrays.npairs], timers)
        return None

    def _grown(self, count: int, current: int) -> int:
        return current if count <= current else room(count, MARGIN)

    def _fit(self, a: LammpsArrays, nodes: int) -> None:
        """New buffers when a count exceeds its capacity (and species rooms at the first call)."""
        wanted = (a.npairs, max(nodes, 1), a.nlist)
        if self._buf is not None:
            if all(n <= c for n, c in zip(wanted, self._buf.capacities)):
                return
            self.n_growths += 1
        old = (0, 0, 0) if self._buf is None else self._buf.capacities
        p, n, listed = (self._grown(w, c) for w, c in zip(wanted, old))
        dev, dt = self.device, self.adapter.dtype
        kw = {"dtype": torch.int64, "device": dev}
        self._buf = _Buffers(torch.zeros(p, **kw), torch.zeros(p, **kw), torch.zeros(p, 3, dtype=dt, device=dev),
                             torch.zeros(n, **kw), torch.zeros(listed, **kw), torch.zeros(n, 3, dtype=dt, device=dev),
                             torch.zeros((), **kw), torch.zeros((), **kw), torch.zeros((), **kw),
                             torch.zeros((), dtype=torch.bool, device=dev))
        if self.caches and self._room is None:
            # the first call: rooms from its counts (one host read, outside any step)
            counts = torch.bincount(a.elems[:nodes].to(torch.int64).clamp(min=0), minlength=self.adapter.n_species)
            self._room = self.potential.species_room([room(int(c), MARGIN) if c else 0 for c in counts.tolist()])
        # the widest rows in chunks where this many nodes need it (as the calculator plans them), before a capture
        self.adapter.set_row_chunks(n)
        self.invalidate()

    def _load(self, a: LammpsArrays, nodes: int, owners: Tensor | None, moved: Tensor | None) -> None:
        """LAMMPS's arrays into the buffers (entries past the counts keep earlier values: in range, unused)."""
        b = self._buf
        b.pair_i[:a.npairs].copy_(a.pair_i[:a.npairs])
        if owners is None:
            b.pair_j[:a.npairs].copy_(a.pair_j[:a.npairs])
        else:  # a ghost neighbour is its owner, a local atom
            b.pair_j[:a.npairs].copy_(owners.index_select(0, a.pair_j[:a.npairs].to(owners.device, torch.int64)))
        b.vectors[:a.npairs].copy_(a.rij[:a.npairs])
        b.vectors[:a.npairs].neg_()  # pos[receiver] - pos[sender], receiver = pair_i
        b.elems[:nodes].copy_(a.elems[:nodes])
        b.elems[nodes:].zero_()  # padding nodes: species 0
        b.listed[:a.nlist].copy_(a.iatoms[:a.nlist])
        b.npairs.fill_(a.npairs)
        b.nodes.fill_(nodes)
        b.nlist.fill_(a.nlist)
        if moved is None:
            b.moved.fill_(False)
        else:
            b.moved.copy_(moved)  # on the device: no read here

    def _execute(self) -> _Outputs:
        return replay_or_capture(self, self._compute, "the LAMMPS step")

    # --- the step (capture-safe: no host reads) ----------------------------------------------------------

    def _compute(self) -> _Outputs:
        adapter, b = self.adapter, self._buf
        p, n, listed_cap = b.capacities
        with torch.no_grad():
            slots = torch.arange(p, device=self.device)
            keep = slots < b.npairs
            receiver = b.pair_i
            unsorted = ((receiver[1:] < receiver[:-1]) & keep[1:]).any().reshape(1)
            layout = layout_edges(keep, b.pair_j, receiver, b.vectors, n, p, self.pad_vector,
                                  with_graph=bool(self.caches))
            edge_index = adapter.edge_index(layout.sender, layout.receiver)
            if self.caches:
                graph = conv_graph(layout, n)
                src, dst = edge_index[adapter.sender_row], edge_index[1 - adapter.sender_row]
                for cache in self.caches:
                    cache.pin(src, dst, graph)
            elems = b.elems.clamp(min=0)  # NULL types (-1) as 0, as the eager path reads them
            species = adapter.species_from_index(elems)
            groups, counts = None, torch.zeros(0, dtype=torch.int64, device=self.device)
            if self._room is not None:
                groups, counts = self._room.groups(elems, b.nodes)
        with torch.enable_grad(), ExitStack() as stack:
            if groups is not None:
                for cache in self.caches:
                    stack.enter_context(cache.use_species(groups))
            vectors = (layout.unit_shifts + layout.pad_offset).requires_grad_(True)  # -rij, or the padding vector
            _, node_energy = adapter.energy(b.positions, vectors, species, edge_index, True)
            if node_energy is None:
                raise ValueError("model: it returns no per-atom energies, which LAMMPS needs (eatoms)")
            listed = torch.arange(listed_cap, device=self.device) < b.nlist
            eatoms = torch.where(listed, node_energy.reshape(-1).index_select(0, b.listed), 0.0)
            energy = eatoms.sum()
            grad = torch.autograd.grad(energy, vectors, allow_unused=True)[0]
        if grad is None:
            grad = torch.zeros_like(vectors)
        fij = -grad.index_select(0, layout.slot.clamp(max=p - 1))  # dE/drij = -dE/dvector, from slots to pairs
        status = torch.cat([energy.detach().reshape(1).to(torch.float64), unsorted.to(torch.float64),
                            b.moved.reshape(1).to(torch.float64), counts.to(torch.float64)])
        # float64, as LAMMPS takes them: no conversion on the host side of the call
        return _Outputs(fij.detach().to(torch.float64), eatoms.detach().to(torch.float64), status)
