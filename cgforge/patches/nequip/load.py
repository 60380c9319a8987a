"""``load_nequip``: read a NequIP file (``files``), patch it (``patch``) and check it (``verify``)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from ..common import parse_device, parse_dtype, verify_checksums
from .files import SOLE_MODEL, check_dtype, check_input, load_models
from .patch import patch, unpatch
from .verify import verify_patch

if TYPE_CHECKING:  # the kernels load when a model is patched, not when this module is imported
    from cgforge.kernels.core.tuning import KernelTuning


def load_nequip(path: str | os.PathLike, device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None,
                *, model_name: str = SOLE_MODEL, verify: bool = True, patched: bool = True,
                tuning: KernelTuning | None = None) -> torch.nn.Module:
    """A NequIP ``.ckpt`` or ``.nequip.zip`` (checksums checked first) as its model, patched (``patched``), in eval
    mode on ``device``. ``dtype``: None or its ``model_dtype``; ``model_name`` picks one of several; ``verify``
    compares patched and plain on a small structure. Initialises nequip's global state, as nequip's loaders do."""
    p = check_input(path)
    verify_checksums(p)  # nequip's loaders would not notice a damaged weight tensor
    device = parse_device(device)
    dtype = parse_dtype(dtype)
    if not isinstance(model_name, str):
        raise TypeError(f"model_name: expected a str, got {type(model_name).__name__}")
    models = load_models(p)
    if model_name not in models:
        raise ValueError(f"model_name: {p} has no model {model_name!r}; it has {sorted(models.keys())}")
    model = models[model_name]
    check_dtype(model, dtype)
    model.eval()
    model.to(device)
    if not patched:
        return unpatch(model)  # a file written patched (enable_cgforge modifier) holds cgforge layers
    if verify:
        verify_patch(model, tuning=tuning)
    else:
        if tuning is not None:
            unpatch(model)  # a file written patched: its convolutions built again with the tuning
        patch(model, tuning=tuning)
    return model
