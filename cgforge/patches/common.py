"""Helpers every model family of cgforge.patches shares: argument parsing, errors, species lookup."""

from __future__ import annotations

import os
import zipfile
import zlib
from pathlib import Path

import numpy as np
import torch
from ase.data import chemical_symbols


class UnsupportedModelError(ValueError):
    """The model (or one of its blocks) is of a type or version cgforge does not patch."""


class UnknownElementError(ValueError):
    """The structure holds elements the model was not trained on."""


def parse_device(device: str | torch.device) -> torch.device:
    """``device`` as a torch.device: cpu or an available cuda device, else a ValueError naming it (a TypeError
    for what is not a str or a torch.device)."""
    if not isinstance(device, str | torch.device):
        raise TypeError(f"device: expected 'cpu', 'cuda', 'cuda:N' or a torch.device, got {type(device).__name__} "
                        f"{device!r}")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device: expected 'cpu', 'cuda' or 'cuda:N', got {device!r}") from err
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device: expected 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {device!r} asked for, but CUDA is not available on this machine")
    return dev


_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """None (keep the model's), or float32/float64 from a name or a torch.dtype."""
    if dtype is None or dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    if not isinstance(dtype, str | torch.dtype):
        raise TypeError(f"dtype: expected None, 'float32', 'float64' or a torch.dtype, got {type(dtype).__name__} "
                        f"{dtype!r}")
    raise ValueError(f"dtype: expected None, 'float32' or 'float64', got {dtype!r}")


def check_numbers(numbers: np.ndarray) -> np.ndarray:
    """Atomic numbers of one non-empty structure as int64."""
    numbers = np.asarray(numbers)
    if numbers.ndim != 1 or numbers.size == 0:
        raise ValueError(f"atoms: expected a non-empty structure, got {numbers.size} atoms")
    return numbers.astype(np.int64, copy=False)


def unknown_elements(numbers: np.ndarray, known: np.ndarray, model_elements: list[str]) -> UnknownElementError:
    """The error naming the elements of ``numbers`` where ``known`` is False."""
    missing = sorted({int(z) for z in np.unique(numbers[~known])})
    names = ", ".join(chemical_symbols[z] if 0 < z < len(chemical_symbols) else f"Z={z}" for z in missing)
    return UnknownElementError(f"atoms: element(s) {names} not known to the model, which knows "
                               f"{', '.join(model_elements)}")


def vanishes_at_zero(mlp: torch.nn.Module, in_dim: int) -> bool:
    """MLP(0) == 0 exactly (then an edge with zero features gets zero weights: see the adapters)."""
    param = next(mlp.parameters(), None)
    if param is None:
        return False
    with torch.no_grad():
        out = mlp(torch.zeros(2, in_dim, dtype=param.dtype, device=param.device))
    return bool((out == 0).all())


def existing_file(path: str | os.PathLike, what: str, expected: str) -> Path:
    """``path`` as a Path when it names an existing file; else the error naming ``what`` (the argument or flag)
    and, for a directory, what was ``expected`` there."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{what}: {path} not found")
    if path.is_dir():
        raise IsADirectoryError(f"{what}: {path} is a directory, expected {expected}")
    return path


def verify_checksums(path: str | os.PathLike) -> None:
    """Read every member of a zip checkpoint and check its CRC-32 (torch's reader does not); a damaged file raises
    ValueError naming it. A file that is no zip has no checksums: nothing is checked."""
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
