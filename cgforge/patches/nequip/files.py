"""NequIP's files: recognising ``.ckpt`` / ``.nequip.zip``, and reading them unpatched (``load_models``). Compiled
outputs (``.nequip.pt2``, ``.nequip.pth``) cannot call Python-launched kernels: ``CompiledModelError``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from ..common import UnsupportedModelError
from ..recognise import is_nequip_package, zip_names

log = logging.getLogger(__name__)

CHECKPOINT_SUFFIX = ".ckpt"
PACKAGE_SUFFIX = ".nequip.zip"
COMPILED_SUFFIXES = (".nequip.pt2", ".nequip.pth")
SOLE_MODEL = "sole_model"  # nequip's key for the model of a single-model checkpoint or package

SUPPORTED_ROUTE = (
    "cgforge's kernels are launched from Python, so a compiled .nequip.pt2/.nequip.pth cannot hold them. "
    "Run the eager model instead: load the .ckpt or .nequip.zip with cgforge.patches.load(...) or the "
    "cgforge ASE calculator, or write a patched package with `cgforge patch IN OUT.nequip.zip`"
)


class CompiledModelError(ValueError):
    """A compiled NequIP model (or a compile workflow) where cgforge needs an eager one."""


def check_input(path: str | os.PathLike) -> Path:
    """``path`` as a Path when it names a NequIP ``.ckpt`` or ``.nequip.zip`` that ``load_models`` reads, else the
    error saying what it is (TypeError, CompiledModelError, FileNotFoundError, IsADirectoryError, ValueError)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path: expected a file path (str or os.PathLike), got {type(path).__name__}")
    p = Path(path)
    if p.name.lower().endswith(COMPILED_SUFFIXES):
        raise CompiledModelError(f"{p}: a compiled NequIP model (nequip-compile output): {SUPPORTED_ROUTE} "
                                 "(the file it was compiled from)")
    if not p.exists():
        raise FileNotFoundError(f"NequIP model not found: {p}")
    if p.is_dir():
        raise IsADirectoryError(f"path: {p} is a directory, expected a .ckpt or .nequip.zip file")
    name, names = p.name.lower(), zip_names(p)
    if name.endswith(PACKAGE_SUFFIX):
        if not is_nequip_package(names):
            raise ValueError(f"{p}: not a NequIP package (expected a zip with model/package_metadata.txt, as "
                             "nequip-package writes)")
    elif name.endswith(CHECKPOINT_SUFFIX):
        if is_nequip_package(names):
            raise ValueError(f"{p}: this is a NequIP package; give it the {PACKAGE_SUFFIX} suffix nequip needs")
        if not any(n.endswith("/data.pkl") for n in names) and not _is_legacy_torch_pickle(p):
            raise ValueError(f"{p}: not a torch checkpoint (expected the .ckpt nequip-train writes)")
    else:
        raise ValueError(f"path: {p}: expected a NequIP {CHECKPOINT_SUFFIX} or {PACKAGE_SUFFIX} file")
    return p


def _is_legacy_torch_pickle(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == b"\x80\x02"  # torch's pre-zip format starts with a protocol-2 pickle


def load_models(path: Path) -> torch.nn.ModuleDict:
    """nequip's ModuleDict of eager models, unpatched, on the CPU."""
    from nequip.model.saved_models.load_utils import load_saved_model
    from nequip.utils.global_state import set_global_state

    set_global_state()
    try:
        models = load_saved_model(str(path), compile_mode="eager", model_key=None)
    except Exception as err:
        kind = "package" if path.name.lower().endswith(PACKAGE_SUFFIX) else "checkpoint"
        raise ValueError(f"{path}: could not load it as a NequIP {kind} ({type(err).__name__}: {err})") from err
    if not isinstance(models, torch.nn.ModuleDict):
        raise UnsupportedModelError(f"{path}: expected nequip's ModuleDict of models, got {type(models).__name__}")
    return models


def check_dtype(model: torch.nn.Module, dtype: torch.dtype | None) -> None:
    """Raise ValueError unless ``dtype`` is None or the ``model_dtype`` the NequIP ``model`` was built for
    (a NequIP model cannot be converted to another precision)."""
    model_dtype = getattr(model, "model_dtype", None)
    if dtype is not None and dtype != model_dtype:
        raise ValueError(f"dtype: this NequIP model is built for {model_dtype} (its model_dtype) and cannot be "
                         f"converted to {dtype}; pass dtype=None, or train/build it with "
                         f"model_dtype: {str(dtype).replace('torch.', '')}")
