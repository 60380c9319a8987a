"""Which model family a model object belongs to, told without importing the family's package.

``cgforge.patches.nequip`` imports nequip, an optional dependency: the calculator and ``cgforge.patches``
ask here first and import a family's package only for that family's models.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["is_mace_model", "is_nequip_model"]


def is_mace_model(obj: Any) -> bool:
    """A mace-torch model: a ``mace.*`` class with an ``interactions`` ModuleList."""
    return (
        isinstance(obj, torch.nn.Module)
        and type(obj).__module__.startswith("mace.")
        and isinstance(getattr(obj, "interactions", None), torch.nn.ModuleList)
    )


def is_nequip_model(obj: Any) -> bool:
    """A nequip GraphModel (installed or packaged class): ``is_graph_model`` and type_names/r_max metadata."""
    if not isinstance(obj, torch.nn.Module) or not getattr(obj, "is_graph_model", False):
        return False
    try:
        metadata = obj.metadata
    except AttributeError:
        return False
    return isinstance(metadata, dict) and "type_names" in metadata and "r_max" in metadata
