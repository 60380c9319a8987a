"""The bundled water models (the one place that names them): ``NAMES``, ``model_path(kind)`` and
``checkpoint_path(name_or_path)`` (a bundled model's file, or a checkpoint file that exists).

Small models trained by ``scripts/train_bundled_models.py`` on q-SPC/Fw water (cgforge/models/README.md), shipped as
package data and found through ``importlib.resources``.
"""

from __future__ import annotations

import difflib
import os
from importlib import resources
from pathlib import Path

__all__ = ["MODEL_FILES", "MODELS_DIR", "NAMES", "TRAINING_SCRIPT", "checkpoint_path", "model_path", "LISTED"]

MODEL_FILES = {"mace": "water-mace.model", "nequip": "water-nequip.nequip.zip"}
NAMES: tuple[str, ...] = tuple(MODEL_FILES)
LISTED = " or ".join(map(repr, NAMES))  # "'mace' or 'nequip'", for messages and help texts
# An installed package (wheel or editable) is a folder on disk, so the resource is a real path that torch and
# nequip can open by name.
MODELS_DIR = Path(str(resources.files("cgforge").joinpath("models")))
TRAINING_SCRIPT = "scripts/train_bundled_models.py"


def model_path(kind: str) -> Path:
    """Path of the bundled water model of ``kind`` (one of ``NAMES``, any case): ValueError for an unknown kind,
    FileNotFoundError saying how to make it for a missing file."""
    if not isinstance(kind, str) or kind.lower() not in MODEL_FILES:
        raise ValueError(f"kind: expected {LISTED}, got {kind!r}")
    path = MODELS_DIR / MODEL_FILES[kind.lower()]
    if not path.is_file():
        raise FileNotFoundError(f"bundled {kind.lower()} model not found at {path}: the models ship inside the cgforge "
                                f"package (cgforge/models/); reinstall cgforge, or recreate them with `python "
                                f"{TRAINING_SCRIPT}` from the repository root")
    return path


def checkpoint_path(model: str | os.PathLike) -> Path:
    """The file of ``model``: a bundled model's name (any case) or the path of an existing checkpoint file
    (TypeError for anything else, FileNotFoundError naming a close bundled name, IsADirectoryError)."""
    from cgforge.patches.common import existing_file

    if isinstance(model, str) and model.lower() in NAMES:
        return model_path(model)
    if not isinstance(model, str | os.PathLike):
        raise TypeError(f"model: expected {LISTED} or a checkpoint path, got {type(model).__name__}")
    if not Path(model).exists():
        close = difflib.get_close_matches(str(model).lower(), NAMES, n=1)
        raise FileNotFoundError(f"model: {model} not found; expected a bundled model ({', '.join(map(repr, NAMES))}) "
                                "or a checkpoint file (.model, .ckpt, .nequip.zip)"
                                + (f"; did you mean {close[0]!r}?" if close else ""))
    return existing_file(model, "model", "a checkpoint file")
