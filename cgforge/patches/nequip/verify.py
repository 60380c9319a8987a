"""Check a patched NequIP model against the plain one on a small structure (energy and forces)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..common import UnsupportedModelError
from .patch import is_patched, patch, unpatch

if TYPE_CHECKING:  # the kernels load when a model is patched, not when this module is imported
    from cgforge.kernels.core.tuning import KernelTuning

# Relative error (norm of difference / norm of reference) allowed between patched and unpatched outputs.
_VERIFY_RTOL = {torch.float64: 1e-9, torch.float32: 1e-4}


def probe_structure(model: torch.nn.Module, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """A small non-periodic cluster for ``model`` (every type present, every atom within r_max of the others), as a
    nequip AtomicDataDict on ``device``."""
    from nequip.data import AtomicDataDict, compute_neighborlist_, from_dict

    metadata = model_metadata(model)
    type_names = metadata["type_names"].split(" ")
    r_max = float(metadata["r_max"])
    n = max(8, len(type_names))
    side = math.ceil(n ** (1 / 3))
    grid = np.stack(np.meshgrid(*[np.arange(side)] * 3, indexing="ij"), -1).reshape(-1, 3)[:n]
    rng = np.random.default_rng(0)
    pos = grid * (0.45 * r_max / max(side - 1, 1)) + rng.normal(scale=0.03 * r_max, size=(n, 3))
    data = from_dict({"pos": pos, "atom_types": np.arange(n, dtype=np.int64) % len(type_names)})
    data = compute_neighborlist_(data, r_max=r_max)
    return AtomicDataDict.to_(data, torch.device(device))


def model_metadata(model: torch.nn.Module) -> dict[str, str]:
    metadata = getattr(model, "metadata", None)
    if not isinstance(metadata, dict) or "type_names" not in metadata or "r_max" not in metadata:
        cls = type(model)
        raise UnsupportedModelError(f"model: expected a nequip GraphModel (with .metadata type_names and r_max), got "
                                    f"{cls.__module__}.{cls.__qualname__}")
    return metadata


def _energy_forces(model: torch.nn.Module, data: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.enable_grad():
        out = model(dict(data))
    return out["total_energy"].detach(), out["forces"].detach()


def _relative_error(new: torch.Tensor, ref: torch.Tensor) -> float:
    scale = max(float(ref.double().norm()), 1e-30)
    return float((new.double() - ref.double()).norm()) / scale


def verify_patch(model: torch.nn.Module, *, tuning: KernelTuning | None = None) -> float:
    """Compare ``model`` (patched or plain) patched with ``tuning`` against plain on ``probe_structure``; raises if they
    disagree, else leaves it patched and returns the largest relative error (energy or forces)."""
    device = next((t.device for t in model.parameters()), torch.device("cpu"))
    data = probe_structure(model, device)
    if is_patched(model):
        unpatch(model)
    try:
        ref = _energy_forces(model, data)
    except Exception as err:
        raise UnsupportedModelError(
            f"could not run the model on a small test structure to verify the patch ({type(err).__name__}: "
            f"{err}); pass verify=False to skip the check"
        ) from err
    patch(model, tuning=tuning)
    new = _energy_forces(model, data)
    rtol = _VERIFY_RTOL[model.model_dtype]
    errors = [_relative_error(a, b) for a, b in zip(new, ref)]
    if not all(e <= rtol for e in errors):  # also catches NaN
        unpatch(model)
        raise UnsupportedModelError(
            f"cgforge's convolution changed the model's outputs on a test structure: relative error "
            f"energy {errors[0]:.3g}, forces {errors[1]:.3g} (allowed {rtol:g}); the model was left unpatched"
        )
    return max(errors)
