"""Model inputs built directly as device tensors, and the energy of one structure.

Each adapter turns (edge vectors, edges, species) into the energy of one model, with no data objects,
loaders or host round trips. The calculator owns positions, strain, neighbour list, edge vectors and
autograd; an adapter only knows how its model wants the graph:

- MACE: the dict ``MACE.forward`` takes (``node_attrs`` one-hot over ``model.atomic_numbers``, ``edge_index``
  = [sender, receiver], ``batch``, ``ptr``, ``head``, ...), called with every force/stress option off: the
  model returns the energy only and the calculator differentiates it. MACE computes
  ``vector = positions[receiver] - positions[sender] + shifts`` itself; it gets ``positions`` = zeros and
  ``shifts`` = the calculator's edge vectors, so the vectors are exactly ours and the model's gathers of
  ``positions`` (advanced indexing, whose backward is a sort-based accumulation) sit off the gradient path.
- NequIP: an AtomicDataDict with ``edge_vectors`` already filled in, given to the energy model inside the
  ``ForceStressOutput`` wrapper (whose own displacement/stress machinery is skipped).

Edge vectors follow ``cgforge.plugin.neighbours``: ``vector = positions[receiver] - positions[sender] + S @ cell``.

``inert_beyond_cutoff()`` says whether edges longer than the cutoff contribute exactly zero, with zero
derivative, to the model's energy (checked per model, see the adapters). Only then may the calculator feed
the model its whole Verlet list or pad the edge arrays (CUDA-graph capture).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch
from ase.data import atomic_numbers as _SYMBOL_TO_Z
from ase.data import chemical_symbols
from torch import Tensor

from cgforge.patches.graph_cache import CallGraphCache

from .inert_edges import mace_inert_beyond_cutoff, nequip_inert_beyond_cutoff

__all__ = ["ModelAdapter", "MaceAdapter", "NequipAdapter", "adapter_for", "UnknownElementError"]


class UnknownElementError(ValueError):
    """The structure holds elements the model was not trained on."""


class ModelAdapter(Protocol):
    kind: str  # "mace" or "nequip"
    model: torch.nn.Module
    cutoff: float
    dtype: torch.dtype  # dtype of positions, cell and edge vectors fed to the model
    device: torch.device
    n_species: int

    def species(self, numbers: np.ndarray) -> Tensor:
        """The per-atom species input of the model, on the device, from atomic numbers (unknown ones raise).

        MACE: one-hot ``node_attrs`` [N, n_species] in the model dtype; NequIP: ``atom_types`` [N] int64.
        """

    def warmup_species(self, n: int) -> Tensor:
        """The same for n atoms cycling over the model's species (a structure for compiling kernels)."""

    def species_index(self, species: Tensor) -> Tensor:
        """[N] int64 species index of each atom, from what ``species`` returned."""

    sender_row: int  # the row of the model's edge_index holding senders (the other holds receivers)

    def energy(self, positions: Tensor, vectors: Tensor, species: Tensor, edge_index: Tensor,
               per_atom: bool) -> tuple[Tensor, Tensor | None]:
        """(total energy as a 0-d tensor, per-atom energies [N] or None).

        positions [N, 3] (strained when stress is asked for), vectors [E, 3] (``pos[receiver] - pos[sender] +
        S @ cell``, strained alike), edge_index [2, E] in the model's orientation (see ``edge_index``).
        """

    def edge_index(self, sender: Tensor, receiver: Tensor) -> Tensor:
        """The model's [2, E] edge_index: rows ``sender_row`` = sender and ``1 - sender_row`` = receiver."""

    def inert_beyond_cutoff(self) -> str | None:
        """None when edges at or beyond the cutoff contribute exactly zero (and zero derivative) to the energy,
        else why that is not known for this model."""


def _unknown(numbers: np.ndarray, known: np.ndarray, model_elements: list[str]) -> UnknownElementError:
    missing = sorted({int(z) for z in np.unique(numbers[~known])})
    names = ", ".join(chemical_symbols[z] if 0 < z < len(chemical_symbols) else f"Z={z}" for z in missing)
    return UnknownElementError(
        f"atoms: element(s) {names} not known to the model, which knows {', '.join(model_elements)}"
    )


def _check_numbers(numbers: np.ndarray) -> np.ndarray:
    numbers = np.asarray(numbers)
    if numbers.ndim != 1 or numbers.size == 0:
        raise ValueError(f"atoms: expected a non-empty structure, got {numbers.size} atoms")
    return numbers.astype(np.int64, copy=False)


# ---------------------------------------------------------------------------------------------
# MACE


class MaceAdapter:
    kind = "mace"
    sender_row = 0

    def __init__(self, model: torch.nn.Module, device: torch.device, head: str | None = None) -> None:
        self.model = model
        self.device = device
        self.dtype = next(model.parameters()).dtype
        self.cutoff = float(model.r_max)
        elements = [int(z) for z in model.atomic_numbers.tolist()]
        self.elements = elements
        self.n_species = len(elements)
        table = np.full(max(elements + [118]) + 1, -1, dtype=np.int64)
        table[elements] = np.arange(len(elements))
        self._table = table
        heads = list(getattr(model, "heads", None) or ["Default"])
        self.head = _choose_head(heads, head)
        self._head_index = torch.tensor([heads.index(self.head)], device=device)
        self._per_size: dict[int, tuple[Tensor, Tensor]] = {}

    def species(self, numbers: np.ndarray) -> Tensor:
        numbers = _check_numbers(numbers)
        inside = (numbers >= 0) & (numbers < len(self._table))
        index = np.where(inside, self._table[np.clip(numbers, 0, len(self._table) - 1)], -1)
        if (index < 0).any():
            raise _unknown(numbers, index >= 0, [chemical_symbols[z] for z in self.elements])
        return self._one_hot(torch.as_tensor(index, device=self.device))

    def warmup_species(self, n: int) -> Tensor:
        return self._one_hot(torch.arange(n, device=self.device) % self.n_species)

    def species_index(self, species: Tensor) -> Tensor:
        return species.argmax(dim=1)

    def _one_hot(self, index: Tensor) -> Tensor:
        return torch.nn.functional.one_hot(index, self.n_species).to(self.dtype)

    def _per_structure(self, n_atoms: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        # One structure: batch all zeros, ptr [0, N], zero positions and cell. Cached per size: no allocation
        # per step (and fixed addresses for a captured step).
        if n_atoms not in self._per_size:
            kw = {"dtype": torch.int64, "device": self.device}
            self._per_size = {n_atoms: (torch.zeros(n_atoms, **kw), torch.tensor([0, n_atoms], **kw),
                                        torch.zeros(n_atoms, 3, dtype=self.dtype, device=self.device),
                                        torch.zeros(3, 3, dtype=self.dtype, device=self.device))}
        return self._per_size[n_atoms]

    def edge_index(self, sender: Tensor, receiver: Tensor) -> Tensor:
        return torch.stack([sender, receiver])

    def energy(self, positions: Tensor, vectors: Tensor, species: Tensor, edge_index: Tensor,
               per_atom: bool) -> tuple[Tensor, Tensor | None]:
        batch, ptr, zeros, cell = self._per_structure(positions.shape[0])
        # MACE sets requires_grad on data["positions"] and gathers it per edge; zeros (a leaf that no
        # gradient is asked of) keep that gather off the backward. vectors = 0 - 0 + shifts, exactly.
        data = {
            "positions": zeros,
            "node_attrs": species,
            "edge_index": edge_index,
            "shifts": vectors,
            "unit_shifts": cell[0].expand(vectors.shape[0], 3),  # read only for MACE's own stress: not asked
            "cell": cell,
            "batch": batch,
            "ptr": ptr,
            "head": self._head_index,
        }
        out = self.model(data, training=False, compute_force=False, compute_virials=False,
                         compute_stress=False, compute_displacement=False)
        # The total as a plain sum of the per-atom energies: MACE's own total is a scatter_sum over `batch` (atomics
        # on CUDA), whose last bits change from run to run; torch.sum reduces in a fixed order.
        node_energy = out.get("node_energy")
        energy = out["energy"].sum() if node_energy is None else node_energy.sum()
        return energy, node_energy if per_atom else None

    def inert_beyond_cutoff(self) -> str | None:
        return mace_inert_beyond_cutoff(self.model)


def _choose_head(heads: list[str], head: str | None) -> str:
    if head is not None:
        if head not in heads:
            raise ValueError(f"head: {head!r} is not a head of this model; it has {heads}")
        return head
    if len(heads) == 1:
        return heads[0]
    default = [h for h in heads if h.lower() == "default"]
    if default:
        return default[0]
    raise ValueError(f"head: this model has several heads {heads}; pass head=... to choose one")


# ---------------------------------------------------------------------------------------------
# NequIP


class NequipAdapter:
    kind = "nequip"
    sender_row = 1  # nequip: edge_index[0] is the centre (receives messages), edge_index[1] the neighbour

    def __init__(self, model: torch.nn.Module, device: torch.device,
                 type_map: dict[str, str] | None = None) -> None:
        metadata = model.metadata
        self.model = model
        self.device = device
        self.type_names = metadata["type_names"].split(" ")
        self.n_species = len(self.type_names)
        self.cutoff = float(metadata["r_max"])
        # nequip's own calculator feeds float64 positions whatever the model dtype (the model casts after
        # the edge geometry): do the same, so FP32 models see the same edge lengths.
        self.dtype = torch.float64
        self.energy_model = _nequip_energy_model(model)
        table = np.full(119, -1, dtype=np.int64)
        for symbol, type_name in self._symbol_to_type(type_map).items():
            table[_SYMBOL_TO_Z[symbol]] = self.type_names.index(type_name)
        self._table = table

    def _symbol_to_type(self, type_map: dict[str, str] | None) -> dict[str, str]:
        if type_map is None:
            # Default: type names that are chemical symbols map to themselves.
            return {name: name for name in self.type_names if name in _SYMBOL_TO_Z}
        if not isinstance(type_map, dict):
            raise TypeError(f"type_map: expected a dict chemical symbol -> type name, got {type(type_map).__name__}")
        for symbol, name in type_map.items():
            if symbol not in _SYMBOL_TO_Z:
                raise ValueError(f"type_map: {symbol!r} is not a chemical symbol")
            if name not in self.type_names:
                raise ValueError(f"type_map: {name!r} is not a type of this model; types are {self.type_names}")
        return dict(type_map)

    def species(self, numbers: np.ndarray) -> Tensor:
        numbers = _check_numbers(numbers)
        inside = (numbers >= 0) & (numbers < len(self._table))
        index = np.where(inside, self._table[np.clip(numbers, 0, len(self._table) - 1)], -1)
        if (index < 0).any():
            known = [chemical_symbols[z] for z in np.nonzero(self._table >= 0)[0]]
            err = _unknown(numbers, index >= 0, known or ["(no chemical symbols)"])
            if len(known) < self.n_species:
                err = UnknownElementError(f"{err}; model types are {self.type_names}: pass type_map="
                                          "{symbol: type name} for types that are not chemical symbols")
            raise err
        return torch.as_tensor(index, device=self.device)

    def warmup_species(self, n: int) -> Tensor:
        return torch.arange(n, device=self.device) % self.n_species

    def species_index(self, species: Tensor) -> Tensor:
        return species

    def edge_index(self, sender: Tensor, receiver: Tensor) -> Tensor:
        return torch.stack([receiver, sender])

    def energy(self, positions: Tensor, vectors: Tensor, species: Tensor, edge_index: Tensor,
               per_atom: bool) -> tuple[Tensor, Tensor | None]:
        # nequip: edge_index[0] is the centre, vector = pos[index[1]] - pos[index[0]]. Our list holds every pair
        # in both directions, so (receiver -> sender, -vector) is the same edge set with the centres already
        # sorted, as the fused convolution's CSR order wants.
        data = {
            "pos": positions,
            "atom_types": species,
            "edge_index": edge_index,
            "edge_vectors": -vectors,
        }
        # The patched model empties its per-call graph cache in a forward pre-hook of the GraphModel, which
        # calling the inner energy model skips: empty it here.
        for hook in self.model._forward_pre_hooks.values():
            if isinstance(hook, CallGraphCache):
                hook.clear()
        out = self.energy_model(data)
        atomic = out.get("atomic_energy")  # its plain sum: nequip's total is a scatter (atomics on CUDA)
        energy = out["total_energy"].sum() if atomic is None else atomic.sum()
        return energy, atomic.reshape(-1) if per_atom and atomic is not None else None

    def inert_beyond_cutoff(self) -> str | None:
        return nequip_inert_beyond_cutoff(self.energy_model)


def _nequip_energy_model(model: torch.nn.Module) -> torch.nn.Module:
    """The energy model inside nequip's ForceStressOutput (matched by class name: packaged classes differ)."""
    inner = getattr(model, "model", None)
    if inner is not None and type(inner).__name__ == "ForceStressOutput" and hasattr(inner, "func"):
        return inner.func
    raise ValueError(
        f"model: expected a nequip GraphModel wrapping a ForceStressOutput energy model, found "
        f"{type(inner).__name__ if inner is not None else 'no .model'}; cgforge's calculator differentiates the "
        "energy itself"
    )


def adapter_for(model: torch.nn.Module, device: torch.device, *, head: str | None = None,
                type_map: dict[str, str] | None = None) -> ModelAdapter:
    from cgforge.patches.mace import is_mace_model

    if is_mace_model(model):
        if type_map is not None:
            raise ValueError("type_map: only for NequIP models (MACE maps atomic numbers itself)")
        return MaceAdapter(model, device, head)
    if is_nequip_model(model):
        if head is not None:
            raise ValueError("head: only for MACE models")
        return NequipAdapter(model, device, type_map)
    cls = type(model)
    raise TypeError(f"model: expected a MACE or NequIP model, got {cls.__module__}.{cls.__qualname__}")


def is_nequip_model(model: object) -> bool:
    if not isinstance(model, torch.nn.Module) or not getattr(model, "is_graph_model", False):
        return False
    try:
        metadata = model.metadata
    except AttributeError:
        return False
    return isinstance(metadata, dict) and "type_names" in metadata and "r_max" in metadata


