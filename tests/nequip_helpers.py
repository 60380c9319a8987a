"""Shared helpers for the NequIP tests: a tiny NequIP GNN model (H and O) built in the test."""

from __future__ import annotations

import torch


def nequip_model(dtype: str = "float64", l_max: int = 2) -> torch.nn.Module:
    from nequip.model import NequIPGNNModel

    return NequIPGNNModel(
        seed=1, model_dtype=dtype, type_names=["H", "O"], r_max=3.0, avg_num_neighbors=10.0,
        per_type_energy_shifts={"H": -1.0, "O": -2.0}, per_type_energy_scales={"H": 1.0, "O": 1.5},
        num_layers=2, l_max=l_max, parity=True, num_features=4, radial_mlp_depth=1, radial_mlp_width=8,
    ).eval()
