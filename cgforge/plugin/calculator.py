"""The cgforge ASE calculator: MACE or NequIP models with cgforge's kernels, everything on the device.

    from cgforge.plugin import Calculator
    atoms.calc = Calculator("mace")                 # the bundled water model; or a .model/.ckpt/.nequip.zip path
    atoms.calc = Calculator("my.model", device="cuda", dtype="float32")

Per step the host sends positions and receives energy and forces, one copy each way; the neighbour list
(``VerletNeighbourList``, on the device, with a skin) is rebuilt only when an atom moved more than half the
skin; the model inputs are built as device tensors. The model is called for its energy only and the
calculator differentiates it:

    E(x, eps) = model(positions (I + eps), cell (I + eps)),  forces = -dE/dx,  stress = sym(dE/d eps) / V

at eps = 0. The strain enters only when stress is asked for, and the cell as one [3, 3] matrix (edge shifts
are ``unit_shifts @ cell``, a matmul): the stress costs one extra small GEMM in the backward, never a
gather over repeated indices. Properties not asked for are not computed (energy-only calls run without
autograd).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from ase import Atoms
from ase.calculators.calculator import Calculator as AseCalculator
from ase.calculators.calculator import PropertyNotImplementedError, all_changes
from ase.stress import full_3x3_to_voigt_6_stress
from torch import Tensor

from .inputs import ModelAdapter, adapter_for, is_nequip_model
from .neighbours import VerletNeighbourList

__all__ = ["Calculator", "load_model", "resolve_device", "BUNDLED"]

BUNDLED = ("mace", "nequip")
_WARMUP_ATOMS = 8


def resolve_device(device: str | torch.device | None) -> torch.device:
    """None: cuda when available, else cpu. A cuda device on a machine without one is a clear error."""
    from cgforge.patches.mace import parse_device

    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return parse_device(device)


def _bundled_path(name: str) -> Path:
    try:
        from cgforge.plugin.bundled import model_path
    except ImportError as err:
        raise FileNotFoundError(
            f"model: the bundled {name!r} model is not available in this installation ({err}); "
            "pass a checkpoint path (.model, .ckpt, .nequip.zip) instead"
        ) from err
    path = Path(model_path(name))
    if not path.is_file():
        raise FileNotFoundError(f"model: the bundled {name!r} model file {path} is missing")
    return path


def load_model(model: str | os.PathLike | torch.nn.Module, device: torch.device,
               dtype: str | torch.dtype | None = None, *, patch: bool = True) -> torch.nn.Module:
    """A ready MACE or NequIP model on ``device``: bundled name, checkpoint path or module (patched in place)."""
    from cgforge import patches
    from cgforge.patches.mace import is_mace_model, parse_dtype

    dtype = parse_dtype(dtype)
    if isinstance(model, str) and model.lower() in BUNDLED:
        model = _bundled_path(model.lower())
    if isinstance(model, str | os.PathLike):
        return _load_file(Path(model), device, dtype, patch)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"model: expected 'mace', 'nequip', a checkpoint path or a MACE/NequIP torch module, "
            f"got {type(model).__name__}"
        )
    if is_mace_model(model):
        patches.mace.upgrade_old_attributes(model)
        if patch:
            patches.patch(model)
        if dtype is not None:
            model.to(dtype=dtype)
        return model.to(device)
    if is_nequip_model(model):
        from cgforge.patches import nequip as pn

        pn._check_dtype(model, dtype)
        model.eval().to(device)
        return pn.patch(model) if patch else model
    adapter_for(model, device)  # raises the TypeError naming what was given
    return model


def _load_file(path: Path, device: torch.device, dtype: torch.dtype | None, patch: bool) -> torch.nn.Module:
    from cgforge import patches

    if not path.exists():
        raise FileNotFoundError(f"model: checkpoint {path} not found")
    if path.is_dir():
        raise IsADirectoryError(f"model: {path} is a directory, expected a checkpoint file")
    kind = patches.checkpoint_kind(path)
    try:
        if kind == "nequip":
            from cgforge.patches import nequip as pn

            model = pn.load_nequip(path, device=device, dtype=dtype)
            return model if patch else pn.unpatch(model)
        return patches.mace.load_mace(path, device=device, dtype=dtype, patched=patch)
    except (ValueError, TypeError, OSError):
        raise
    except Exception as err:  # a corrupt file fails deep inside torch.load / pickle
        raise ValueError(f"model: could not load {path} as a {kind} checkpoint ({type(err).__name__}: {err})") \
            from err


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
def _nothing() -> Iterator[None]:
    yield


class Calculator(AseCalculator):
    """ASE calculator for MACE and NequIP models running on cgforge's kernels.

    model: ``"mace"`` / ``"nequip"`` (the bundled water models), a MACE ``.model`` or NequIP ``.ckpt`` /
    ``.nequip.zip`` path, or a MACE / NequIP module (patched in place, its parameters frozen).
    device: None picks cuda when available, else cpu. dtype: None keeps the model's.
    skin: Verlet skin in Å (the list holds pairs within cutoff + skin and is rebuilt when an atom moved
    more than skin/2). head: MACE head (multi-head models). type_map: NequIP {chemical symbol: type name}
    for types that are not chemical symbols. patch: False runs the model's own kernels (for comparisons).
    stress_with_forces: also compute the stress whenever forces are computed (for NPT integrators that ask
    for forces and stress in separate calls; costs one small GEMM more in the backward).
    warmup: run the model once at construction so kernels compile now, not in the first MD step.
    """

    implemented_properties = ["energy", "free_energy", "forces", "stress", "energies"]

    def __init__(
        self,
        model: str | os.PathLike | torch.nn.Module,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        *,
        skin: float = 1.0,
        head: str | None = None,
        type_map: dict[str, str] | None = None,
        patch: bool = True,
        stress_with_forces: bool = False,
        warmup: bool = True,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        self.device = resolve_device(device)
        module = load_model(model, self.device, dtype, patch=patch)
        for p in module.parameters():
            p.requires_grad_(False)  # inference: autograd tracks positions and strain only
        self.model = module
        self.adapter: ModelAdapter = adapter_for(module, self.device, head=head, type_map=type_map)
        self.dtype = self.adapter.dtype
        self.cutoff = self.adapter.cutoff
        self.neighbours = VerletNeighbourList(self.cutoff, skin)
        self.stress_with_forces = bool(stress_with_forces)
        self.timings: _Timings | None = None
        self.n_edges = 0
        self._species: Tensor | None = None
        self._cell: Tensor | None = None
        self._pbc: tuple[bool, bool, bool] | None = None
        if warmup:
            self.warm_up()

    # --- public helpers -------------------------------------------------------------------------

    def record_timings(self, enabled: bool = True) -> None:
        """Start (or stop) a per-phase breakdown in ``self.timings.seconds`` (syncs the device per phase)."""
        self.timings = _Timings(self.device) if enabled else None

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
        positions = torch.as_tensor(grid * spacing + jitter, dtype=self.dtype).to(self.device)
        cell = torch.eye(3, dtype=self.dtype, device=self.device) * (2 * spacing)
        saved = self.neighbours
        self.neighbours = VerletNeighbourList(self.cutoff, saved.skin)
        try:
            self._evaluate(positions, cell, (True, True, True), self.adapter.warmup_species(n),
                           forces=True, stress=True, per_atom=True, volume=(2 * spacing) ** 3)
        finally:
            self.neighbours = saved
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
        if self._species is None or "numbers" in system_changes or self._species.shape[0] != len(atoms):
            self._species = None
            self._species = self.adapter.species(atoms.numbers)
        if self._cell is None or "cell" in system_changes or "pbc" in system_changes:
            self._cell = torch.as_tensor(np.asarray(atoms.cell), dtype=self.dtype).to(self.device)
            self._pbc = tuple(bool(p) for p in atoms.pbc)
        positions = torch.as_tensor(atoms.positions, dtype=self.dtype).to(self.device)
        want = set(properties)
        volume = abs(float(atoms.cell.volume))
        stress = "stress" in want or (self.stress_with_forces and "forces" in want and volume > 0.0)
        if stress and not volume > 0.0:
            raise PropertyNotImplementedError("stress: the cell has zero volume; give the Atoms a 3-D cell")
        self.results.update(self._evaluate(
            positions, self._cell, self._pbc, self._species,
            forces="forces" in want or stress, stress=stress, per_atom="energies" in want, volume=volume,
        ))

    # --- the step ---------------------------------------------------------------------------------

    def _phase(self, name: str):
        return self.timings.phase(name) if self.timings is not None else _nothing()

    def _edges(self, positions: Tensor, cell: Tensor, pbc: tuple[bool, bool, bool]
               ) -> tuple[Tensor, Tensor, Tensor]:
        """(sender, receiver, unit shifts) of the pairs within the cutoff now, from the skin list."""
        nl = self.neighbours
        try:
            nl.update(positions, cell, pbc)
        except ValueError as err:
            raise ValueError(f"atoms: {err}") from err
        with torch.no_grad():
            _, _, inside = nl.edges(positions, cell)
            keep = torch.nonzero(inside).squeeze(1)
        self.n_edges = keep.numel()
        return nl.sender.index_select(0, keep), nl.receiver.index_select(0, keep), nl.shifts.index_select(0, keep)

    def _evaluate(self, positions: Tensor, cell: Tensor, pbc: tuple[bool, bool, bool], species: Tensor, *,
                  forces: bool, stress: bool, per_atom: bool, volume: float = 0.0) -> dict:
        """Energy (and forces, stress = sym(dE/d strain) / volume, per-atom energies) of one structure."""
        with self._phase("neighbour_list"):
            sender, receiver, unit_shifts = self._edges(positions, cell, pbc)
        grad = forces or stress
        with torch.set_grad_enabled(grad):
            pos = positions.detach().requires_grad_(grad)
            strain = None
            if stress:
                strain = torch.zeros(3, 3, dtype=pos.dtype, device=pos.device, requires_grad=True)
                deform = torch.eye(3, dtype=pos.dtype, device=pos.device) + strain
                pos_in, cell_in = pos @ deform, cell @ deform
            else:
                pos_in, cell_in = pos, cell
            with self._phase("forward"):
                energy, energies = self.adapter.energy(pos_in, cell_in, species, sender, receiver, unit_shifts,
                                                       per_atom)
            parts = [energy.detach().reshape(1)]
            if grad:
                with self._phase("backward"):
                    inputs = [pos] if strain is None else [pos, strain]
                    grads = torch.autograd.grad(energy, inputs, allow_unused=True)
                gradient = grads[0] if grads[0] is not None else torch.zeros_like(pos)
                parts.append(-gradient.reshape(-1))
                if strain is not None:
                    virial = grads[1] if grads[1] is not None else torch.zeros_like(strain)
                    parts.append((0.5 * (virial + virial.T)).reshape(-1))
            if per_atom:
                parts.append(energies.detach().reshape(-1))
        # One device-to-host copy for everything asked for.
        with self._phase("copy_out"):
            host = torch.cat([p.to(torch.float64) for p in parts]).cpu().numpy()
        n = positions.shape[0]
        results = {"energy": float(host[0])}
        results["free_energy"] = results["energy"]
        at = 1
        if grad:
            results["forces"] = host[at:at + 3 * n].reshape(n, 3).copy()
            at += 3 * n
            if stress:
                results["stress"] = full_3x3_to_voigt_6_stress(host[at:at + 9].reshape(3, 3) / volume)
                at += 9
        if per_atom:
            results["energies"] = host[at:at + n].copy()
        return results
