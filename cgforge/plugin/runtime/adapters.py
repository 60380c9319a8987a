"""How the runtime talks to a model family: the ``ModelAdapter`` protocol and ``adapter_for``.

An adapter turns (edge vectors, edges, species) into one model's energy; the runtime owns positions, strain, the
neighbour list and autograd. The adapters live with their family (``cgforge.patches.mace.adapter``,
``cgforge.patches.nequip.adapter``) and are made by the family registry, ``cgforge.patches.families``. Edge vectors
follow ``runtime.neighbours``: ``vector = positions[receiver] - positions[sender] + S @ cell``. Only a model whose
edges beyond the cutoff are inert (``inert_beyond_cutoff``) may be fed the whole Verlet list or padded edges.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from cgforge.patches import families
from cgforge.patches.common import UnknownElementError

__all__ = ["ModelAdapter", "adapter_for", "UnknownElementError"]


class ModelAdapter(Protocol):
    kind: str  # "mace" or "nequip"
    model: torch.nn.Module
    cutoff: float
    dtype: torch.dtype  # dtype of positions, cell and edge vectors fed to the model
    device: torch.device
    n_species: int
    hops: int  # message-passing layers: an atom's energy depends only on atoms within hops x cutoff (``tiled``)

    def species(self, numbers: np.ndarray) -> Tensor:
        """The model's per-atom species input on the device from atomic numbers (unknown ones raise): MACE's one-hot
        ``node_attrs`` [N, n_species], NequIP's ``atom_types`` [N] int64."""

    def warmup_species(self, n: int) -> Tensor:
        """The same for n atoms cycling over the model's species (a structure for compiling kernels)."""

    def species_index(self, species: Tensor) -> Tensor:
        """[N] int64 species index of each atom, from what ``species`` returned."""

    def species_from_index(self, index: Tensor) -> Tensor:
        """The inverse of ``species_index``: the species input from [N] integer indices into the model's
        species (MACE: ``model.atomic_numbers`` order; NequIP: its type names), on the device."""

    sender_row: int  # the row of the model's edge_index holding senders (the other holds receivers)

    def energy(self, positions: Tensor, vectors: Tensor, species: Tensor, edge_index: Tensor,
               per_atom: bool) -> tuple[Tensor, Tensor | None]:
        """(total energy as a 0-d tensor, per-atom energies [N] or None) of positions [N, 3], edge vectors [E, 3]
        (both strained when stress is asked for) and edge_index [2, E] in the model's orientation (``edge_index``)."""

    def edge_index(self, sender: Tensor, receiver: Tensor) -> Tensor:
        """The model's [2, E] edge_index: rows ``sender_row`` = sender and ``1 - sender_row`` = receiver."""

    def inert_beyond_cutoff(self) -> str | None:
        """None when edges at or beyond the cutoff contribute exactly zero (and zero derivative) to the energy,
        else why that is not known for this model."""

    def stored_edge_bytes(self, n_atoms: int | None = None) -> int:
        """Peak bytes per edge of the model's stored-path force call for ``n_atoms`` atoms (None: any size; 0: not
        known)."""

    def set_streaming(self, budget_bytes: int | None) -> int:
        """Compute per-edge weights chunk by chunk (chunks sized to ``budget_bytes``), or stop (None); the
        number of layers that stream (0: none can)."""

    def set_row_chunks(self, n_atoms: int | None) -> bool:
        """Make the stored path's widest per-atom rows in chunks where ``n_atoms`` atoms need it (None: never);
        True when that changed the model (a captured step must be captured again)."""

    def message_layers(self) -> list[torch.nn.Module]:
        """The model's message-passing layers in call order (MACE's interaction blocks, NequIP's ConvNetLayers):
        where a caller that splits the atoms between processes exchanges the ghosts' features (LAMMPS)."""

    def why_not_tabulated(self) -> str | None:
        """None when every layer's weights can be read from tables of the edge length, else the reason."""

    def set_radial_table(self, on: bool) -> list[tuple[int, float]]:
        """Read each layer's weights from a table of the edge length (``on``), or from its radial MLP again;
        the (intervals, measured relative error) of each table in use. Raises ValueError when it cannot."""


def adapter_for(model: torch.nn.Module, device: torch.device, *, head: str | None = None,
                type_map: dict[str, str] | None = None) -> ModelAdapter:
    """The adapter of ``model`` on ``device`` (``families.family_of(model).adapter``): ``head`` is MACE's, ``type_map``
    NequIP's {chemical symbol: type name}; an option of the other family raises ValueError."""
    return families.family_of(model).adapter(model, device, head=head, type_map=type_map)
