"""Shared helpers for the MACE adapter tests: tiny models, a tiny system, evaluation, comparison."""

from __future__ import annotations

import copy

import numpy as np
import torch
from ase import Atoms
from e3nn import o3
from mace import data, modules
from mace.tools import torch_geometric, utils

MP_SHAPES = {  # MACE-MP foundation-model shapes (channels x irreps up to max_L), correlation 3
    "small": "128x0e",
    "medium": "128x0e+128x1o",
    "large": "128x0e+128x1o+128x2e",
}


def build_model(**kwargs) -> torch.nn.Module:
    """A fresh copy of a (cached) random ScaleShiftMACE; see ``_build_model`` for the arguments."""
    key = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in kwargs.items()))
    if key not in _MODELS:
        _MODELS[key] = _build_model(**kwargs)
    return copy.deepcopy(_MODELS[key])


_MODELS: dict[tuple, torch.nn.Module] = {}  # building the symmetric contractions is the slow part


def _build_model(
    interaction: str = "RealAgnosticResidualInteractionBlock",
    first: str | None = None,
    hidden: str = "8x0e+8x1o",
    max_ell: int = 2,
    correlation: int = 2,
    num_interactions: int = 2,
    r_max: float = 4.0,
    seed: int = 0,
    radial_mlp: list[int] | None = None,
    dtype: torch.dtype = torch.float64,
    scale_shift: bool = True,
) -> torch.nn.Module:
    """A ScaleShiftMACE (``scale_shift`` False: a MACE) for H and O with random weights, built in ``dtype``."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        torch.manual_seed(seed)
        model = (modules.ScaleShiftMACE if scale_shift else modules.MACE)(
            r_max=r_max,
            num_bessel=6,
            num_polynomial_cutoff=5,
            max_ell=max_ell,
            interaction_cls=modules.interaction_classes[interaction],
            interaction_cls_first=modules.interaction_classes[first or interaction],
            num_interactions=num_interactions,
            num_elements=2,
            hidden_irreps=o3.Irreps(hidden),
            MLP_irreps=o3.Irreps("4x0e"),
            atomic_energies=np.array([-1.5, -4.0]),
            avg_num_neighbors=4.0,
            atomic_numbers=[1, 8],
            correlation=correlation,
            gate=torch.nn.functional.silu,
            radial_MLP=radial_mlp or [16, 16],
            **({"atomic_inter_scale": 1.3, "atomic_inter_shift": 0.1} if scale_shift else {}),
        )
    finally:
        torch.set_default_dtype(previous)
    # Random nonzero weights everywhere (some layers start at zero), so every path is exercised.
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed + 1)
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.5)
    return model


def water_dimer(shift: float = 0.0) -> Atoms:
    """Two water molecules in a small periodic box (so stress is defined)."""
    pos = np.array(
        [[0.0, 0.0, 0.0], [0.96, 0.0, 0.0], [-0.24, 0.93, 0.0],
         [2.6, 0.3, 0.1], [3.2, 1.0, 0.3], [3.1, -0.6, 0.2]]
    )
    pos[3:] += shift
    return Atoms("OHHOHH", positions=pos, cell=[5.0, 5.2, 5.4], pbc=True)


def batch_for(model: torch.nn.Module, atoms: Atoms, device: str = "cpu") -> dict:
    table = utils.AtomicNumberTable([int(z) for z in model.atomic_numbers])
    cfg = data.config_from_atoms(atoms)
    item = data.AtomicData.from_config(cfg, z_table=table, cutoff=float(model.r_max), heads=["Default"])
    batch = next(iter(torch_geometric.dataloader.DataLoader([item], batch_size=1)))
    dtype = next(model.parameters()).dtype
    out = {}
    for k, v in batch.to_dict().items():
        if isinstance(v, torch.Tensor):
            v = v.to(device)
            if v.is_floating_point():
                v = v.to(dtype)
        out[k] = v
    return out


def evaluate(model: torch.nn.Module, atoms: Atoms, device: str = "cpu") -> dict[str, np.ndarray]:
    out = model(batch_for(model, atoms, device), compute_stress=True, training=False)
    return {k: out[k].detach().cpu().double().numpy() for k in ("energy", "forces", "stress")}


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def assert_same_outputs(got: dict, ref: dict, tol: float) -> None:
    for key in ("energy", "forces", "stress"):
        assert np.linalg.norm(ref[key]) > 0, f"reference {key} is zero: the comparison would be empty"
        err = rel_err(got[key], ref[key])
        assert err < tol, f"{key}: relative error {err:.3g} >= {tol:g}"
