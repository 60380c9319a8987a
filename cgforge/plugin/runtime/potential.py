"""The model runtime: a MACE or NequIP model that evaluates structures on the device, built by ``load``.

    from cgforge.plugin.runtime.potential import load
    potential = load("mace", device="cuda")                  # bundled name, checkpoint path or module
    system = potential.system(numbers, positions, cell, pbc)  # once per system (species, atom order)
    out = potential.evaluate(positions, cell, pbc, system, forces=True, stress=True)
    out.energy, out.forces, out.virial, out.energies
    outs = potential.evaluate_batch([BatchStructure(numbers, positions, cell, pbc), ...])  # one graph (runtime.batch)

A ``Potential`` owns the model's adapter, the Verlet list, the step (``ModelStep``, captured in a CUDA graph on
CUDA), the memory and row plans, the atom order, the compile mode and the radial setup. It differentiates the
model's energy ``E(positions (I + eps), cell (I + eps))``: forces = -dE/dx, virial = sym(dE/d eps) at eps = 0.
Every result is checked on the host for NaN and inf (``NonFiniteOutputError``).
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from cgforge.patches.common import UnsupportedModelError, parse_dtype
from cgforge.patches.radial_precision import MODES as RADIAL_MODES
from cgforge.patches.radial_precision import radial_layers, set_radial_precision
from cgforge.patches.species_linear import SpeciesGroups, SpeciesRoom

from .adapters import ModelAdapter, adapter_for
from .atom_order import spatial_order, to_user_order
from .capture import resolve_cuda_graph
from .compiled import check_compile, parse_compile
from .diagnosis import NonFiniteOutputError, non_finite_message
from .memory_plan import MemoryPlan, plan_memory, use_expandable_segments
from .neighbours import VerletNeighbourList, check_skin
from .options import RuntimeOptions
from .step_graph import ModelStep, _no_phase
from .tiled import Workspace, _free_bytes, check_workspace

if TYPE_CHECKING:
    from cgforge.kernels.core.tuning import KernelTuning

    from .batch import BatchStep, BatchStructure

__all__ = ["Evaluation", "Potential", "System", "Timings", "UnsupportedModelError", "default_patch", "load",
           "load_module", "resolve_device"]

_WARMUP_ATOMS = 8
Pbc = tuple[bool, bool, bool]


def resolve_device(device: str | torch.device | None) -> torch.device:
    """None: cuda when available, else cpu. A cuda device on a machine without one is a clear error."""
    from cgforge.patches.common import parse_device

    return torch.device("cuda" if torch.cuda.is_available() else "cpu") if device is None else parse_device(device)


def default_patch(patch: bool | None, device: torch.device, radial_precision: str, compile_mode: str | None,
                  tuning: object = None, radial_table: bool | None = None) -> bool:
    """Whether to run cgforge's kernels (``patch``, checked) or, for None, the fastest correct path: cgforge's on CUDA
    or where the other arguments need its layers, the model's own code on a CPU."""
    if patch is not None:
        if not isinstance(patch, bool):
            raise TypeError(f"patch: expected None, True or False, got {patch!r}")
        if radial_table and not patch:
            raise ValueError("radial_table=True, patch=False: the radial tables are read by cgforge's kernels, which "
                             "patch=False leaves out; leave out one of them")
        return patch
    return (device.type == "cuda" or radial_precision != "fp32" or compile_mode is not None or tuning is not None
            or bool(radial_table))


def check_radial_table(radial_table: object, radial_precision: object) -> None:
    """The radial_table argument alone, and with radial_precision (what needs the model is checked later)."""
    if radial_table not in (None, True, False) or isinstance(radial_table, int) and not isinstance(radial_table, bool):
        raise TypeError(f"radial_table: expected None, True or False, got {radial_table!r}")
    if radial_table and radial_precision != "fp32":
        raise ValueError(f"radial_table=True and radial_precision={radial_precision!r}: a table replaces the radial "
                         "MLP whose products radial_precision sets; choose one")


def load(model: str | os.PathLike | torch.nn.Module, device: str | torch.device | None = None,
         dtype: str | torch.dtype | None = None, *, patch: bool | None = None, radial_precision: str = "fp32",
         radial_table: bool | None = None, compile: bool | str = False, tuning: KernelTuning | None = None,
         **kwargs: object) -> Potential:
    """A ``Potential`` of ``model``: ``"mace"`` / ``"nequip"`` (the bundled water models), a MACE ``.model`` or
    NequIP ``.ckpt`` / ``.nequip.zip`` path, or a MACE / NequIP module (patched in place, its parameters frozen).

    device: None picks cuda when available. dtype: None keeps the model's. patch: see ``default_patch``. tuning:
    the ``KernelTuning`` of the kernels the patch builds (None: the defaults). The rest: as ``Potential`` takes them.
    Arguments that need no model are checked before it loads.
    """
    compile_mode = parse_compile(compile)
    check_radial_table(radial_table, radial_precision)
    check_workspace(kwargs.get("workspace", "auto"))
    check_skin(kwargs.get("skin", 1.0))
    parse_dtype(dtype)
    device = resolve_device(device)
    module = load_module(model, device, dtype, patch=default_patch(patch, device, radial_precision, compile_mode,
                                                                   tuning, radial_table), tuning=tuning)
    return Potential(module, device, radial_precision=radial_precision, radial_table=radial_table,
                     compile=compile_mode, **kwargs)


def load_module(model: str | os.PathLike | torch.nn.Module, device: str | torch.device,
                dtype: str | torch.dtype | None = None, *, patch: bool = True,
                tuning: KernelTuning | None = None) -> torch.nn.Module:
    """The MACE or NequIP module of ``model`` (as ``load`` takes it) on ``device``, in ``dtype`` (None: the model's),
    patched with cgforge's kernels built with ``tuning`` when ``patch`` (``families.load``)."""
    from cgforge.patches import families

    from .bundled import checkpoint_path

    families.check_tuning(tuning, patch)  # before any file is looked at
    if isinstance(model, str | os.PathLike):
        model = checkpoint_path(model)
    return families.load(model, device, dtype, patch=patch, tuning=tuning)


@dataclass(frozen=True)
class System:
    """What a potential keeps of one system (``Potential.system``): its atomic numbers, the model's species
    input in the order the model runs in, and that order (None: the order given; ``atom_order``)."""

    numbers: np.ndarray
    species: Tensor
    order: np.ndarray | None

    @property
    def n_atoms(self) -> int:
        return len(self.numbers)


@dataclass
class Evaluation:
    """Host results of ``Potential.evaluate`` (float64, in the order the atoms were given): energy (eV), forces
    [N, 3] (eV/Å), virial [3, 3] = sym(dE/d strain) (eV; stress is virial / volume), per-atom energies [N];
    each None when not asked for."""

    energy: float
    forces: np.ndarray | None
    virial: np.ndarray | None
    energies: np.ndarray | None


class Timings:
    """Seconds per phase in ``seconds``, device-synchronised (``Potential.record_timings``)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._sync()
        start = time.perf_counter()
        yield
        self._sync()
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class Potential:
    """Energy, forces, virial and per-atom energies of structures for one model on one device (module doc).

    model: a loaded MACE or NequIP module (``load`` makes one), its parameters frozen here. device: where it runs.
    The other arguments are the Calculator's (docs/calculator.md's table); options: the ``RuntimeOptions``, read
    when the next plan is made.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device, *, skin: float = 1.0, head: str | None = None,
                 type_map: dict[str, str] | None = None, warmup: bool = True, cuda_graph: bool | None = None,
                 filter_edges: bool | None = None, radial_precision: str = "fp32", radial_table: bool | None = None,
                 streaming: bool | None = None, compile: bool | str | None = False,
                 options: RuntimeOptions | None = None, workspace: str = "auto") -> None:
        options = RuntimeOptions() if options is None else options
        if not isinstance(options, RuntimeOptions):
            raise TypeError(f"options: expected a RuntimeOptions, got {type(options).__name__}")
        self.options = options
        compile_mode = parse_compile(compile)
        check_workspace(workspace)
        check_radial_table(radial_table, radial_precision)
        self.device = torch.device(device)
        self.patched = _is_patched(model)  # a module given already patched stays so
        for p in model.parameters():
            p.requires_grad_(False)  # inference: autograd tracks positions and strain only
        self.model = model
        self.adapter: ModelAdapter = adapter_for(model, self.device, head=head, type_map=type_map)
        self.workspace = Workspace(workspace, self.adapter, lambda: self.options)
        self.dtype = self.adapter.dtype
        self.radial_precision_requested = self._radial_precision(radial_precision)
        self.radial_precision = "fp32"  # the mode in use: decided on the first structure
        self.radial_precision_error: float | None = None
        set_radial_precision(model, "fp32")
        self.radial_table_errors = self._radial_table(radial_table)
        self.radial_table = bool(self.radial_table_errors)
        self.cutoff = self.adapter.cutoff
        self.neighbours = VerletNeighbourList(self.cutoff, skin)
        # Why edges beyond the cutoff may matter for this model (None: they contribute exactly zero).
        self.inert_edges_reason = self.adapter.inert_beyond_cutoff()
        if streaming not in (None, True, False):
            raise TypeError(f"streaming: expected None, True or False, got {streaming!r}")
        self.streaming_requested = streaming
        self.streaming = False
        self.memory_plan: MemoryPlan | None = None
        self.expandable_segments = False  # turned on by a plan near a full device (or the user's allocator setting)
        self._memory_planned = -1  # the atom count whose memory plan was last made (plan_memory)
        self._graph_off_for_size = False  # plan_memory turned capture off for a box near a full device
        self._rows_planned = -1  # the atom count row chunks were last chosen for (plan_rows)
        if streaming:
            if cuda_graph:
                raise ValueError("cuda_graph=True and streaming=True: the streaming path reads its chunk ranges on "
                                 "the host, so its steps run eagerly")
            self._start_streaming()
            cuda_graph = False
        else:
            self.adapter.set_streaming(None)  # a model given as a module may stream from an earlier potential
        self.compile = compile_mode
        if self.compile is not None:
            check_compile(self.device, patched=self.patched, streaming=self.streaming,
                          backend=options.compile_backend)
        self.step = ModelStep(self.adapter, self.neighbours, filter_edges=self._filter_edges(filter_edges),
                              cuda_graph=resolve_cuda_graph(cuda_graph, self.device, self.inert_edges_reason),
                              compile=self.compile, compile_backend=options.compile_backend)
        self._cuda_graph_requested = cuda_graph
        self.timings: Timings | None = None
        self._batch_step = None  # made by the first evaluate_batch
        if warmup:
            self.warm_up()

    def species(self, numbers: np.ndarray) -> Tensor:
        """The model's species input for atomic ``numbers``, on the device, in the order given (unknown
        elements raise ``UnknownElementError``)."""
        return self.adapter.species(np.asarray(numbers))

    def system(self, numbers: np.ndarray, positions: np.ndarray, cell: np.ndarray, pbc: Pbc) -> System:
        """A system of atoms with these ``numbers``; the atom order the model runs in (``atom_order``) is
        chosen from these ``positions``, ``cell`` and ``pbc`` and kept for the system's later structures."""
        numbers = np.array(numbers)
        species = self.species(numbers)
        order = spatial_order(np.asarray(positions), np.asarray(cell), pbc, self.options.order_above_atoms)
        if order is not None:
            species = species.index_select(0, torch.as_tensor(order, device=species.device))
        return System(numbers, species, order)

    def evaluate(self, positions: np.ndarray, cell: np.ndarray, pbc: Pbc, system: System, *, forces: bool = True,
                 stress: bool = False, per_atom: bool = False) -> Evaluation:
        """Energy (and forces; the virial if ``stress``, which needs forces; per-atom energies if ``per_atom``)
        of ``system`` at ``positions`` [N, 3] in Å, with the lattice vectors ``cell`` [3, 3] as rows and
        periodic along ``pbc``. Raises ValueError naming the atoms for a structure it cannot evaluate, and
        ``NonFiniteOutputError`` for NaN or inf in the results."""
        positions = np.asarray(positions)
        if positions.shape != (system.n_atoms, 3):
            raise ValueError(f"atoms: positions of shape {positions.shape} for a system of {system.n_atoms} atoms")
        if not np.isfinite(positions).all():
            raise ValueError("atoms: positions contain NaN or inf")
        forces = forces or stress
        order, species = system.order, system.species
        user_positions, positions = positions, positions if order is None else positions[order]
        with _errors_name_atoms():
            self.workspace.tiled_last = self.workspace.uses_tiles(positions, cell, pbc)
            if self.workspace.tiled_last:
                host = self._evaluate_tiled(positions, cell, pbc, species, forces, stress, per_atom)
            else:
                host = self._evaluate_whole(positions, cell, pbc, species, forces, stress, per_atom)
        n = positions.shape[0]
        if order is not None:
            host = to_user_order(host, order, forces=forces, stress=stress, per_atom=per_atom)
        if not np.isfinite(host).all():  # host arrays: no device sync of its own
            raise NonFiniteOutputError(non_finite_message(
                host, user_positions, cell, pbc, self.model, self.cutoff, patched=self.patched, forces=forces,
                stress=stress, per_atom=per_atom))
        f = 1 + 3 * n if forces else 1  # host: energy, forces [3n], virial [9], energies [n], each if asked for
        v = f + 9 if stress else f
        return Evaluation(float(host[0]), host[1:f].reshape(n, 3).copy() if forces else None,
                          host[f:v].reshape(3, 3) if stress else None, host[v:v + n].copy() if per_atom else None)

    def evaluate_batch(self, structures: Sequence[BatchStructure], *, forces: bool = True, stress: bool = False,
                       per_atom: bool = False, min_distance: float | None = 0.5,
                       keys: Sequence[Hashable] | None = None) -> list[Evaluation]:
        """``evaluate`` of many structures in one graph and one model call (``runtime.batch``): one ``Evaluation``
        per structure, in the order given. A bad structure (two atoms closer than ``min_distance`` Å included)
        raises ``BatchStructureError`` naming its index; ``keys``: as ``BatchStep.evaluate`` takes them."""
        step = self.batch_step(min_distance)
        return [Evaluation(*result) for result in
                step.evaluate(structures, forces=forces, stress=stress, per_atom=per_atom, keys=keys)]

    def batch_step(self, min_distance: float | None = 0.5) -> BatchStep:
        """The potential's ``runtime.batch.BatchStep`` (made at the first call; its Verlet lists are kept from
        call to call), checking distances against ``min_distance`` from now on."""
        from .batch import BatchStep

        if self._batch_step is None:
            self._batch_step = BatchStep(self.adapter, self.neighbours.skin)
        self._batch_step.min_distance = min_distance
        return self._batch_step

    def _evaluate_whole(self, positions: np.ndarray, cell: np.ndarray, pbc: Pbc, species: Tensor, forces: bool,
                        stress: bool, per_atom: bool) -> np.ndarray:
        """The whole system as one graph (the Verlet list and the captured step), in the model's atom order."""
        self.plan_memory(positions.shape[0], lambda: self.step.prepare(positions, cell, pbc, species))
        self.plan_rows(positions.shape[0])
        if self.radial_precision_requested != "fp32" and self.radial_precision_error is None:
            self._check_radial_precision(positions, cell, pbc, species)
        try:
            return self.step.run(positions, cell, pbc, species, forces=forces, stress=stress, per_atom=per_atom)
        except torch.cuda.OutOfMemoryError:
            if self.streaming or self.streaming_requested is not None or not self._switch_to_streaming():
                raise
            warnings.warn("cgforge: the stored path ran out of GPU memory for this structure; streaming edges "
                          "from now on (streaming=True chooses it from the start)", stacklevel=4)
            torch.cuda.empty_cache()
            return self.step.run(positions, cell, pbc, species, forces=forces, stress=stress, per_atom=per_atom)

    def _evaluate_tiled(self, positions: np.ndarray, cell: np.ndarray, pbc: Pbc, species: Tensor, forces: bool,
                        stress: bool, per_atom: bool) -> np.ndarray:
        """The system in tiles with a fixed working set (``runtime.tiled``), in the model's atom order."""
        self.plan_rows(positions.shape[0])  # chunked rows as for the whole system: the tiles' budget counts on them
        return self.workspace.run(positions, cell, pbc, species, forces=forces, stress=stress, per_atom=per_atom)

    def warm_up(self) -> None:
        """Compile every cgforge kernel of the model, then run energy, forces and stress of a tiny periodic
        structure of the model's species (also loads whatever else the first call loads); a model that gives
        NaN or inf there raises ``NonFiniteOutputError``."""
        self.compile_kernels()
        n = _WARMUP_ATOMS
        spacing = min(1.5, 0.4 * self.cutoff)
        grid = np.stack(np.meshgrid(*[np.arange(2)] * 3, indexing="ij"), -1).reshape(-1, 3)[:n]
        jitter = np.random.default_rng(0).normal(scale=0.05 * spacing, size=(n, 3))
        positions = grid * spacing + jitter
        cell = np.eye(3) * (2 * spacing)
        # A step of its own (eager, its own neighbour list): the potential's buffers stay untouched.
        step = ModelStep(self.adapter, VerletNeighbourList(self.cutoff, self.neighbours.skin),
                         filter_edges=self.step.filter_edges)
        pbc = (True, True, True)
        host = step.run(positions, cell, pbc, self.adapter.warmup_species(n), forces=True, stress=True, per_atom=True)
        if not np.isfinite(host).all():  # a broken model file shows here, before any user structure
            raise NonFiniteOutputError(non_finite_message(
                host, positions, cell, pbc, self.model, self.cutoff, patched=self.patched, forces=True, stress=True,
                per_atom=True, what=f"the warm-up structure ({n} atoms about {spacing:.2g} Å apart)"))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def compile_kernels(self) -> None:
        """Compile every cgforge kernel of the model now, not in the middle of a step (or of a LAMMPS exchange)."""
        model_dtype = next(self.model.parameters()).dtype
        for module in self.model.modules():
            compile_kernels = getattr(module, "compile_kernels", None)
            if callable(compile_kernels) and type(module).__module__.startswith("cgforge."):
                compile_kernels(self.device, model_dtype)

    @property
    def graph_caches(self) -> list:
        """The model's graph caches (empty for a model cgforge did not patch): a step that lays out its own edges
        pins each call's ``ConvGraph`` there and enters its species groups (``cache.use_species``)."""
        return self.step.caches

    def species_groups(self, index: Tensor) -> SpeciesGroups | None:
        """The nodes grouped by their [N] species ``index`` (one host read) for the model's per-species
        self-connections; None for a model without graph caches."""
        return SpeciesGroups.from_species(index) if self.graph_caches else None

    def species_room(self, capacities: Sequence[int]) -> SpeciesRoom:
        """Groups with a fixed room per species (``capacities``), made inside a captured step without host reads."""
        return SpeciesRoom(capacities, self.device)

    def plan_memory(self, n_atoms: int, count_edges: Callable[[], int], streaming: bool = True
                    ) -> MemoryPlan | None:
        """The memory plan for systems of ``n_atoms`` atoms, made once per size on CUDA (None on other devices), from
        ``count_edges()`` (builds the Verlet list, returns its edges): streaming where the stored path would not fit
        (with ``streaming=None`` at construction and ``streaming`` here), expandable segments and no CUDA graph near
        a full device (unless one was asked for)."""
        if self.device.type != "cuda" or n_atoms == self._memory_planned:
            return self.memory_plan
        self._memory_planned = n_atoms
        free = _free_bytes(self.device)  # torch's cache counted as free
        edges = count_edges()
        chunkable = not self.streaming and self.step.compiled is None  # plan_rows' condition
        plan = plan_memory(edges, self.adapter.stored_edge_bytes(n_atoms if chunkable else None), free, n_atoms,
                           self.options)
        self.memory_plan = plan
        if plan.expandable and not self.expandable_segments:
            self.expandable_segments = use_expandable_segments()
        if streaming and plan.stream and not self.streaming and self.streaming_requested is None:
            self._switch_to_streaming()
        self._capture_by_size(plan)
        return plan

    def plan_for(self, positions: np.ndarray, cell: np.ndarray, pbc: Pbc, numbers: np.ndarray) -> MemoryPlan | None:
        """The memory plan for this structure as its first evaluation would make it (``plan_memory``; None off
        CUDA)."""
        if len(numbers) == 0:
            raise ValueError("atoms: expected a structure with at least one atom, got an empty Atoms")
        positions, cell = np.asarray(positions, dtype=np.float64), np.asarray(cell, dtype=np.float64)
        species = self.species(numbers)
        return self.plan_memory(len(numbers), lambda: self.step.prepare(positions, cell, pbc, species))

    def compiled_fits(self, positions: np.ndarray, cell: np.ndarray, pbc: Pbc, numbers: np.ndarray) -> bool:
        """Whether this structure leaves room for the compiled model, its rows unchunked and its step captured (False
        off CUDA and when streaming)."""
        plan = self.plan_for(positions, cell, pbc, numbers)
        if plan is None or self.streaming:
            return False
        return plan_memory(plan.edges, self.adapter.stored_edge_bytes(None), plan.free_bytes, len(numbers),
                           self.options).capture

    def plan_rows(self, n_atoms: int) -> None:
        """Per system size: make the stored path's widest per-atom rows in chunks where ``n_atoms`` need it
        (``adapter.set_row_chunks``), unless streaming or compiled; a captured step is captured again when that
        changes."""
        if n_atoms == self._rows_planned:
            return
        self._rows_planned = n_atoms
        plain = self.streaming or self.step.compiled is not None
        if self.adapter.set_row_chunks(None if plain else n_atoms):
            self.step.invalidate()

    def set_compile(self, compile: bool | str) -> None:
        """Compile the model (``compile`` as at construction) or stop, from the next step on; the same checks as
        at construction, and the memory and row plans are made again (a compiled model's rows are not chunked)."""
        mode = parse_compile(compile)
        if mode is not None:
            check_compile(self.device, patched=self.patched, streaming=self.streaming,
                          backend=self.options.compile_backend)
        if mode == self.compile:
            return
        self.compile = mode
        self.step.set_compile(mode)
        self._memory_planned = self._rows_planned = -1

    @property
    def n_edges(self) -> int:
        """Edges the model saw at the last step within the cutoff (all Verlet edges when not filtering; in tiles, the
        tiles' edges, halo receivers counted again)."""
        return self.workspace.n_edges if self.workspace.tiled_last else self.step.n_edges

    @property
    def cuda_graph(self) -> bool:
        """Whether steps run as CUDA-graph replays (False after a failed capture: see ``step.capture_error``)."""
        return self.step.cuda_graph

    def record_timings(self, enabled: bool = True) -> None:
        """Start (or stop) a per-phase breakdown in ``timings.seconds`` (syncs the device per phase): neighbour_list,
        then model (a replay) or edges / forward / backward (the eager step), and copy_out."""
        self.timings = Timings(self.device) if enabled else None
        self.step.phase = self.timings.phase if enabled else _no_phase

    def _filter_edges(self, filter_edges: bool | None) -> bool:
        if filter_edges is None:
            return True  # cutting the list on the device costs far less than the skin's extra edges in the model
        if not filter_edges and self.inert_edges_reason is not None:
            raise ValueError(f"filter_edges=False needs a model whose edges beyond the cutoff contribute zero; for "
                             f"this one that is not known: {self.inert_edges_reason}")
        return bool(filter_edges)

    def _radial_precision(self, mode: str) -> str:
        if mode not in RADIAL_MODES:
            raise ValueError(f"radial_precision: expected one of {', '.join(RADIAL_MODES)}, got {mode!r}")
        if mode == "fp32":
            return mode
        if self._model_dtype() != torch.float32:
            raise ValueError(f"radial_precision={mode!r} is for FP32 models; this one is {self._model_dtype()}")
        if self.device.type != "cuda":
            raise ValueError(f"radial_precision={mode!r} needs a CUDA device (TF32 is a tensor-core format), got "
                             f"{self.device}")
        if not radial_layers(self.model):
            raise ValueError(f"radial_precision={mode!r} needs a model patched by cgforge (its radial MLPs are cgforge "
                             "layers); this one has none")
        return mode

    def _model_dtype(self) -> torch.dtype:
        """The dtype the model computes in (its floating-point parameters'), which may differ from ``self.dtype``."""
        return next((p.dtype for p in self.model.parameters() if p.is_floating_point()), self.dtype)

    def _radial_table(self, radial_table: bool | None) -> list[tuple[int, float]]:
        """Turn the radial tables on or off as asked (None: where model and device allow); their (intervals, error)."""
        if radial_table is None:  # the model's dtype: a NequIP adapter feeds FP64 positions to an FP32 model
            radial_table = (self.device.type == "cuda" and self._model_dtype() == torch.float32 and self.patched
                            and self.radial_precision_requested == "fp32" and self.adapter.why_not_tabulated() is None)
        if radial_table and not self.patched:
            raise ValueError("radial_table=True: the tables are read by cgforge's kernels, and this model runs its own "
                             "code; pass patch=True (or leave patch out)")
        if radial_table and (reason := self.adapter.why_not_tabulated()) is not None:
            raise ValueError(f"radial_table=True: {reason}")
        return self.adapter.set_radial_table(bool(radial_table))

    def _start_streaming(self) -> None:
        self.adapter.set_row_chunks(None)  # streaming maps its rows in chunks itself
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = min(max(free // 20, 64 << 20), 1 << 30)  # a chunk's working set: 5% of free, 64 MiB..1 GiB
        else:
            budget = 256 << 20
        if not self.adapter.set_streaming(budget):
            raise ValueError("streaming=True: this model has no layer that can stream its edges (MACE models "
                             "patched by cgforge with RealAgnostic(Residual)InteractionBlocks can; on a CPU pass "
                             "patch=True too)")
        self.streaming = True

    def _switch_to_streaming(self) -> bool:
        """streaming=None: stream from now on (False when no layer can: the stored path it is)."""
        try:
            self._start_streaming()
        except ValueError:
            return False
        self.step.cuda_graph = False
        if self.step.compiled is not None:  # the streaming convolution reads chunk ranges on the host
            self.step.set_compile(None)
        self.step.invalidate()
        return True

    def _capture_by_size(self, plan: MemoryPlan) -> None:
        """No CUDA graph for a box near a full device (``plan.capture`` False) unless one was asked for (the graph's
        private pool is what such a box lacks); back on for a smaller box."""
        if self._cuda_graph_requested is not None or self.streaming:
            return
        if not plan.capture and self.step.cuda_graph:
            self.step.cuda_graph = False
            self.step.invalidate()
            self._graph_off_for_size = True
        elif plan.capture and self._graph_off_for_size:
            self.step.cuda_graph = True
            self._graph_off_for_size = False

    def _check_radial_precision(self, positions: np.ndarray, cell: np.ndarray, pbc: Pbc, species: Tensor) -> None:
        """Forces of this structure in FP32 and in the mode asked for; the mode stays only within tolerance."""
        mode = self.radial_precision_requested
        tolerance = self.options.radial_tf32_tol
        forces = {}
        for m in ("fp32", mode):
            set_radial_precision(self.model, m)
            self.step.invalidate()  # a captured step holds the GEMM kernels it was captured with
            host = self.step.run(positions, cell, pbc, species, forces=True, stress=False, per_atom=False)
            forces[m] = host[1:1 + 3 * positions.shape[0]]
        reference = float(np.linalg.norm(forces["fp32"]))
        error = float(np.linalg.norm(forces[mode] - forces["fp32"])) / max(reference, np.finfo(float).tiny)
        self.radial_precision_error = error
        self.radial_precision = mode if error <= tolerance else "fp32"
        if self.radial_precision != mode:
            set_radial_precision(self.model, "fp32")
            self.step.invalidate()
            warnings.warn(f"cgforge: radial MLPs kept in FP32: {mode} changed the forces by {error:.2e} (relative), "
                          f"more than {tolerance:.0e}", RuntimeWarning, stacklevel=4)


@contextmanager
def _errors_name_atoms() -> Iterator[None]:
    """A ValueError from the evaluation (neighbour list: singular cell, cutoff too large for the cell, ...) names
    the atoms as the cause."""
    try:
        yield
    except ValueError as err:
        if str(err).startswith(("atoms:", "species:")):
            raise
        raise ValueError(f"atoms: {err}") from err


def _is_patched(model: torch.nn.Module) -> bool:
    from cgforge.patches import mace as pm

    if pm.is_mace_model(model):
        return pm.is_patched(model)
    from cgforge.patches import nequip as pn

    return pn.is_patched(model)
