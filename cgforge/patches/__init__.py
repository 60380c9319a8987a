"""Adapters that put cgforge's kernels into MACE and NequIP models and checkpoints.

    model = cgforge.patches.load("mace.model", device="cuda", dtype="float32")   # patched, ready to run
    cgforge.patches.save_patched(model, "mace-cgforge.model")
    plain = cgforge.patches.unpatch(model)                                         # loadable without cgforge
"""

from __future__ import annotations

import os
import tempfile
import zipfile
import zlib
from pathlib import Path
from typing import Any

import torch

from . import mace as _mace
from .mace_legacy import LegacyCheckpointError, describe_file

__all__ = ["load", "patch", "unpatch", "save_patched", "checkpoint_kind", "verify_checksums", "LegacyCheckpointError"]

_NEQUIP_SUFFIXES = (".ckpt", ".nequip.zip")
_MACE_SUFFIXES = (".model", ".pt", ".pth")
_COMPILED_SUFFIXES = (".nequip.pth", ".nequip.pt2", ".pt2")


def checkpoint_kind(path: str | os.PathLike) -> str:
    """``"mace"`` or ``"nequip"``, from the file name, else from the file's contents."""
    path = os.fspath(path)
    name = os.path.basename(path).lower()
    if name.endswith(_COMPILED_SUFFIXES):
        raise ValueError(
            f"{path}: a compiled (TorchScript/AOTInductor) model; cgforge patches eager models: "
            "give the .ckpt or .nequip.zip it was compiled from"
        )
    if name.endswith(_NEQUIP_SUFFIXES):
        return "nequip"
    if name.endswith(_MACE_SUFFIXES):
        return "mace"
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if _is_torch_pickle_zip(path):
        return "mace"
    raise ValueError(
        f"{path}: cannot tell the checkpoint type (found {describe_file(path)}); expected a MACE "
        f"{'/'.join(_MACE_SUFFIXES)} file or a NequIP {'/'.join(_NEQUIP_SUFFIXES)} file"
    )


def _is_torch_pickle_zip(path: str) -> bool:
    try:
        with zipfile.ZipFile(path) as zf:
            return any(n.endswith("/data.pkl") for n in zf.namelist())
    except (zipfile.BadZipFile, OSError):
        return False


def verify_checksums(path: str | os.PathLike) -> None:
    """Read every member of a zip checkpoint and check its CRC-32; a damaged file raises ValueError naming it.

    torch.save files (MACE ``.model``, NequIP ``.ckpt``) and torch.package archives (``.nequip.zip``) are zip
    files whose members carry CRC-32 checksums that torch's own reader does not check: a flipped byte in a
    weight tensor loads silently and gives wild numbers. This reads the file once (about as long as loading
    it). Files that are not zips (torch's pre-1.6 pickle format) have no checksums: nothing is checked.
    """
    path = os.fspath(path)
    try:
        archive = zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        return  # not a zip: the loader says what it is
    damaged = "the file is damaged; re-download or re-export it"
    with archive:
        for info in archive.infolist():
            try:
                with archive.open(info) as member:
                    while member.read(1 << 24):
                        pass  # the CRC-32 is checked as the member's end is read
            except (zipfile.BadZipFile, zlib.error, EOFError) as err:
                raise ValueError(f"{path}: member {info.filename!r} fails its check ({err}): {damaged}") from err


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
    return _mace.load_mace(path, device=device, dtype=dtype, patched=True)


def patch(model: torch.nn.Module) -> torch.nn.Module:
    """Patch a model in place (idempotent) and return it."""
    if _mace.is_mace_model(model):
        return _mace.patch(model)
    raise TypeError(f"model: expected a MACE model, got {type(model).__module__}.{type(model).__qualname__}")


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Undo ``patch`` in place: the model no longer refers to cgforge."""
    if _mace.is_mace_model(model):
        return _mace.unpatch(model)
    raise TypeError(f"model: expected a MACE model, got {type(model).__module__}.{type(model).__qualname__}")


def save_patched(model: torch.nn.Module, path: str | os.PathLike, *, force: bool = False) -> Path:
    """Patch ``model`` (if not yet) and write it as a whole-model pickle, atomically.

    Refuses to overwrite an existing ``path`` unless ``force``. The file loads with
    ``torch.load(path, weights_only=False)`` wherever cgforge is installed, and in MACECalculator.
    """
    patch(model)
    return atomic_save(model, path, force=force)


def atomic_save(obj: Any, path: str | os.PathLike, *, force: bool = False) -> Path:
    """``torch.save`` to a temporary file beside ``path``, then rename it into place."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"output: {path} is a directory, expected a file name")
    if path.exists() and not force:
        raise FileExistsError(f"output: {path} exists; use force=True (--force) to overwrite it")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"output: directory {path.parent} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the file the usual mode
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
