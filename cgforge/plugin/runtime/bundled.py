"""Where the bundled water models live: the embedded default for the water-box demo.

    from cgforge.plugin.runtime.bundled import model_path
    model_path("mace")    # .../models/water-mace.model          (a whole pickled MACE model)
    model_path("nequip")  # .../models/water-nequip.nequip.zip   (a nequip-package archive)

Both are small models trained by ``scripts/train_bundled_models.py`` on q-SPC/Fw water (see
models/README.md). They live in the repository's ``models/`` folder, next to the ``cgforge`` package.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["MODEL_FILES", "MODELS_DIR", "TRAINING_SCRIPT", "model_path", "kinds"]

# cgforge/plugin/bundled.py -> the repository root is two folders above the package.
_REPO = Path(__file__).resolve().parents[3]
MODELS_DIR = _REPO / "models"
TRAINING_SCRIPT = "scripts/train_bundled_models.py"
MODEL_FILES = {"mace": "water-mace.model", "nequip": "water-nequip.nequip.zip"}


def kinds() -> tuple[str, ...]:
    """The model kinds :func:`model_path` knows: ``("mace", "nequip")``."""
    return tuple(MODEL_FILES)


def model_path(kind: str) -> Path:
    """Path of the bundled water model of ``kind`` (``"mace"`` or ``"nequip"``); the file must exist.

    Raises ValueError for an unknown kind and FileNotFoundError, saying how to make it, for a missing file.
    """
    if not isinstance(kind, str) or kind.lower() not in MODEL_FILES:
        raise ValueError(f"kind: expected one of {', '.join(map(repr, MODEL_FILES))}, got {kind!r}")
    path = MODELS_DIR / MODEL_FILES[kind.lower()]
    if not path.is_file():
        raise FileNotFoundError(
            f"bundled {kind.lower()} model not found at {path}. The models/ folder ships with the cgforge "
            f"repository checkout (a pip-installed wheel does not contain it): use a git checkout, or "
            f"recreate the models with `python {TRAINING_SCRIPT}` from the repository root"
        )
    return path
