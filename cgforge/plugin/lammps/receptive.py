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

__all__ = ["ReceptiveField", "field_masks", "receptive_field"]


@dataclass(frozen=True)
class ReceptiveField:
    """The part of one call's graph the listed atoms' energies depend on."""

    pairs: Tensor  # int64 [kept]: the kept pairs' indices in LAMMPS's list, ascending
    atoms: Tensor  # int64 [nodes]: the LAMMPS atom of each node, ascending
    node_of: Tensor  # int64 [ntotal]: each atom's node, -1 for atoms left out


def field_masks(centre: Tensor, neighbour: Tensor, listed: Tensor, ntotal: int, layers: int,
                valid: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(pairs: bool [P], atoms: bool [ntotal]): the pairs (edges ``neighbour -> centre``, of the ``valid`` ones)
    whose centre is within ``layers - 1`` hops of a ``listed`` atom (an entry ``ntotal``: none), and the atoms those
    pairs and the listed atoms touch. A hop goes from a pair's centre to its neighbour: the way a layer's messages
    come in. No host read (index fills into a slot past the atoms): the padded step makes it inside its graph."""
    dump = torch.full((), ntotal, dtype=torch.int64, device=centre.device)  # fills that must not land
    near = torch.zeros(ntotal + 1, dtype=torch.bool, device=centre.device).index_fill(0, listed, True)
    for _ in range(layers - 1):
        out = near.index_select(0, centre) if valid is None else valid & near.index_select(0, centre)
        near = near.index_fill(0, torch.where(out, neighbour, dump), True)
    pairs = near.index_select(0, centre) if valid is None else valid & near.index_select(0, centre)
    return pairs, near.index_fill(0, torch.where(pairs, neighbour, dump), True)[:ntotal]


def receptive_field(centre: Tensor, neighbour: Tensor, listed: Tensor, ntotal: int,
                    layers: int) -> ReceptiveField | None:
    """The pairs and atoms of ``field_masks``, as indices; None when that is every pair and every atom (nothing to
    cut)."""
    if layers < 1:
        raise ValueError(f"layers: expected at least 1, got {layers}")
    kept, touched = field_masks(centre, neighbour, listed, ntotal, layers)
    if bool(kept.all()) and bool(touched.all()):
        return None
    atoms = touched.nonzero().squeeze(1)
    node_of = torch.full((ntotal,), -1, dtype=torch.int64, device=centre.device)
    node_of[atoms] = torch.arange(atoms.shape[0], device=centre.device)
    return ReceptiveField(kept.nonzero().squeeze(1), atoms, node_of)
