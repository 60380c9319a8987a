"""MACE's per-atom energies of one structure under one head, without ``MACE.forward``'s batch handling.

``node_energies`` runs MACE's modules on the calculator's edge vectors with the head's column taken as a slice
(no per-atom advanced indexing, whose backward is a sort and an accumulation): the same operations on the same
values, equal bit for bit to MACE's forward. ``why_not_lean`` names what a model has that it does not handle.
"""

from __future__ import annotations

from importlib import metadata

import torch
from torch import Tensor

_MODELS = ("MACE", "ScaleShiftMACE")
READ_VERSIONS = ("0.3.16",)  # the mace-torch versions whose forward ``node_energies`` repeats


def mace_version() -> str | None:
    """The installed mace-torch's version, None where its metadata is missing."""
    try:
        return metadata.version("mace-torch")
    except metadata.PackageNotFoundError:
        return None


def why_not_lean(model: torch.nn.Module) -> str | None:
    """None if ``node_energies`` computes this model's per-atom energies, else what it does not handle."""
    cls = type(model)
    if cls.__module__ != "mace.modules.models" or cls.__name__ not in _MODELS:
        return f"model class {cls.__name__} is not one of mace's {', '.join(_MODELS)}"
    version = mace_version()
    if version not in READ_VERSIONS:
        return f"mace-torch {version} is not a version whose forward cgforge has read ({', '.join(READ_VERSIONS)})"
    for attr in ("joint_embedding", "embedding_readout"):
        if hasattr(model, attr):
            return f"the model has a {attr}"
    if cls.__name__ == "ScaleShiftMACE" and type(model.scale_shift).__name__ != "ScaleShiftBlock":
        return f"scale_shift is a {type(model.scale_shift).__name__}, not mace's ScaleShiftBlock"
    return None


def node_energies(model: torch.nn.Module, node_attrs: Tensor, vectors: Tensor, edge_index: Tensor, head: int,
                  node_heads: Tensor) -> Tensor:
    """Per-atom energies [N] of ``model`` (a MACE or ScaleShiftMACE that ``why_not_lean`` accepts) for one
    structure: ``node_attrs`` [N, species] one-hot, ``vectors`` [E, 3] receiver - sender with shifts,
    ``edge_index`` [2, E] (sender, receiver), under head number ``head`` (``node_heads`` [N], that number for
    every atom, as MACE's blocks take it). MACE's dtype: float64 for a ScaleShiftMACE, the model's for a MACE."""
    lengths = torch.linalg.norm(vectors, dim=-1, keepdim=True)  # as mace.modules.utils.get_edge_vectors_and_lengths
    node_e0 = model.atomic_energies_fn(node_attrs)[:, head]
    node_feats = model.node_embedding(node_attrs)
    edge_attrs = model.spherical_harmonics(vectors)
    edge_feats, cutoff = model.radial_embedding(lengths, node_attrs, edge_index, model.atomic_numbers)
    if hasattr(model, "pair_repulsion"):
        pair_node_energy = model.pair_repulsion_fn(lengths, node_attrs, edge_index, model.atomic_numbers)
    else:
        pair_node_energy = torch.zeros_like(node_e0)
    node_feats_list = []
    for i, (interaction, product) in enumerate(zip(model.interactions, model.products)):
        node_feats, sc = interaction(node_attrs=node_attrs, node_feats=node_feats, edge_attrs=edge_attrs,
                                     edge_feats=edge_feats, edge_index=edge_index, cutoff=cutoff,
                                     first_layer=(i == 0), lammps_class=None, lammps_natoms=(0, 0))
        node_feats = product(node_feats=node_feats, sc=sc, node_attrs=node_attrs)
        node_feats_list.append(node_feats)
    readout_es = [readout(node_feats_list[-1 if len(model.readouts) == 1 else i], node_heads)[:, head]
                  for i, readout in enumerate(model.readouts)]
    if type(model).__name__ == "MACE":  # MACE.forward's sum, term for term
        return torch.sum(torch.stack([node_e0, pair_node_energy, *readout_es], dim=-1), dim=-1)
    node_inter_es = torch.sum(torch.stack([pair_node_energy, *readout_es], dim=0), dim=0)
    scale, shift = (torch.atleast_1d(t)[head] for t in (model.scale_shift.scale, model.scale_shift.shift))
    node_inter_es = scale * node_inter_es + shift
    return node_e0.double() + node_inter_es.double()
