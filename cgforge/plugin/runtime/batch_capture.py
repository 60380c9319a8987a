"""The padded batched MD step: the force call of a batch of fixed-cell structures on static buffers, captured in a
CUDA graph (``PaddedBatchStep``; docs/batch.md).

``PaddedBatchStep.run(positions)`` gives the batch's energies [B] and forces [N, 3] as ``BatchStep.run`` does, on
buffers a CUDA graph replays (``cuda_graph``; else the same body runs eagerly, which is how a CPU checks it). The
list buffers, the edge slots, the status row the host reads once per step and the early searches: docs/batch.md,
"One model call per step". Cells, pbcs, species and atom counts stay as given for the step's life (NVE and NVT;
NPT changes every cell every step and runs ``BatchStep.run``).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from cgforge.kernels.edge_layout import EdgeTopology, layout_edges

from .batch import BatchStep, Pbc, check_finite, pair_lengths
from .capture import replay_or_capture, room
from .step_graph import MAX_GROW_MARGIN, StepOutput

__all__ = ["EDGE_MARGIN", "LIST_MARGIN", "PaddedBatchStep"]

LIST_MARGIN = 0.1  # spare capacity of the list's buffers (``room``): a padding pair costs a length, not a model edge
EDGE_MARGIN = 0.02  # of the model edges at first
_TRIES = 4  # step calls per ``run`` at most: a rebuild and a growth each run the step again


@dataclass
class _List:
    """The Verlet list in static buffers of ``capacity`` entries (those past the list: invalid)."""

    sender: Tensor  # int64 [L]
    receiver: Tensor  # int64 [L], ascending over the valid entries
    shifts: Tensor  # [L, 3] model dtype: integer image shifts
    valid: Tensor  # bool [L]
    reference: Tensor  # [N, 3]: where the atoms were when their structures were searched
    topology: EdgeTopology | None = None  # row pointers and reverse entries (None: the list has none)

    @property
    def capacity(self) -> int:
        return self.sender.shape[0]


class PaddedBatchStep:
    """Energies and forces of a batch of structures (``ptr``: atom offsets; host ``cells`` [B, 3, 3], ``pbcs``, the
    ``species`` input, fixed) per ``run``, by ``step``'s model and Verlet lists: module doc. ``cuda_graph``: captured
    (on CUDA); else eager on the same buffers. ``keys``: as ``BatchNeighbours.update`` takes them.

    ``finite`` says whether the last ``run``'s energy and forces were finite; ``capture_error`` why a capture failed;
    ``n_captures``, ``n_growths`` (buffers grown after their first sizing), ``n_rebuilds`` (list searches) and
    ``n_reruns`` (steps run again on a list found stale) count.
    """

    def __init__(self, step: BatchStep, cells: np.ndarray, pbcs: Sequence[Pbc], ptr: Sequence[int], species: Tensor,
                 *, cuda_graph: bool, inert_edges_reason: str | None, keys: Sequence[Hashable] | None = None) -> None:
        if inert_edges_reason is not None:
            raise ValueError("the padded batch step pads the edges, which needs a model whose edges beyond the cutoff "
                             f"contribute zero; for this one that is not known: {inert_edges_reason}")
        self.step, self.adapter = step, step.adapter
        self.cuda_graph = bool(cuda_graph)
        self.capture_error: str | None = None
        self.n_captures = self.n_growths = self.n_rebuilds = self.n_reruns = 0
        self.finite = True
        self.ptr, self.pbcs, self.keys = list(ptr), [tuple(p) for p in pbcs], keys
        self.cells_host = np.asarray(cells, dtype=np.float64)
        dev, dtype = self.adapter.device, self.adapter.dtype
        self.positions = torch.zeros(self.ptr[-1], 3, dtype=dtype, device=dev)
        self._previous = torch.zeros_like(self.positions)  # the last call's positions
        self.cells = torch.as_tensor(self.cells_host, dtype=dtype, device=dev)
        self.structure = torch.repeat_interleave(torch.arange(len(self.pbcs), device=dev),
                                                 torch.as_tensor(np.diff(self.ptr), device=dev))
        self.species = species
        self.groups = step.groups(species)
        self.min_distance = step.min_distance  # the captured body holds it
        self.capacity = 0  # model edge slots
        self._edge_margin = EDGE_MARGIN
        self._half_skin = 0.5 * step.neighbours.skin
        self._due: list[int] = []  # structures to search again before the next step
        self._list: _List | None = None
        self._graph: torch.cuda.CUDAGraph | None = None
        self._out: tuple[StepOutput, Tensor] | None = None
        self._pool = None

    @property
    def device(self) -> torch.device:
        return self.adapter.device

    def invalidate(self) -> None:
        """Drop the captured graph (the next call captures again) and the edge graph pinned from its pool."""
        self._graph = self._out = self._pool = None
        self.step.unpin()

    def release(self) -> None:
        """Drop the graph and the list's buffers (the counts and ``capture_error`` stay); a later ``run`` searches
        and sizes them again."""
        self.invalidate()
        self._list, self.capacity, self._due = None, 0, []

    def run(self, positions: Tensor) -> StepOutput:
        """Energy [B] and forces [N, 3] (device tensors in the model's dtype, valid until the next ``run``) at
        ``positions`` ([N, 3], on the model's device); two atoms closer than ``min_distance`` raise
        ``BatchStructureError``; NaN or inf in the results sets ``finite`` False."""
        self._previous.copy_(self.positions)
        self.positions.copy_(positions.detach())
        if self._list is None:
            self._previous.copy_(self.positions)
            self._rebuild()
        elif self._due:
            self._rebuild(self._due)
        count_b = len(self.pbcs)
        for _ in range(_TRIES):
            out, status = replay_or_capture(self, self._compute, "the batched MD step")
            host = status.cpu().numpy()  # the step's one sync
            moved, stepped, (bad, close, count) = np.sqrt(host[:count_b]), math.sqrt(host[count_b]), host[-3:]
            if not (moved <= self._half_skin).all():  # "not <=": NaN counts as moved
                self.n_reruns += 1
                self._rebuild()
            elif count > self.capacity:
                self._grow(int(count))
            else:
                break
        else:
            raise RuntimeError(f"the padded batch step found its list stale or its edges overflowing {_TRIES} times "
                               "in a row")
        if close:
            self._name_close()
        self.finite = not bad
        self._due = np.nonzero(~(moved + 2 * stepped <= self._half_skin))[0].tolist()
        return out

    # --- the host's part: the list and the capacities ----------------------------------------------------------

    def _rebuild(self, search: Sequence[int] = ()) -> None:
        """The Verlet lists of the structures that need one (and of ``search``) searched again, and loaded into the
        buffers."""
        check_finite(self.positions.cpu().numpy(), self.cells_host, self.ptr)  # NaN named before it is searched
        nl = self.step.neighbours
        nl.update(self.positions, self.cells_host, self.pbcs, self.ptr, self.keys, search=set(search))
        self._due = []
        self.n_rebuilds += 1
        pairs, lst = nl.sender.shape[0], self._list
        if lst is None or pairs > lst.capacity:
            self.n_growths += lst is not None
            capacity, dev = room(pairs, LIST_MARGIN), self.device
            ints = {"dtype": torch.int64, "device": dev}
            lst = self._list = _List(torch.zeros(capacity, **ints), torch.zeros(capacity, **ints),
                                     torch.zeros(capacity, 3, dtype=self.positions.dtype, device=dev),
                                     torch.zeros(capacity, dtype=torch.bool, device=dev),
                                     torch.zeros_like(self.positions))
            self.invalidate()
        for buffer, source in ((lst.sender, nl.sender), (lst.receiver, nl.receiver), (lst.shifts, nl.shifts)):
            buffer[:pairs].copy_(source)
            buffer[pairs:].zero_()  # (0, 0, 0): never kept (invalid)
        lst.valid.copy_(torch.arange(lst.capacity, device=self.device) < pairs)
        lst.reference.copy_(nl.built_at())
        fresh = None
        if nl.topology is not None:  # the reverse entries, each padding entry its own
            reverse = torch.arange(lst.capacity, device=self.device)
            reverse[:pairs] = nl.topology.reverse
            fresh = EdgeTopology(nl.topology.rowptr.clone(), reverse)
        if lst.topology is not None and fresh is not None:
            lst.topology.copy_(fresh)
        else:
            if (lst.topology is None) != (fresh is None):
                self.invalidate()  # the other layout path from now on
            lst.topology = fresh
        with torch.no_grad():  # a rebuild reads the host anyway: room for the edges within the cutoff now
            within = int((lst.valid & (self._lengths() < self.step.cutoff)).sum())
        if within > self.capacity:
            self._grow(within)

    def _grow(self, count: int) -> None:
        """Room for ``count`` model edges (with more to spare after each growth); the graph goes."""
        if self.capacity > 0:
            self.n_growths += 1
            self._edge_margin = min(2 * self._edge_margin, MAX_GROW_MARGIN)
        self.capacity = room(count, self._edge_margin)
        self.invalidate()

    def _name_close(self) -> None:
        """Raise the error of the pair closer than ``min_distance`` (eagerly, over the list's valid entries)."""
        lst = self._list
        pairs = int(lst.valid.sum())
        sender, receiver = lst.sender[:pairs], lst.receiver[:pairs]
        with torch.no_grad():
            lengths = self._lengths()[:pairs]
        self.step.check_distances(lengths, self.structure.index_select(0, receiver), sender, receiver, self.ptr)
        raise RuntimeError("the padded batch step flagged a pair closer than min_distance that the list does not hold")

    # --- the step (capture-safe: no host reads) ----------------------------------------------------------------

    def _lengths(self) -> Tensor:
        lst = self._list
        return pair_lengths(self.positions, self.cells, self.structure, lst.sender, lst.receiver, lst.shifts)

    def _compute(self) -> tuple[StepOutput, Tensor]:
        lst, step = self._list, self.step
        with torch.no_grad():
            lengths = self._lengths()
            layout = layout_edges(lst.valid & (lengths < step.cutoff), lst.sender, lst.receiver, lst.shifts,
                                  self.positions.shape[0], self.capacity, step.pad_vector,
                                  with_graph=bool(step.caches), topology=lst.topology)
            moved = (self.positions - lst.reference).square().sum(-1)
            moved = torch.where(torch.isnan(moved), torch.inf, moved)  # NaN: moved past any skin
            worst = moved.new_zeros(len(self.pbcs)).scatter_reduce(0, self.structure, moved, "amax")
            stepped = (self.positions - self._previous).square().sum(-1).max()
            close = (torch.zeros((), dtype=torch.bool, device=self.device) if self.min_distance is None
                     else (lst.valid & (lengths < self.min_distance)).any())
        out = step.derivatives(layout, self.positions, self.cells, self.structure, self.species, self.groups,
                               (True, False, False))
        with torch.no_grad():
            bad = ~(torch.isfinite(out.energy).all() & torch.isfinite(out.forces).all())
            status = torch.cat([worst.to(torch.float64), torch.stack([stepped.to(torch.float64), bad.to(torch.float64),
                                close.to(torch.float64), out.count.reshape(()).to(torch.float64)])])
        return out, status
