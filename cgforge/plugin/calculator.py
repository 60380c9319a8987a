"""The cgforge ASE calculator: MACE or NequIP models with cgforge's kernels, everything on the device.

    from cgforge.plugin import Calculator
    atoms.calc = Calculator("mace")                 # the bundled water model; or a .model/.ckpt/.nequip.zip path
    atoms.calc = Calculator("my.model", device="cuda", dtype="float32")

Per step the host sends positions and receives energy and forces, one copy each way; the neighbour list
(``VerletNeighbourList``, on the device, with a skin) is rebuilt only when an atom moved more than half the
skin; the model inputs are built as device tensors. The model is called for its energy only and the
calculator differentiates it:

    E(x, eps) = model(positions (I + eps), cell (I + eps)),  forces = -dE/dx,  stress = sym(dE/d eps) / V

at eps = 0. The strain enters only when stress is asked for, as one [3, 3] matrix multiplying every edge
vector: dE/d eps is the virial, sum over edges of vector (x) dE/d vector, one small GEMM in the backward,
never a gather over repeated indices. Energy and forces come from one model run (``forces_with_energy``,
on by default: an energy call on a new structure computes the forces too, as MACECalculator does, so
``get_potential_energy()`` then ``get_forces()`` cost one run); stress only when asked for (or with
``stress_with_forces``).

On CUDA the step (edge cut, model, backward) is captured in a CUDA graph and replayed (``cuda_graph``); see
``step_graph``. That needs a model whose edges beyond the cutoff contribute exactly zero (checked per model,
``inert_edges``); other models run the eager step with exact edge counts.

Every result is checked on the host for NaN and inf (``NonFiniteOutputError``, which names the output, the
atoms and the closest pair of atoms).

Over 450 lines on purpose: this is ASE's calculator contract in one place (every argument checked and named,
the model loaded and patched, ``calculate`` and the diagnosis of a non-finite result); the step itself is
``step_graph``'s and what a model family needs is its adapter's (``cgforge.patches``).
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from ase import Atoms
from ase.calculators.calculator import Calculator as AseCalculator
from ase.calculators.calculator import PropertyNotImplementedError, all_changes
from ase.stress import full_3x3_to_voigt_6_stress
from torch import Tensor

from cgforge.patches.common import existing_file
from cgforge.patches.radial_precision import MODES as RADIAL_MODES
from cgforge.patches.radial_precision import radial_layers, set_radial_precision

from .runtime.adapters import ModelAdapter, adapter_for
from .runtime.atom_order import spatial_order, to_user_order
from .runtime.compiled import check_compile, parse_compile
from .runtime.memory_plan import MemoryPlan, plan_memory, use_expandable_segments
from .runtime.neighbours import VerletNeighbourList
from .runtime.step_graph import ModelStep

__all__ = ["Calculator", "NonFiniteOutputError", "load_model", "resolve_device", "BUNDLED"]

BUNDLED = ("mace", "nequip")  # the bundled water models' names (cgforge.plugin.runtime.bundled.kinds())
_WARMUP_ATOMS = 8
RADIAL_TF32_TOL = 1e-4  # the largest relative change of the forces a TF32 radial-MLP mode may make (issue 10)
_SHOWN_ATOMS = 8  # atom indices named in a NonFiniteOutputError


class NonFiniteOutputError(ValueError):
    """The model returned NaN or inf (energy, forces, stress or per-atom energies) for a structure.

    The message names the outputs, the first atoms whose forces (or per-atom energies) are not finite and the
    closest pair of atoms (minimum image). The usual causes are overlapping atoms or a damaged model file.
    """


def resolve_device(device: str | torch.device | None) -> torch.device:
    """None: cuda when available, else cpu. A cuda device on a machine without one is a clear error."""
    from cgforge.patches.common import parse_device

    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return parse_device(device)


def _bundled_path(name: str) -> Path:
    """The file of the bundled model ``name`` (one of ``BUNDLED``); FileNotFoundError, saying what to pass
    instead, where this installation has none."""
    try:
        from cgforge.plugin.runtime.bundled import model_path
    except ImportError as err:
        raise FileNotFoundError(
            f"model: the bundled {name!r} model is not available in this installation ({err}); "
            "pass a checkpoint path (.model, .ckpt, .nequip.zip) instead"
        ) from err
    path = Path(model_path(name))
    if not path.is_file():
        raise FileNotFoundError(f"model: the bundled {name!r} model file {path} is missing")
    return path


def load_model(model: str | os.PathLike | torch.nn.Module, device: str | torch.device,
               dtype: str | torch.dtype | None = None, *, patch: bool = True) -> torch.nn.Module:
    """A MACE or NequIP model ready to run on ``device``, patched with cgforge's kernels when ``patch``.

    ``model``: a bundled model's name (``"mace"``, ``"nequip"``: ``BUNDLED``), a checkpoint path (.model,
    .ckpt, .nequip.zip) or a MACE/NequIP module (made ready in place). ``dtype``: None keeps the model's,
    ``"float32"``/``"float64"`` converts. The family registry does the work (``cgforge.patches.families.load``);
    errors name the ``model`` argument."""
    from cgforge.patches import families

    if isinstance(model, str) and model.lower() in BUNDLED:
        model = _bundled_path(model.lower())
    if isinstance(model, str | os.PathLike):
        return _load_file(Path(model), device, dtype, patch)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"model: expected 'mace', 'nequip', a checkpoint path or a MACE/NequIP torch module, "
            f"got {type(model).__name__}"
        )
    return families.load(model, device, dtype, patch=patch)


def _load_file(path: Path, device: str | torch.device, dtype: str | torch.dtype | None,
               patch: bool) -> torch.nn.Module:
    """The model in the checkpoint file ``path`` (``families.load``), after checking it exists (errors name the
    ``model`` argument)."""
    from cgforge.patches import families

    existing_file(path, "model", "a checkpoint file")
    return families.load(path, device, dtype, patch=patch)


def _check_radial_table(radial_table: object, radial_precision: object) -> None:
    """The radial_table argument alone, and with radial_precision (what needs the model is checked later)."""
    if radial_table not in (None, True, False) or isinstance(radial_table, int) and not isinstance(radial_table, bool):
        raise TypeError(f"radial_table: expected None, True or False, got {radial_table!r}")
    if radial_table and radial_precision != "fp32":
        raise ValueError(f"radial_table=True and radial_precision={radial_precision!r}: a table replaces the radial "
                         "MLP whose products radial_precision sets; choose one")


_ASE_KEYWORDS = ("atoms", "directory", "label")  # handed on to ase's Calculator
_OUR_KEYWORDS = ("model", "device", "dtype", "skin", "head", "type_map", "patch", "forces_with_energy",
                 "stress_with_forces", "warmup", "cuda_graph", "filter_edges", "radial_precision",
                 "radial_table", "streaming", "compile")


def _keyword_arguments(model: object, dtype: object, kwargs: dict) -> tuple[object, object, dict]:
    """(model, dtype, ase's keywords): MACECalculator's spellings mapped to ours, anything unknown refused.

    ase's Calculator would keep unknown keywords as parameters that do nothing (a typo, or
    ``default_dtype="float64"``, would pass unnoticed)."""
    kwargs = dict(kwargs)
    if "model_paths" in kwargs:  # MACECalculator: a path or a list of paths (a committee)
        paths = kwargs.pop("model_paths")
        if model is not None:
            raise TypeError("Calculator: got both model= and model_paths= (MACECalculator's spelling of model=); "
                            "give one")
        if isinstance(paths, list | tuple):
            if len(paths) != 1:
                raise TypeError(f"model_paths: cgforge's Calculator runs one model, got a list of {len(paths)}")
            (paths,) = paths
        if not isinstance(paths, str | os.PathLike):
            raise TypeError(f"model_paths: expected a checkpoint path or a list of one, got {type(paths).__name__}")
        model = paths
    if "default_dtype" in kwargs:  # MACECalculator: "float32", "float64", or "" for the model's own
        default_dtype = kwargs.pop("default_dtype")
        if dtype is not None:
            raise TypeError("Calculator: got both dtype= and default_dtype= (MACECalculator's spelling of dtype=); "
                            "give one")
        dtype = default_dtype if default_dtype != "" else None
    unknown = sorted(set(kwargs) - set(_ASE_KEYWORDS))
    if unknown:
        raise TypeError(f"Calculator: unknown keyword argument(s) {', '.join(map(repr, unknown))}; it takes "
                        f"{', '.join(_OUR_KEYWORDS)} (MACECalculator's model_paths= and default_dtype= mean model= "
                        f"and dtype=) and ase's {', '.join(_ASE_KEYWORDS)}")
    if model is None:
        raise TypeError("Calculator: missing model: 'mace', 'nequip', a checkpoint path or a MACE/NequIP module")
    return model, dtype, kwargs


class _Timings:
    """Seconds per phase, device-synchronised; only when the caller asked for a breakdown."""

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


@contextmanager
def _no_phase(name: str) -> Iterator[None]:
    yield


class Calculator(AseCalculator):
    """ASE calculator for MACE and NequIP models running on cgforge's kernels (on CUDA; see ``patch``).

    model: ``"mace"`` / ``"nequip"`` (the bundled water models), a MACE ``.model`` or NequIP ``.ckpt`` /
    ``.nequip.zip`` path, or a MACE / NequIP module (patched in place, its parameters frozen).
    device: None picks cuda when available, else cpu. dtype: None keeps the model's.
    skin: Verlet skin in Å (the list holds pairs within cutoff + skin and is rebuilt when an atom moved
    more than skin/2). head: MACE head (multi-head models). type_map: NequIP {chemical symbol: type name}
    for types that are not chemical symbols.
    patch: True runs cgforge's kernels, False the model's own (e3nn) code. None (default): the fastest correct
    path, cgforge's kernels on CUDA and the model's own code on a CPU, where cgforge's CPU path (a torch
    reference for tests) is slower. Measured (2-core CPU box, 1 thread, CPU time per call, 96-atom water box
    ``water_box(32)``, bundled models, energy + forces): MACE (FP32) 136 ms patched, 84 ms unpatched; NequIP
    (FP64) 35 ms patched, 26 ms unpatched. ``self.patched`` says which is in use (``compile`` needs, and with None
    gets, the patched model).
    forces_with_energy: an energy call on a new structure computes the forces in the same run (default True,
    as MACECalculator does): ``get_potential_energy()`` then ``get_forces()`` cost one model run, not two. The
    backward costs about 1.8 forwards on a CPU (MACE above: 30 ms energy only, 84 ms with forces), so False
    suits energy-only work (an energy call then runs without autograd).
    Systems of more than ``atom_order.ORDER_ABOVE_ATOMS`` atoms (100,000) run in the Z-curve order of their
    positions (chosen once per system); forces and per-atom energies come back in the order given.
    stress_with_forces: also compute the stress whenever forces are computed (for NPT integrators that ask
    for forces and stress in separate calls; costs one small GEMM more in the backward).
    warmup: run the model once at construction so kernels compile now, not in the first MD step.
    cuda_graph: capture the model step in a CUDA graph and replay it (None: on for CUDA when the model's
    edges beyond the cutoff are known to contribute zero, ``self.inert_edges``, except for boxes near a full device,
    whose steps take seconds: ``memory_plan``; True where that is not known or not on CUDA is an error).
    filter_edges: cut the Verlet list to the cutoff every step, on the device (True), or feed the model the
    whole list, skin included (False: no per-step cut and one edge layout per rebuild, but ~((rc + skin) /
    rc)^3 times the edges). None: True. False needs a model whose edges beyond the cutoff contribute zero.
    radial_precision: ``"fp32"`` (default), ``"tf32"`` or ``"3xtf32"``: how the radial MLPs' matrix products
    run (``cgforge.patches.radial_precision``; the TF32 modes need CUDA and an FP32 model). The first structure
    is evaluated in FP32 and in the mode asked for: the mode is kept only if the forces change by at most
    ``RADIAL_TF32_TOL`` (norm of the difference over the norm of the FP32 forces). ``radial_precision_error``
    holds the change and ``radial_precision`` the mode in use (a warning says when it fell back to FP32).
    radial_table: read each layer's tensor-product weights from a table of the edge length instead of running
    the radial basis and MLP (``cgforge.patches.mace.radial_table``, ``cgforge.patches.nequip.radial_table``:
    cubic Hermite tables fitted in FP64 from the model's own embedding and MLP when the calculator is made,
    ~0.5 s, their measured relative error at most 1e-7 in values and derivatives; ``radial_table_errors`` lists
    (intervals, error) per layer). True: on (an error when the model cannot: patched MACE models with
    RealAgnostic(Residual)InteractionBlocks and a plain radial embedding; patched NequIP models whose edge
    embedding is nequip's Bessel encoding with its polynomial cutoff, read only by the interaction blocks);
    False: off; None (default): on for a MACE or NequIP model computing in FP32 on CUDA that can, with
    ``radial_precision="fp32"``; the blocks' convolutions then read the tables inside their kernels. FP64 models keep
    the MLP (the table's 1e-8-level error is above FP64's). ``self.radial_table`` says what is in use.
    streaming: compute the radial MLP inside the convolution chunk by chunk, so no per-edge weight tensor is
    stored (``cgforge.kernels.streaming_convolution``; MACE's RealAgnostic(Residual)InteractionBlocks): memory
    grows with atoms, not edges x channels. True: on (eager steps: chunk ranges are read on the host, so no CUDA
    graph); False: off; None (default): on for a CUDA structure whose stored path would take more than
    ``memory_plan.STREAMING_AUTO_FRACTION`` of the free device memory (estimated per system size from the exact
    edge count: ``self.memory_plan``), or that ran out of memory on the stored path (the step is then retried
    streaming); ``self.streaming`` says what is in use. Near a full device the calculator turns on torch's
    expandable allocator segments for the process (``memory_plan``; not when ``PYTORCH_CUDA_ALLOC_CONF`` is set:
    ``self.expandable_segments`` says). Measured (H100, MACE-MP-medium shape, FP32): with the radial tables and
    row chunks the stored path runs 1.03 M atoms in 73 GB at 3.6 s a step, streaming in 71 GB at 6.5 s.
    compile: False (default), True or an Inductor mode (``"default"``, ``"max-autotune-no-cudagraphs"``): compile the
    model's forward and backward with ``torch.compile`` (``runtime.compiled``), fusing the small elementwise
    kernels around cgforge's own; the step is still captured in a CUDA graph (``cuda_graph``). The first step pays the
    compilation (the edge count is symbolic: a run compiles once). Needs a model patched by cgforge and a working
    compiler (Triton on CUDA, a C++ compiler on a CPU): otherwise a clear error here. A compilation that fails at the
    first step warns and runs the model eagerly (``step.compile_error`` says why); switching to streaming (out of
    memory) turns it off.
    MACECalculator's spellings ``model_paths=`` (a path or a list of one) and ``default_dtype=`` mean ``model=``
    and ``dtype=``; any other unknown keyword is a TypeError (ase's ``atoms``, ``directory``, ``label`` pass on).

    Stress (eV/Å^3, ase's sign and Voigt order) is sym(dE/d eps) / V: eps strains all positions and all three
    cell vectors, V is the volume of ``atoms.cell``. With partial periodicity (a slab, pbc=(True, True, False))
    the same holds: the non-periodic cell vector is strained too (it places no images, so only the atoms'
    positions along it feel that strain) and V includes it as given. This equals finite differences of the
    energy under that strain and NequIP's calculator. MACECalculator divides the same virial by the volume of
    a cell whose non-periodic vectors it replaces by max|position| * 5 * cutoff along their axis, so its slab
    stress is ours times V / V_mace (about 17x smaller for an 8-molecule, 6.2 Å box); compare virials
    (stress x volume) instead. A structure without a 3-D cell (zero volume) has no stress.

    A NaN or inf in the model's output raises ``NonFiniteOutputError`` (a ValueError) naming the output, the
    first atoms, the closest pair of atoms and any non-finite model parameters (also at the warm-up, so a
    broken model file fails at construction).
    """

    implemented_properties = ["energy", "free_energy", "forces", "stress", "energies"]

    def __init__(
        self,
        model: str | os.PathLike | torch.nn.Module | None = None,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        *,
        skin: float = 1.0,
        head: str | None = None,
        type_map: dict[str, str] | None = None,
        patch: bool | None = None,
        forces_with_energy: bool = True,
        stress_with_forces: bool = False,
        warmup: bool = True,
        cuda_graph: bool | None = None,
        filter_edges: bool | None = None,
        radial_precision: str = "fp32",
        radial_table: bool | None = None,
        streaming: bool | None = None,
        compile: bool | str = False,
        **kwargs: object,
    ) -> None:
        model, dtype, ase_kwargs = _keyword_arguments(model, dtype, kwargs)
        compile_mode = parse_compile(compile)  # the Inductor mode, or None; checked before the model loads
        _check_radial_table(radial_table, radial_precision)  # also before the model loads
        super().__init__(**ase_kwargs)
        self.device = resolve_device(device)
        module = load_model(model, self.device, dtype, patch=self._patch(patch, radial_precision, compile_mode))
        self.patched = _is_patched(module)  # a module given already patched stays so
        for p in module.parameters():
            p.requires_grad_(False)  # inference: autograd tracks positions and strain only
        self.model = module
        self.adapter: ModelAdapter = adapter_for(module, self.device, head=head, type_map=type_map)
        self.dtype = self.adapter.dtype
        self.radial_precision_requested = self._radial_precision(radial_precision)
        self.radial_precision = "fp32"  # the mode in use: decided on the first structure
        self.radial_precision_error: float | None = None
        set_radial_precision(module, "fp32")
        self.radial_table_errors = self._radial_table(radial_table)
        self.radial_table = bool(self.radial_table_errors)
        self.cutoff = self.adapter.cutoff
        self.neighbours = VerletNeighbourList(self.cutoff, skin)
        self.forces_with_energy = bool(forces_with_energy)
        self.stress_with_forces = bool(stress_with_forces)
        # Why edges beyond the cutoff may matter for this model (None: they contribute exactly zero).
        self.inert_edges_reason = self.adapter.inert_beyond_cutoff()
        if streaming not in (None, True, False):
            raise TypeError(f"streaming: expected None, True or False, got {streaming!r}")
        self.streaming_requested = streaming
        self.streaming = False
        self._memory_planned = -1  # the atom count whose memory plan was last made (plan_memory)
        self.memory_plan: MemoryPlan | None = None
        self.expandable_segments = False  # turned on by a plan near a full device (or the user's allocator setting)
        self._graph_off_for_size = False  # plan_memory turned capture off for a box near a full device
        self._rows_planned = -1  # the atom count row chunks were last chosen for (plan_rows)
        if streaming:
            if cuda_graph:
                raise ValueError("cuda_graph=True and streaming=True: the streaming path reads its chunk ranges on "
                                 "the host, so its steps run eagerly")
            self._start_streaming()
            cuda_graph = False
        else:
            self.adapter.set_streaming(None)  # a model given as a module may stream from an earlier calculator
        self.compile = compile_mode
        if self.compile is not None:
            check_compile(self.device, patched=self.patched, streaming=self.streaming)
        self.step = ModelStep(self.adapter, self.neighbours, filter_edges=self._filter_edges(filter_edges),
                              cuda_graph=self._cuda_graph(cuda_graph), compile=self.compile)
        self._cuda_graph_requested = cuda_graph
        self.timings: _Timings | None = None
        self._species: Tensor | None = None
        self._run_species: Tensor | None = None  # _species in the order the model runs in (atom_order)
        self._order: np.ndarray | None = None
        self._pbc: tuple[bool, bool, bool] | None = None
        if warmup:
            self.warm_up()

    def _patch(self, patch: bool | None, radial_precision: str, compile_mode: str | None) -> bool:
        if patch is not None:
            if not isinstance(patch, bool):
                raise TypeError(f"patch: expected None, True or False, got {patch!r}")
            return patch
        # None: the fastest correct path. On CUDA cgforge's kernels; on a CPU the model's own e3nn code, which
        # measured faster there (see the class doc). The TF32 radial modes live in cgforge's layers; compile needs
        # cgforge's patched model.
        return self.device.type == "cuda" or radial_precision != "fp32" or compile_mode is not None

    def _filter_edges(self, filter_edges: bool | None) -> bool:
        if filter_edges is None:
            # Measured (benchmarks/results): cutting the list on the device costs far less than the skin's
            # extra edges cost the model (+59% edges at rc 6 Å, skin 1 Å).
            return True
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
        """Turn the radial tables on or off as asked (None: see the class doc); their (intervals, error)."""
        if radial_table is None:  # the model's dtype: a NequIP adapter feeds FP64 positions to an FP32 model
            radial_table = (self.device.type == "cuda" and self._model_dtype() == torch.float32 and self.patched
                            and self.radial_precision_requested == "fp32" and self.adapter.why_not_tabulated() is None)
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

    def plan_memory(self, n_atoms: int, count_edges: Callable[[], int], streaming: bool = True) -> MemoryPlan | None:
        """Once per system size on CUDA (MD steps pay nothing for it): ``count_edges()`` (it builds the Verlet list
        and counts the edges the model will see) and a choice from the stored path's estimated peak
        (``memory_plan``): streaming for good where it would not fit (with ``streaming=None`` at construction and
        ``streaming`` here), expandable allocator segments where the call comes near a full device. The MD engine
        calls it at its start (without streaming: its step is captured)."""
        if self.device.type != "cuda" or n_atoms == self._memory_planned:
            return self.memory_plan
        self._memory_planned = n_atoms
        free, _ = torch.cuda.mem_get_info(self.device)
        free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)  # torch's cache
        edges = count_edges()
        chunkable = not self.streaming and self.step.compiled is None  # plan_rows' condition
        plan = plan_memory(edges, self.adapter.stored_edge_bytes(n_atoms if chunkable else None), free, n_atoms)
        self.memory_plan = plan
        if plan.expandable and not self.expandable_segments:
            self.expandable_segments = use_expandable_segments()
        if streaming and plan.stream and not self.streaming and self.streaming_requested is None:
            self._switch_to_streaming()
        self._capture_by_size(plan)
        return plan

    def plan_for(self, atoms: Atoms) -> MemoryPlan | None:
        """The memory plan for ``atoms`` as their first call would make it (``plan_memory``; None off CUDA): ``run_md``
        asks before choosing its integrator path, since a box that must stream runs under ASE's dynamics."""
        if len(atoms) == 0:
            raise ValueError("atoms: expected a structure with at least one atom, got an empty Atoms")
        positions, cell = np.asarray(atoms.positions, dtype=np.float64), np.asarray(atoms.cell, dtype=np.float64)
        pbc, species = tuple(bool(p) for p in atoms.pbc), self.adapter.species(atoms.numbers)
        return self.plan_memory(len(atoms), lambda: self.step.prepare(positions, cell, pbc, species))

    def _capture_by_size(self, plan: MemoryPlan) -> None:
        """No CUDA graph for a box near a full device (``plan.capture`` False) unless asked for (``cuda_graph=True``):
        its steps take seconds, so replaying saves little, and the graph's private memory pool is what a 1.03
        M-atom capture ran out of (H100: 19.6 GiB asked with 22.9 GiB held by the pool) before its eager retry;
        back on for a smaller box."""
        if self._cuda_graph_requested is not None or self.streaming:
            return
        if not plan.capture and self.step.cuda_graph:
            self.step.cuda_graph = False
            self.step.invalidate()
            self._graph_off_for_size = True
        elif plan.capture and self._graph_off_for_size:
            self.step.cuda_graph = True
            self._graph_off_for_size = False

    def set_compile(self, compile: bool | str) -> None:
        """Turn ``compile`` (see the class doc) on or off after construction, from the next step on: what
        ``cgforge md --compile auto`` does for a long run once it knows the box fits. The same checks as at
        construction; the memory and row plans are made again (a compiled model's rows are not chunked)."""
        mode = parse_compile(compile)
        if mode is not None:
            check_compile(self.device, patched=self.patched, streaming=self.streaming)
        if mode == self.compile:
            return
        self.compile = mode
        self.step.set_compile(mode)
        self._memory_planned = self._rows_planned = -1

    def compiled_fits(self, atoms: Atoms) -> bool:
        """Whether ``atoms`` leave room for the compiled model on this device: its rows unchunked, its step still
        captured (``memory_plan``: the estimate below ``UNCAPTURED_ABOVE_FRACTION`` of the free memory). False
        off CUDA, when streaming, or for a box that needs row chunks to fit comfortably."""
        plan = self.plan_for(atoms)
        if plan is None or self.streaming:
            return False
        whole_rows = self.adapter.stored_edge_bytes(None)
        return plan_memory(plan.edges, whole_rows, plan.free_bytes, len(atoms)).capture

    def plan_rows(self, n_atoms: int) -> None:
        """Per system size: the stored path makes its widest per-atom rows (a block's convolution output and the
        linear after it) in chunks where ``n_atoms`` need it (``adapter.set_row_chunks``), unless streaming or
        compiled; a captured step is captured again when that changes. The MD engine calls it at its start."""
        if n_atoms == self._rows_planned:
            return
        self._rows_planned = n_atoms
        plain = self.streaming or self.step.compiled is not None
        if self.adapter.set_row_chunks(None if plain else n_atoms):
            self.step.invalidate()

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

    def _cuda_graph(self, cuda_graph: bool | None) -> bool:
        if cuda_graph is None:
            return self.device.type == "cuda" and self.inert_edges_reason is None
        if cuda_graph and self.device.type != "cuda":
            raise ValueError(f"cuda_graph=True needs a CUDA device, got {self.device}")
        if cuda_graph and self.inert_edges_reason is not None:
            raise ValueError("cuda_graph=True pads the edge arrays, which needs a model whose edges beyond the "
                             f"cutoff contribute zero; for this one that is not known: {self.inert_edges_reason}")
        return bool(cuda_graph)

    @property
    def n_edges(self) -> int:
        """Edges the model saw at the last step within the cutoff (all Verlet edges when not filtering)."""
        return self.step.n_edges

    @property
    def cuda_graph(self) -> bool:
        """Whether steps run as CUDA-graph replays (False after a failed capture: see ``step.capture_error``)."""
        return self.step.cuda_graph

    # --- public helpers -------------------------------------------------------------------------

    def record_timings(self, enabled: bool = True) -> None:
        """Start (or stop) a per-phase breakdown in ``self.timings.seconds`` (syncs the device per phase).

        Phases: neighbour_list (staleness check and rebuilds), then model (a CUDA-graph replay) or edges /
        forward / backward (the eager step), and copy_out."""
        self.timings = _Timings(self.device) if enabled else None
        self.step.phase = self.timings.phase if enabled else _no_phase

    def warm_up(self) -> None:
        """Compile every cgforge kernel of the model, then run energy, forces and stress of a tiny periodic
        structure of the model's species (also loads whatever else the first call loads)."""
        model_dtype = next(self.model.parameters()).dtype
        for module in self.model.modules():
            compile_kernels = getattr(module, "compile_kernels", None)
            if callable(compile_kernels) and type(module).__module__.startswith("cgforge."):
                compile_kernels(self.device, model_dtype)
        n = _WARMUP_ATOMS
        spacing = min(1.5, 0.4 * self.cutoff)
        grid = np.stack(np.meshgrid(*[np.arange(2)] * 3, indexing="ij"), -1).reshape(-1, 3)[:n]
        jitter = np.random.default_rng(0).normal(scale=0.05 * spacing, size=(n, 3))
        positions = grid * spacing + jitter
        cell = np.eye(3) * (2 * spacing)
        # A step of its own (eager, its own neighbour list): the calculator's buffers stay untouched.
        step = ModelStep(self.adapter, VerletNeighbourList(self.cutoff, self.neighbours.skin),
                         filter_edges=self.step.filter_edges)
        pbc = (True, True, True)
        host = step.run(positions, cell, pbc, self.adapter.warmup_species(n), forces=True, stress=True, per_atom=True)
        if not np.isfinite(host).all():  # a broken model file shows here, before any user structure
            raise NonFiniteOutputError(self._non_finite_message(
                host, positions, cell, pbc, forces=True, stress=True, per_atom=True,
                what=f"the warm-up structure ({n} atoms about {spacing:.2g} Å apart)"))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # --- ASE interface ----------------------------------------------------------------------------

    def calculate(self, atoms: Atoms | None = None, properties: Sequence[str] = ("energy",),
                  system_changes: Sequence[str] = all_changes) -> None:
        super().calculate(atoms, properties, system_changes)
        atoms = self.atoms
        if atoms is None or len(atoms) == 0:
            raise ValueError("atoms: expected a structure with at least one atom, got an empty Atoms")
        unknown = set(properties) - set(self.implemented_properties)
        if unknown:
            raise PropertyNotImplementedError(f"properties: {sorted(unknown)} not implemented; "
                                              f"available: {self.implemented_properties}")
        if system_changes:
            self.results = {}
        if self._pbc is None or "pbc" in system_changes:
            self._pbc = tuple(bool(p) for p in atoms.pbc)
        if self._species is None or "numbers" in system_changes or self._species.shape[0] != len(atoms):
            self._species = self._run_species = None
            self._species = self.adapter.species(atoms.numbers)
            # a large system runs in a spatial order (atom_order): made once per system, results in the user's
            self._order = spatial_order(atoms.positions, np.asarray(atoms.cell), self._pbc)
            self._run_species = self._species if self._order is None else self._species.index_select(
                0, torch.as_tensor(self._order, device=self._species.device))
        want = set(properties)
        volume = abs(float(atoms.cell.volume))
        # Energy and forces from one run (the backward costs about what the forward does, see the class doc);
        # energies asked of a structure whose forces are known (system_changes empty) need no forces again.
        forces = "forces" in want or (self.forces_with_energy and "forces" not in self.results)
        stress = "stress" in want or (self.stress_with_forces and forces and volume > 0.0)
        if stress and not volume > 0.0:
            raise PropertyNotImplementedError("stress: the cell has zero volume; give the Atoms a 3-D cell")
        self.results.update(self._evaluate(
            atoms.positions, np.asarray(atoms.cell), self._pbc, self._run_species,
            forces=forces or stress, stress=stress, per_atom="energies" in want, volume=volume, order=self._order,
        ))

    # --- the step ---------------------------------------------------------------------------------

    def _check_radial_precision(self, positions: np.ndarray, cell: np.ndarray, pbc: tuple[bool, bool, bool],
                                species: Tensor) -> None:
        """Forces of this structure in FP32 and in the mode asked for; the mode stays only within tolerance."""
        mode = self.radial_precision_requested
        forces = {}
        for m in ("fp32", mode):
            set_radial_precision(self.model, m)
            self.step.invalidate()  # a captured step holds the GEMM kernels it was captured with
            host = self.step.run(positions, cell, pbc, species, forces=True, stress=False, per_atom=False)
            forces[m] = host[1:1 + 3 * positions.shape[0]]
        reference = float(np.linalg.norm(forces["fp32"]))
        error = float(np.linalg.norm(forces[mode] - forces["fp32"])) / max(reference, np.finfo(float).tiny)
        self.radial_precision_error = error
        self.radial_precision = mode if error <= RADIAL_TF32_TOL else "fp32"
        if self.radial_precision != mode:
            set_radial_precision(self.model, "fp32")
            self.step.invalidate()
            warnings.warn(f"cgforge: radial MLPs kept in FP32: {mode} changed the forces by {error:.2e} (relative), "
                          f"more than {RADIAL_TF32_TOL:.0e}", RuntimeWarning, stacklevel=4)

    def _evaluate(self, positions: np.ndarray, cell: np.ndarray, pbc: tuple[bool, bool, bool], species: Tensor,
                  *, forces: bool, stress: bool, per_atom: bool, volume: float = 0.0,
                  order: np.ndarray | None = None) -> dict:
        """Energy (and forces, stress = sym(dE/d strain) / volume, per-atom energies) of one structure. ``order``:
        the atoms' order the model runs in (``atom_order``; ``species`` already in it), None: as given."""
        if not np.isfinite(positions).all():
            raise ValueError("atoms: positions contain NaN or inf")
        user_positions, positions = positions, positions if order is None else positions[order]
        self.plan_memory(positions.shape[0], lambda: self.step.prepare(positions, cell, pbc, species))
        self.plan_rows(positions.shape[0])
        if self.radial_precision_requested != "fp32" and self.radial_precision_error is None:
            self._check_radial_precision(positions, cell, pbc, species)
        try:
            try:
                host = self.step.run(positions, cell, pbc, species, forces=forces, stress=stress, per_atom=per_atom)
            except torch.cuda.OutOfMemoryError:
                if self.streaming or self.streaming_requested is not None or not self._switch_to_streaming():
                    raise
                warnings.warn("cgforge: the stored path ran out of GPU memory for this structure; streaming edges "
                              "from now on (Calculator(streaming=True) chooses it from the start)", stacklevel=3)
                torch.cuda.empty_cache()
                host = self.step.run(positions, cell, pbc, species, forces=forces, stress=stress, per_atom=per_atom)
        except ValueError as err:  # neighbour list: singular cell, cutoff too large for the cell, ...
            if str(err).startswith(("atoms:", "species:")):
                raise
            raise ValueError(f"atoms: {err}") from err
        n, positions = positions.shape[0], user_positions
        if order is not None:
            host = to_user_order(host, order, forces=forces, stress=stress, per_atom=per_atom)
        if not np.isfinite(host).all():  # host arrays: no device sync of its own
            raise NonFiniteOutputError(self._non_finite_message(host, positions, cell, pbc, forces=forces,
                                                                stress=stress, per_atom=per_atom))
        results = {"energy": float(host[0])}
        results["free_energy"] = results["energy"]
        at = 1
        if forces or stress:
            results["forces"] = host[at:at + 3 * n].reshape(n, 3).copy()
            at += 3 * n
            if stress:
                results["stress"] = full_3x3_to_voigt_6_stress(host[at:at + 9].reshape(3, 3) / volume)
                at += 9
        if per_atom:
            results["energies"] = host[at:at + n].copy()
        return results

    def _non_finite_message(self, host: np.ndarray, positions: np.ndarray, cell: np.ndarray,
                            pbc: tuple[bool, bool, bool], *, forces: bool, stress: bool, per_atom: bool,
                            what: str = "this structure") -> str:
        """Which outputs are NaN/inf, on which atoms, the closest pair, the model's parameters; computed only
        after a failure."""
        n = positions.shape[0]
        parts, atoms = [], np.zeros(n, dtype=bool)
        if not np.isfinite(host[0]):
            parts.append(f"energy {host[0]}")
        at = 1
        if forces or stress:
            bad = ~np.isfinite(host[at:at + 3 * n].reshape(n, 3)).all(axis=1)
            at += 3 * n
            if bad.any():
                parts.append(f"forces on {int(bad.sum())} of {n} atoms")
                atoms |= bad
            if stress:
                if not np.isfinite(host[at:at + 9]).all():
                    parts.append("stress")
                at += 9
        if per_atom:
            bad = ~np.isfinite(host[at:at + n])
            if bad.any():
                parts.append(f"per-atom energies of {int(bad.sum())} of {n} atoms")
                atoms |= bad
        lines = [f"model output is not finite for {what}: {', '.join(parts)}"]
        if atoms.any():
            index = np.nonzero(atoms)[0]
            more = ", ..." if index.size > _SHOWN_ATOMS else ""
            lines.append(f"atoms {', '.join(map(str, index[:_SHOWN_ATOMS]))}{more}")
        lines.append(_closest_pair(positions, cell, pbc, self.cutoff))
        broken = _non_finite_parameters(self.model)
        if broken:
            lines.append(f"the model's own parameters hold NaN/inf ({broken}): the model file is broken; "
                         "re-download or re-train it")
        else:
            lines.append("usual causes: atoms on top of each other (or an MD run that blew up before this step), "
                         "or a damaged model file" + ("; if patch=False gives finite numbers here, report it to "
                                                      "cgforge" if self.patched else ""))
        return "; ".join(lines)


def _closest_pair(positions: np.ndarray, cell: np.ndarray, pbc: tuple[bool, bool, bool], within: float) -> str:
    """'closest pair: atoms i and j at d Å' (minimum image, within the model's cutoff)."""
    from ase.neighborlist import primitive_neighbor_list

    if not np.isfinite(positions).all():
        return "positions hold NaN/inf"
    try:
        i, j, d = primitive_neighbor_list("ijd", pbc, cell, positions, within, self_interaction=False)
    except Exception as err:  # noqa: BLE001 - a diagnosis only: never hide the error it is part of
        return f"closest pair not found ({type(err).__name__}: {err})"
    if d.size == 0:
        return f"no two atoms closer than the cutoff, {within:g} Å"
    k = int(np.argmin(d))
    image = " (with its own periodic image)" if i[k] == j[k] else ""
    periodic = " (minimum image)" if any(pbc) else ""
    return f"closest pair: atoms {i[k]} and {j[k]}{image} at {d[k]:.3g} Å{periodic}"


def _is_patched(model: torch.nn.Module) -> bool:
    from cgforge.patches import mace as pm

    if pm.is_mace_model(model):
        return pm.is_patched(model)
    from cgforge.patches import nequip as pn

    return pn.is_patched(model)


def _non_finite_parameters(model: torch.nn.Module) -> str:
    """'name, name, ...' of the parameters and buffers holding NaN or inf ('' when none)."""
    names = [name for name, t in (*model.named_parameters(), *model.named_buffers())
             if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")

