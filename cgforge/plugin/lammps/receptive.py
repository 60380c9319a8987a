"""Ghost mode's receptive field: the pairs and atoms that can change the listed atoms' energies.

In ghost-neighbour mode LAMMPS hands over every atom within layers x cutoff (plus the skin) of the domain, and the
pairs of all of them. A message-passing model of L layers sums, at a receiver, messages from its senders' features
of the layer before; so the listed atoms' energies read only the edges whose receiver lies within L - 1 hops of a
listed atom, and the features of those edges' senders. Every other pair's ``fij = dE/drij`` is exactly zero.
``receptive_field`` finds that subgraph; the eager ghost-mode call runs the model on it alone, which on a small
domain (many ghosts per local atom) cuts most of the pairs and nodes, and with them the call's memory and time. The
padded step (``captured``) makes the same cut on the device, without host reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["ReceptiveField", "receptive_field"]


@dataclass(frozen=True)
class ReceptiveField:
    """The part of one call's graph the listed atoms' energies depend on."""

    pairs: Tensor  # int64 [kept]: the kept pairs' indices in LAMMPS's list, ascending
    atoms: Tensor  # int64 [nodes]: the LAMMPS atom of each node, ascending
    node_of: Tensor  # int64 [ntotal]: each atom's node, -1 for atoms left out


def receptive_field(centre: Tensor, neighbour: Tensor, listed: Tensor, ntotal: int,
                    layers: int) -> ReceptiveField | None:
    """The pairs (edges ``neighbour -> centre``) whose centre is within ``layers - 1`` hops of a ``listed`` atom, and
    the atoms those pairs and the listed atoms touch; None when that is every pair and every atom (nothing to cut).
    A hop goes from a pair's centre to its neighbour: the way a layer's messages come in."""
    if layers < 1:
        raise ValueError(f"layers: expected at least 1, got {layers}")
    near = torch.zeros(ntotal, dtype=torch.bool, device=centre.device)
    near[listed] = True
    for _ in range(layers - 1):
        near = near.index_fill(0, neighbour[near[centre]], True)
    kept = near[centre]
    touched = near.index_fill(0, neighbour[kept], True)
    if bool(kept.all()) and bool(touched.all()):
        return None
    atoms = touched.nonzero().squeeze(1)
    node_of = torch.full((ntotal,), -1, dtype=torch.int64, device=centre.device)
    node_of[atoms] = torch.arange(atoms.shape[0], device=centre.device)
    return ReceptiveField(kept.nonzero().squeeze(1), atoms, node_of)
