"""Adapters that put cgforge's kernels into MACE and NequIP models and checkpoints.

    model = cgforge.patches.load("mace.model", device="cuda", dtype="float32")   # patched, ready to run
    cgforge.patches.save_patched(model, "mace-cgforge.model")
    plain = cgforge.patches.unpatch(model)                                         # loadable without cgforge

Importing this package imports no family's code and no kernels (they load on first use).
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

import torch

from cgforge.atomic import atomic_save

from . import families
from .common import verify_checksums

__all__ = ["load", "patch", "unpatch", "save_patched", "atomic_save", "checkpoint_kind", "verify_checksums",
           "LegacyCheckpointError"]


def checkpoint_kind(path: str | os.PathLike) -> str:
    """``"mace"`` or ``"nequip"``: the family that reads the checkpoint ``path`` (``families.family_for_file``)."""
    return families.family_for_file(path).name


def load(path: str | os.PathLike, device: str | torch.device = "cpu",
         dtype: str | torch.dtype | None = None) -> torch.nn.Module:
    """The MACE or NequIP model in the checkpoint ``path``, patched, on ``device``, in ``dtype`` (None: the file's;
    a NequIP model keeps its ``model_dtype``): ``families.load``, which also takes a module and ``patch=False``."""
    return families.load(path, device, dtype, patch=True)


def patch(model: torch.nn.Module) -> torch.nn.Module:
    """Patch a MACE or NequIP model in place (idempotent) and return it; TypeError for any other object."""
    return families.family_of(model).patch(model)


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Undo ``patch`` in place: the model no longer refers to cgforge; TypeError for a non-MACE/NequIP object."""
    return families.family_of(model).unpatch(model)


def save_patched(model: torch.nn.Module, path: str | os.PathLike, *, force: bool = False) -> Path:
    """Patch ``model`` (if not yet) and write it atomically in its family's format (``Family.save``: MACE a
    whole-model pickle, NequIP a ``.nequip.zip`` package); refuses to overwrite ``path`` unless ``force``."""
    return families.family_of(model).save(model, path, force=force)


def __getattr__(name: str) -> Any:
    """The family packages (``mace``, ``nequip``) and ``LegacyCheckpointError``, imported on first use."""
    packages = {family.package.rpartition(".")[2]: family.package for family in families.FAMILIES}
    if name in packages:
        return importlib.import_module(packages[name])
    if name == "LegacyCheckpointError":
        from .mace.legacy import LegacyCheckpointError

        return LegacyCheckpointError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
