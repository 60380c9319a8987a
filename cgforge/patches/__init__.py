"""Adapters that put cgforge's kernels into MACE and NequIP models and checkpoints.

    model = cgforge.patches.load("mace.model", device="cuda", dtype="float32")   # patched, ready to run
    cgforge.patches.save_patched(model, "mace-cgforge.model")
    plain = cgforge.patches.unpatch(model)                                         # loadable without cgforge
"""

from __future__ import annotations

import os
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import torch

from . import mace
from .common import current_umask, verify_checksums
from .families import is_mace_model, is_nequip_model
from .mace.legacy import LegacyCheckpointError, describe_file

__all__ = ["load", "patch", "unpatch", "save_patched", "checkpoint_kind", "verify_checksums", "LegacyCheckpointError"]

NEQUIP_SUFFIXES = (".ckpt", ".nequip.zip")
MACE_SUFFIXES = (".model", ".pt", ".pth")
COMPILED_SUFFIXES = (".nequip.pth", ".nequip.pt2", ".pt2")


def checkpoint_kind(path: str | os.PathLike) -> str:
    """``"mace"`` or ``"nequip"``, from the file name, else from the file's contents."""
    path = os.fspath(path)
    name = os.path.basename(path).lower()
    if name.endswith(COMPILED_SUFFIXES):
        raise ValueError(
            f"{path}: a compiled (TorchScript/AOTInductor) model; cgforge patches eager models: "
            "give the .ckpt or .nequip.zip it was compiled from"
        )
    if name.endswith(NEQUIP_SUFFIXES):
        return "nequip"
    if name.endswith(MACE_SUFFIXES):
        return "mace"
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if _is_torch_pickle_zip(path):
        return "mace"
    raise ValueError(
        f"{path}: cannot tell the checkpoint type (found {describe_file(path)}); expected a MACE "
        f"{'/'.join(MACE_SUFFIXES)} file or a NequIP {'/'.join(NEQUIP_SUFFIXES)} file"
    )


def _is_torch_pickle_zip(path: str) -> bool:
    try:
        with zipfile.ZipFile(path) as zf:
            return any(n.endswith("/data.pkl") for n in zf.namelist())
    except (zipfile.BadZipFile, OSError):
        return False


def load(
    path: str | os.PathLike,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
) -> torch.nn.Module:
    """Load a MACE or NequIP checkpoint and return the model patched with cgforge's kernels.

    ``dtype`` None keeps the checkpoint's precision; ``"float32"``/``"float64"`` converts.
    MACE files written by older mace-torch or with e3nn 0.4 inside are upgraded in memory.
    """
    if checkpoint_kind(path) == "nequip":
        from .nequip import load_nequip  # lazy: nequip is an optional dependency

        return load_nequip(path, device=device, dtype=dtype)
    return mace.load_mace(path, device=device, dtype=dtype, patched=True)


def _family(model: torch.nn.Module) -> Any:
    if is_mace_model(model):
        return mace
    if is_nequip_model(model):
        from . import nequip  # nequip is optional: imported for its models only

        return nequip
    raise TypeError(f"model: expected a MACE or NequIP model, got {type(model).__module__}."
                    f"{type(model).__qualname__}")


def patch(model: torch.nn.Module) -> torch.nn.Module:
    """Patch a MACE or NequIP model in place (idempotent) and return it."""
    return _family(model).patch(model)


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Undo ``patch`` in place: the model no longer refers to cgforge."""
    return _family(model).unpatch(model)


def save_patched(model: torch.nn.Module, path: str | os.PathLike, *, force: bool = False) -> Path:
    """Patch ``model`` (if not yet) and write it as a whole-model pickle, atomically.

    Refuses to overwrite an existing ``path`` unless ``force``. The file loads with
    ``torch.load(path, weights_only=False)`` wherever cgforge is installed, and in MACECalculator.
    """
    patch(model)
    return atomic_save(model, path, force=force)


def atomic_save(obj: Any, path: str | os.PathLike, *, force: bool = False, dump: Any = torch.save,
                what: str = "output") -> Path:
    """``dump(obj, file)`` (default ``torch.save``) to a temporary file beside ``path``, then rename it into
    place; ``what`` names the path in errors (e.g. a command-line argument)."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{what}: {path} is a directory, expected a file name")
    if path.exists() and not force:
        raise FileExistsError(f"{what}: {path} exists; use force=True (--force) to overwrite it")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"{what}: directory {path.parent} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            dump(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp makes 0600; give the file the usual mode
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path
