"""The cgforge ASE calculator: MACE or NequIP models with cgforge's kernels, everything on the device.

    from cgforge.plugin import Calculator
    atoms.calc = Calculator("mace")                 # the bundled water model; or a .model/.ckpt/.nequip.zip path
    atoms.calc = Calculator("my.model", device="cuda", dtype="float32")

A thin ASE layer over ``runtime.potential.Potential`` (``calc.potential``): ``calculate`` is one
``Potential.evaluate`` (stress from the virial and the cell's volume), ASE's keywords the runtime's arguments.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from ase import Atoms
from ase.calculators.calculator import Calculator as AseCalculator
from ase.calculators.calculator import PropertyNotImplementedError, all_changes
from ase.stress import full_3x3_to_voigt_6_stress

from .runtime.bundled import LISTED
from .runtime.diagnosis import NonFiniteOutputError  # noqa: F401 (cgforge.plugin's export)
from .runtime.memory_plan import MemoryPlan
from .runtime.options import RuntimeOptions
from .runtime.potential import System, load, resolve_device  # noqa: F401 (resolve_device: the CLI's)

if TYPE_CHECKING:
    from cgforge.kernels.core.tuning import KernelTuning

_ASE_KEYWORDS = ("atoms", "directory", "label")  # handed on to ase's Calculator


def _keyword_arguments(model: object, dtype: object, kwargs: dict) -> tuple[object, object, dict]:
    """(model, dtype, ase's keywords): MACECalculator's spellings mapped to ours, anything unknown refused (ase's
    Calculator would keep a typo as a parameter that does nothing)."""
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
        ours = list(inspect.signature(Calculator).parameters)[:-1]  # all but **kwargs
        raise TypeError(f"Calculator: unknown keyword argument(s) {', '.join(map(repr, unknown))}; it takes "
                        f"{', '.join(ours)} (MACECalculator's model_paths= and default_dtype= mean model= and dtype=) "
                        f"and ase's {', '.join(_ASE_KEYWORDS)}")
    if model is None:
        raise TypeError(f"Calculator: missing model: {LISTED} (a bundled model), a checkpoint path or a MACE/NequIP "
                        "module")
    return model, dtype, kwargs


def _delegate(name: str, doc: str, writable: bool = False) -> property:
    """A property of the calculator that is ``self.potential.<name>``."""
    return property(lambda self: getattr(self.potential, name),
                    (lambda self, value: setattr(self.potential, name, value)) if writable else None, doc=doc)


class Calculator(AseCalculator):
    """ASE calculator for MACE and NequIP models running on cgforge's kernels; docs/calculator.md defines every
    argument. model: as ``runtime.potential.load`` takes it. forces_with_energy: an energy call also computes the
    forces; stress_with_forces: a forces call also the stress. MACECalculator's ``model_paths=`` and
    ``default_dtype=`` mean ``model=`` and ``dtype=``. Stress is sym(dE/d eps) / V (the volume of ``atoms.cell``)."""

    implemented_properties = ["energy", "free_energy", "forces", "stress", "energies"]

    def __init__(self, model: str | os.PathLike | torch.nn.Module | None = None,
                 device: str | torch.device | None = None, dtype: str | torch.dtype | None = None, *,
                 skin: float = 1.0, head: str | None = None, type_map: dict[str, str] | None = None,
                 patch: bool | None = None, forces_with_energy: bool = True, stress_with_forces: bool = False,
                 warmup: bool = True, cuda_graph: bool | None = None, filter_edges: bool | None = None,
                 radial_precision: str = "fp32", radial_table: bool | None = None, streaming: bool | None = None,
                 compile: bool | str = False, options: RuntimeOptions | None = None, workspace: str = "auto",
                 tuning: KernelTuning | None = None, **kwargs: object) -> None:
        model, dtype, ase_kwargs = _keyword_arguments(model, dtype, kwargs)
        super().__init__(**ase_kwargs)
        self.potential = load(  # every argument that needs no model is checked before it loads
            model, device, dtype, patch=patch, radial_precision=radial_precision, radial_table=radial_table,
            compile=compile, tuning=tuning, skin=skin, head=head, type_map=type_map, warmup=warmup,
            cuda_graph=cuda_graph, filter_edges=filter_edges, streaming=streaming, options=options,
            workspace=workspace)
        self.tuning = tuning  # the KernelTuning given (None: the defaults); cgforge md's options line prints it
        self.forces_with_energy = bool(forces_with_energy)
        self.stress_with_forces = bool(stress_with_forces)
        self._system: System | None = None

    # The runtime's state, read through the calculator (scripts and the command line report it).
    model = _delegate("model", "The model (patched in place when ``patched``).")
    adapter = _delegate("adapter", "How the runtime talks to the model's family (``runtime.adapters``).")
    device = _delegate("device", "The device the model runs on.")
    dtype = _delegate("dtype", "The dtype of the positions, cell and edge vectors fed to the model.")
    cutoff = _delegate("cutoff", "The model's cutoff in Å.")
    patched = _delegate("patched", "Whether cgforge's kernels run the model.")
    options = _delegate("options", "The ``RuntimeOptions`` in use.")
    neighbours = _delegate("neighbours", "The Verlet neighbour list (``runtime.neighbours``).")
    step = _delegate("step", "The model step (``runtime.step_graph.ModelStep``).")
    n_edges = _delegate("n_edges", "Edges the model saw at the last step.")
    cuda_graph = _delegate("cuda_graph", "Whether steps run as CUDA-graph replays.")
    compile = _delegate("compile", "The Inductor mode the model is compiled with, or None.")
    streaming = _delegate("streaming", "Whether the convolutions stream their edges.", writable=True)
    memory_plan = _delegate("memory_plan", "The last memory plan (``runtime.memory_plan``; None off CUDA).")
    expandable_segments = _delegate("expandable_segments", "Whether torch's expandable segments are on.")
    inert_edges_reason = _delegate("inert_edges_reason", "Why edges beyond the cutoff may count (None: they don't).")
    radial_precision = _delegate("radial_precision", "The radial-MLP precision in use.")
    radial_precision_requested = _delegate("radial_precision_requested", "The radial-MLP precision asked for.")
    radial_precision_error = _delegate("radial_precision_error", "The forces' relative change in that precision.")
    radial_table = _delegate("radial_table", "Whether the radial tables are in use.")
    radial_table_errors = _delegate("radial_table_errors", "(intervals, error) of each radial table.")
    timings = _delegate("timings", "The per-phase breakdown (``record_timings``), or None.")
    record_timings = _delegate("record_timings", "``Potential.record_timings(enabled=True)``: fill ``timings``.")
    plan_rows = _delegate("plan_rows", "``Potential.plan_rows(n_atoms)``.")
    set_compile = _delegate("set_compile", "``Potential.set_compile(compile)``: compile (or stop) from the next step.")

    @property
    def system(self) -> System | None:
        """What the potential keeps of the current system (``Potential.system``), or None before the first call."""
        return self._system

    def uses_tiles(self, atoms: Atoms) -> bool:
        """Whether this calculator evaluates ``atoms`` in tiles (``workspace``; decided once per atom count)."""
        return self.potential.workspace.uses_tiles(atoms.positions, np.asarray(atoms.cell), _pbc(atoms))

    def plan_for(self, atoms: Atoms) -> MemoryPlan | None:
        """The memory plan for ``atoms`` as their first call would make it (None off CUDA)."""
        return self.potential.plan_for(atoms.positions, np.asarray(atoms.cell), _pbc(atoms), atoms.numbers)

    def compiled_fits(self, atoms: Atoms) -> bool:
        """Whether ``atoms`` leave room for the compiled model on this device (``Potential.compiled_fits``)."""
        return self.potential.compiled_fits(atoms.positions, np.asarray(atoms.cell), _pbc(atoms), atoms.numbers)

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
        pbc, cell = _pbc(atoms), np.asarray(atoms.cell)
        if self._system is None or "numbers" in system_changes or self._system.n_atoms != len(atoms):
            self._system = None
            # made once per system: the species and, for a large system, the order it runs in
            self._system = self.potential.system(atoms.numbers, atoms.positions, cell, pbc)
        want = set(properties)
        volume = abs(float(atoms.cell.volume))
        # Energy and forces from one run; energies asked of a structure whose forces are known (system_changes
        # empty) need no forces again.
        forces = "forces" in want or (self.forces_with_energy and "forces" not in self.results)
        stress = "stress" in want or (self.stress_with_forces and forces and volume > 0.0)
        if stress and not volume > 0.0:
            raise PropertyNotImplementedError("stress: the cell has zero volume; give the Atoms a 3-D cell")
        out = self.potential.evaluate(atoms.positions, cell, pbc, self._system, forces=forces or stress,
                                      stress=stress, per_atom="energies" in want)
        self.results["energy"] = self.results["free_energy"] = out.energy
        if out.forces is not None:
            self.results["forces"] = out.forces
        if out.virial is not None:
            self.results["stress"] = full_3x3_to_voigt_6_stress(out.virial / volume)
        if out.energies is not None:
            self.results["energies"] = out.energies


def _pbc(atoms: Atoms) -> tuple[bool, bool, bool]:
    return tuple(bool(p) for p in atoms.pbc)
