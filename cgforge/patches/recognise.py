"""Which family a model module belongs to, told from the object alone (no family package is imported), and
what a file given as a checkpoint holds instead when it is none (``other_file_kind``).
"""

from __future__ import annotations

import os
import re
import zipfile
from typing import Any

import torch

NEQUIP_PACKAGE = "a NequIP package"
MLIAP_FILE = "a LAMMPS ML-IAP file written by cgforge lammps-model"
_MLIAP_CLASS = (b"lammps.unified", b"CgforgeMLIAP")  # in the first bytes of its pickle (cgforge.lammps before 0.2.0)

_PACKAGE_PREFIX = re.compile(r"^<torch_package_\d+>\.")


def plain_module_name(name: str) -> str:
    """``<torch_package_3>.nequip.nn.x`` -> ``nequip.nn.x``: where a class from a torch package came from (nequip's
    packaged models carry their own nequip and e3nn, classes of another identity than the installed ones)."""
    return _PACKAGE_PREFIX.sub("", name)


def is_mace_model(module: Any) -> bool:
    """A mace-torch model: a ``mace.*`` class with an ``interactions`` ModuleList."""
    return (isinstance(module, torch.nn.Module) and type(module).__module__.startswith("mace.")
            and isinstance(getattr(module, "interactions", None), torch.nn.ModuleList))


def is_nequip_model(module: Any) -> bool:
    """A nequip GraphModel (installed or packaged class): ``is_graph_model`` and type_names/r_max metadata."""
    if not isinstance(module, torch.nn.Module) or not getattr(module, "is_graph_model", False):
        return False
    metadata = getattr(module, "metadata", None)
    return isinstance(metadata, dict) and "type_names" in metadata and "r_max" in metadata


def zip_names(path: str | os.PathLike) -> list[str]:
    """The member names of the zip archive ``path`` ([] for anything else, also a pickle that holds a zip's
    bytes, such as an ML-IAP file: zipfile finds an archive's directory anywhere, so the first bytes decide)."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"PK\x03\x04":
                return []
        with zipfile.ZipFile(path) as zf:
            return zf.namelist()
    except (zipfile.BadZipFile, OSError):
        return []


def is_nequip_package(names: list[str]) -> bool:
    """Whether a zip holding ``names`` is a nequip-package archive (``model/package_metadata.txt``)."""
    return any(n.endswith("/model/package_metadata.txt") for n in names)


def other_file_kind(path: str | os.PathLike) -> str | None:
    """:data:`NEQUIP_PACKAGE` or :data:`MLIAP_FILE` (a pickle, or a torch.save zip, of ``CgforgeMLIAP``) when
    the file ``path`` is one of these, else None; only its first bytes (or its zip directory) are read."""
    names = zip_names(path)
    if is_nequip_package(names):
        return NEQUIP_PACKAGE
    pickles = [n for n in names if n.endswith("/data.pkl")]
    try:
        if pickles:  # a torch.save zip
            with zipfile.ZipFile(path) as zf, zf.open(pickles[0]) as f:
                head = f.read(512)
        else:
            with open(path, "rb") as f:
                head = f.read(512)
            if names or not head.startswith(b"\x80"):  # a pickle of protocol 2 or later starts with PROTO
                return None
    except (zipfile.BadZipFile, OSError, KeyError):
        return None
    return MLIAP_FILE if all(part in head for part in _MLIAP_CLASS) else None


_HINTS = {NEQUIP_PACKAGE: "name it NAME.nequip.zip (cgforge reads a .model/.pt file as MACE's) or give a MACE .model",
          MLIAP_FILE: "it is what LAMMPS's `pair_style mliap unified` loads; give the checkpoint it was written from"}


def other_file_message(path: str | os.PathLike, expected: str) -> str | None:
    """The error for a file given as ``expected`` (e.g. "a MACE checkpoint") that :func:`other_file_kind`
    recognises as something else, saying what it is and what to give instead; None for any other file."""
    kind = other_file_kind(path)
    return None if kind is None else f"{os.fspath(path)}: this is {kind}, not {expected}; {_HINTS[kind]}"
