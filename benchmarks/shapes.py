"""The systems and model shapes every benchmark uses (random weights: speed does not depend on training)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]

MACE_HIDDEN = {"small": "128x0e", "medium": "128x0e+128x1o", "large": "128x0e+128x1o+128x2e"}

NEQUIP_SHAPES = {
    # OpenEquivariance's "nequip-water" shape: 32 features, l_max 1, parity
    "l1": dict(num_layers=4, l_max=1, parity=True, num_features=32, radial_mlp_depth=1, radial_mlp_width=128),
    # PresetNequIPGNNModel("M")
    "M": dict(num_layers=4, l_max=2, parity=False, num_features=[128, 64, 32], type_embed_num_features=32,
              radial_mlp_depth=1, radial_mlp_width=128),
}


def mace_mp_shape(dtype: torch.dtype, shape: str = "medium") -> torch.nn.Module:
    """A MACE-MP foundation model's architecture: 89 elements, 128 channels, max_L 0/1/2 for
    small/medium/large, L=3 spherical harmonics, correlation 3, two residual interaction blocks."""
    from e3nn import o3
    from mace import modules

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        torch.manual_seed(0)
        elements = list(range(1, 90))
        block = modules.interaction_classes["RealAgnosticResidualInteractionBlock"]
        return modules.ScaleShiftMACE(
            r_max=6.0, num_bessel=10, num_polynomial_cutoff=5, max_ell=3, interaction_cls=block,
            interaction_cls_first=block, num_interactions=2, num_elements=len(elements),
            hidden_irreps=o3.Irreps(MACE_HIDDEN[shape]), MLP_irreps=o3.Irreps("16x0e"),
            gate=torch.nn.functional.silu, atomic_energies=np.zeros(len(elements)), avg_num_neighbors=60.0,
            atomic_numbers=elements, correlation=3, radial_type="bessel", atomic_inter_scale=1.0,
            atomic_inter_shift=0.0)
    finally:
        torch.set_default_dtype(previous)


def mace_mp_file(folder: Path, dtype: str = "float32", shape: str = "medium") -> Path:
    """``mace_mp_shape`` saved as a checkpoint in ``folder`` (written once: later calls get the same file)."""
    path = Path(folder) / f"mace-mp-{shape}-{dtype}.model"
    if not path.exists():
        torch.save(mace_mp_shape(getattr(torch, dtype), shape), path)
    return path


def nequip_shape(shape: str, dtype: str = "float32", type_names: tuple[str, ...] = ("H", "O")) -> torch.nn.Module:
    """A NequIP GNN of one of NEQUIP_SHAPES, r_max 5."""
    from nequip.model import NequIPGNNModel
    from nequip.utils.global_state import set_global_state

    set_global_state()
    torch.manual_seed(0)
    names = list(type_names)
    return NequIPGNNModel(seed=1, model_dtype=dtype, type_names=names, r_max=5.0, avg_num_neighbors=40.0,
                          per_type_energy_shifts={t: 0.0 for t in names},
                          per_type_energy_scales={t: 1.0 for t in names}, **NEQUIP_SHAPES[shape])


def dhfr_path() -> Path:
    """The DHFR structure (23,558 atoms): $CGFORGE_DHFR, the copy carried to the GPU machine, or ../shared."""
    candidates = [os.environ.get("CGFORGE_DHFR"), ROOT / ".device" / "base" / "dhfr.xyz",
                  ROOT.parent / "shared" / "data" / "dhfr_jac_23558.tinker.xyz"]
    for c in candidates:
        if c and Path(c).is_file():
            return Path(c)
    raise FileNotFoundError("DHFR structure not found: set CGFORGE_DHFR to the Tinker xyz file")


def dhfr_atoms():
    """DHFR in water from its Tinker xyz file, in its 62.23 A periodic cube."""
    import ase

    lines = dhfr_path().read_text().splitlines()
    n = int(lines[0].split()[0])
    rows = [r for r in (ln.split() for ln in lines[1:]) if len(r) >= 5 and r[0].isdigit()][:n]
    positions = np.array([[float(v) for v in r[2:5]] for r in rows])
    return ase.Atoms(symbols=[r[1][0] for r in rows], positions=positions, cell=[62.23] * 3, pbc=True)
