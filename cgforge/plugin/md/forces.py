"""Force providers for the MD engine: a model runtime's step (``runtime.potential.Potential``), or any torch
energy function.

A provider computes energy, forces (and virial) inside the engine's step without host reads and says on the
device whether to trust them: ``stale`` (an atom moved too far since the list was built) or ``overflow`` (more
edges than the buffers hold). With a changing cell, M = cell_ref^-1 cell and affine displacements u, a pair
outside the list stays outside the cutoff while 2 max|u| <= (1 - ||M - I||_F)(rc + skin) - rc (M = I: skin / 2).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from cgforge.kernels.edge_layout import EdgeTopology

from ..runtime.neighbours import neighbour_list
from ..runtime.options import RuntimeOptions
from ..runtime.potential import Potential


@dataclass
class ForceResult:
    """One evaluation on the device: energy, forces, virial (float64); stale, overflow (bool); slack (Å the
    atoms may still move before the list is stale); count (model edges, for ``grow``)."""

    energy: Tensor
    forces: Tensor
    virial: Tensor | None
    stale: Tensor
    overflow: Tensor
    slack: Tensor
    count: Tensor


@dataclass
class PendingList:
    """A Verlet list being found for a snapshot (positions, cell) of the state, and the event ordering its use."""

    positions: Tensor
    cell: Tensor
    lists: tuple[Tensor, Tensor, Tensor] | None = None
    topology: tuple | None = None  # ModelStep.list_topology of the lists (a PreparedList)
    ready: torch.cuda.Event | None = None


def inverse_3x3(cell: Tensor) -> Tensor:
    """cell^-1 of a [3, 3] cell (rows) as its adjugate over its determinant, from cross products: element-wise work
    that queues on the device without a host sync (``torch.linalg.inv`` waits for its singularity check on CUDA:
    a list installed behind the running block would wait for that block)."""
    a0, a1, a2 = cell.unbind(0)
    first = torch.linalg.cross(a1, a2)
    adjugate = torch.stack([first, torch.linalg.cross(a2, a0), torch.linalg.cross(a0, a1)], dim=1)
    return adjugate / torch.dot(a0, first)


def _false(device: torch.device) -> Tensor:
    return torch.zeros((), dtype=torch.bool, device=device)


class EnergyFunctionForces:
    """Forces (and virial: dE/d strain of positions and cell) from ``energy_fn(positions, cell) -> energy`` by
    autograd, for test potentials and small force fields (never stale). options: ``RuntimeOptions``."""

    generation = 0
    capturable = True

    def __init__(self, energy_fn: Callable[[Tensor, Tensor], Tensor], device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float64, options: RuntimeOptions | None = None) -> None:
        self.energy_fn = energy_fn
        self.device = torch.device(device)
        self.dtype = dtype
        self.options = RuntimeOptions() if options is None else options
        self.compiled = False

    def start(self, positions: Tensor, cell: Tensor, pbc: tuple[bool, bool, bool], numbers: np.ndarray,
              changes_cell: bool) -> None:
        self._false = _false(self.device)
        self._count = torch.zeros((), dtype=torch.int64, device=self.device)
        self._slack = torch.full((), float("inf"), dtype=torch.float64, device=self.device)

    def compute(self, positions: Tensor, cell: Tensor, *, virial: bool) -> ForceResult:
        with torch.enable_grad():
            pos = positions.detach().to(self.dtype).requires_grad_(True)
            box = cell.detach().to(self.dtype)
            inputs = [pos]
            if virial:
                strain = torch.zeros(3, 3, dtype=self.dtype, device=self.device, requires_grad=True)
                deform = torch.eye(3, dtype=self.dtype, device=self.device) + strain
                energy = self.energy_fn(pos @ deform, box @ deform)
                inputs.append(strain)
            else:
                energy = self.energy_fn(pos, box)
            grads = torch.autograd.grad(energy, inputs)
        w = (0.5 * (grads[1] + grads[1].T)).to(torch.float64) if virial else None
        return ForceResult(energy=energy.detach().to(torch.float64).reshape(()), forces=-grads[0].to(torch.float64),
                           virial=w, stale=self._false, overflow=self._false, slack=self._slack, count=self._count)

    def rebuild(self, positions: Tensor, cell: Tensor) -> None:
        pass

    def grow(self, count: int) -> None:
        pass


class ModelForces:
    """The model step of a ``Potential`` as an engine force provider; ``generation`` changes when the step's
    buffers were reallocated (a graph captured over them is stale)."""

    def __init__(self, potential: Potential) -> None:
        self.potential = potential
        self.step = potential.step
        self.device = potential.device
        self.dtype = potential.dtype
        self.options = potential.options
        self.cutoff = float(potential.neighbours.cutoff)
        self.skin = float(potential.neighbours.skin)
        # The last rebuild's reference positions and cell inverse, updated in place (captured graphs read them).
        self._ref_positions: Tensor | None = None
        self._ref_cell_inverse: Tensor | None = None
        self._own_generation = 0
        self._side: torch.cuda.Stream | None = None  # the pipelined rebuild's search stream
        self._retired: PendingList | None = None

    @property
    def generation(self) -> tuple[int, int]:
        return self.step.generation, self._own_generation

    @property
    def capturable(self) -> bool:
        """Whether the step can run inside a CUDA graph (padded edge buffers)."""
        return self.step.padded

    @property
    def compiled(self) -> bool:
        """Whether the model is compiled (``torch.compile`` is then known to work here)."""
        return self.potential.compile is not None

    def near_full_device(self, n_atoms: int) -> bool:
        """True when the potential's memory plan for ``n_atoms`` atoms says no CUDA graph."""
        plan = self.potential.memory_plan
        return plan is not None and plan.atoms == n_atoms and not plan.capture

    @property
    def initial_slack(self) -> float:
        """How far (Å) atoms may move right after a rebuild with the cell fixed (half the skin)."""
        return 0.5 * self.skin

    @property
    def foreign_rebuild(self) -> bool:
        """True when the potential's own ``evaluate`` rebuilt the shared Verlet list since our last rebuild."""
        return self.potential.neighbours.n_builds != self._builds

    def start(self, positions: Tensor, cell: Tensor, pbc: tuple[bool, bool, bool], numbers: np.ndarray,
              changes_cell: bool) -> None:
        self.pbc = pbc
        self.changes_cell = bool(changes_cell)
        self.species = self.potential.species(numbers)

        loaded = []

        def load() -> None:
            self.step.load(positions.to(self.dtype), cell.to(self.dtype), self.species)
            self.rebuild(positions, cell)
            loaded.append(True)

        # the allocator's mode for this size (the engine's step is captured: the plan does not stream it)
        self.potential.plan_memory(len(numbers), lambda: (load(), self.step.edge_count())[1], streaming=False)
        if not loaded:  # planned before for this size (or not on CUDA)
            load()
        self.potential.plan_rows(len(numbers))
        self._false = _false(self.device)

    def rebuild(self, positions: Tensor, cell: Tensor) -> None:
        """New Verlet list at these (committed) positions; host syncs."""
        self.step.positions.copy_(positions)
        self.step.cell.copy_(cell)
        self.step.rebuild(self.pbc)
        self._set_reference(positions, cell)

    # The engine's pipelined rebuild, whose search overlaps a block of steps: ``snapshot`` before the block,
    # ``search`` on a side stream, ``install`` between blocks; the snapshot becomes the staleness reference.

    def snapshot(self, positions: Tensor, cell: Tensor) -> PendingList:
        """Queue copies of the state a list will be searched for (before the steps that change it)."""
        pending = PendingList(positions.detach().clone(), cell.detach().clone())
        if self.device.type == "cuda":
            pending.ready = torch.cuda.Event()
            pending.ready.record()
        return pending

    def search(self, pending: PendingList) -> None:
        """Find the Verlet list at the snapshot (host syncs on a side stream when on CUDA)."""
        cuda = self.device.type == "cuda"
        if cuda:
            if self._side is None:
                self._side = torch.cuda.Stream(self.device)
            self._side.wait_event(pending.ready)
            self._retired = None  # the last list's side-stream memory: this stream now waits for its copies
        with torch.cuda.stream(self._side) if cuda else nullcontext():  # the casts too: the main stream runs MD
            positions, cell = pending.positions.to(self.dtype), pending.cell.to(self.dtype)
            pending.lists = neighbour_list(positions, cell, self.pbc, self.potential.neighbours.list_cutoff)
            pending.topology = self.step.list_topology(pending.lists, positions, cell)
            if cuda:
                pending.ready = torch.cuda.Event()
                pending.ready.record()

    def can_install_ahead(self, pending: PendingList) -> bool:
        """Whether ``install`` may be queued behind the block still running: the list keeps its buffers' capacity
        (installing it drops no captured graph)."""
        return pending.topology is not None and self.step.keeps_list_capacity(pending.topology.capacity)

    def install(self, pending: PendingList) -> None:
        """Load the list found by ``search`` (between blocks); its snapshot becomes the staleness reference."""
        positions, cell, lists, topology = pending.positions, pending.cell, pending.lists, pending.topology
        if self.device.type == "cuda":
            # Copies on this stream (record_stream's cross-stream free would invalidate a later capture); the
            # originals stay referenced until the next search, whose stream waits for these copies.
            torch.cuda.current_stream(self.device).wait_event(pending.ready)
            lists = tuple(t.clone() for t in lists)
            if topology is not None and topology.topology is not None:
                made = topology.topology
                topology = topology._replace(topology=EdgeTopology(made.rowptr.clone(), made.reverse.clone()))
            self._retired = pending
        self.step.install_list(positions.to(self.dtype), cell.to(self.dtype), self.pbc, lists, topology)
        self._set_reference(positions, cell)

    def _set_reference(self, positions: Tensor, cell: Tensor) -> None:
        self._ref_positions = self._keep(self._ref_positions, positions.detach())
        inverse = inverse_3x3(cell.detach()) if self.changes_cell else None
        self._ref_cell_inverse = None if inverse is None else self._keep(self._ref_cell_inverse, inverse)
        self._builds = self.potential.neighbours.n_builds

    def _keep(self, held: Tensor | None, value: Tensor) -> Tensor:
        """``value`` in ``held``'s storage when it fits (captured graphs keep reading it), else a new tensor."""
        if held is not None and held.shape == value.shape and held.dtype == value.dtype:
            return held.copy_(value)
        self._own_generation += 1
        return value.clone()

    def grow(self, count: int) -> None:
        self.step.grow(int(count))

    def _slack(self, positions: Tensor, cell: Tensor) -> Tensor:
        reference = self._ref_positions
        if self._ref_cell_inverse is None:
            allowed = 0.5 * self.skin
        else:
            deform = self._ref_cell_inverse @ cell
            reference = reference @ deform
            eye = torch.eye(3, dtype=deform.dtype, device=deform.device)
            bound = (1.0 - (deform - eye).square().sum().sqrt()) * (self.cutoff + self.skin)
            allowed = 0.5 * (bound - self.cutoff)
        moved = (positions - reference).square().sum(-1).amax().sqrt()
        return allowed - moved

    def compute(self, positions: Tensor, cell: Tensor, *, virial: bool) -> ForceResult:
        step = self.step
        step.positions.copy_(positions)
        step.cell.copy_(cell)
        slack = self._slack(positions, cell)
        out = step.compute(forces=True, stress=virial)
        overflow = out.count > step.capacity if step.padded and step.filter_edges else self._false
        w = out.virial.to(torch.float64) if virial else None
        return ForceResult(energy=out.energy.to(torch.float64), forces=out.forces.to(torch.float64), virial=w,
                           stale=~(slack >= 0), overflow=overflow, slack=slack, count=out.count)
