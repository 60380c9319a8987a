"""Which family a model module belongs to, told from the object alone (no family package is imported).

The registry (``families.py``) builds on these, and the family packages check their arguments with them;
they live apart from both so that neither imports the other.
"""

from __future__ import annotations

import re
from typing import Any

import torch

__all__ = ["is_mace_model", "is_nequip_model", "plain_module_name"]

_PACKAGE_PREFIX = re.compile(r"^<torch_package_\d+>\.")


def plain_module_name(name: str) -> str:
    """``<torch_package_3>.nequip.nn.x`` -> ``nequip.nn.x``: where a class from a torch package came from (nequip's
    packaged models carry their own nequip and e3nn, classes of another identity than the installed ones)."""
    return _PACKAGE_PREFIX.sub("", name)


def is_mace_model(module: Any) -> bool:
    """A mace-torch model: a ``mace.*`` class with an ``interactions`` ModuleList."""
    return (
        isinstance(module, torch.nn.Module)
        and type(module).__module__.startswith("mace.")
        and isinstance(getattr(module, "interactions", None), torch.nn.ModuleList)
    )


def is_nequip_model(module: Any) -> bool:
    """A nequip GraphModel (installed or packaged class): ``is_graph_model`` and type_names/r_max metadata."""
    if not isinstance(module, torch.nn.Module) or not getattr(module, "is_graph_model", False):
        return False
    try:
        metadata = module.metadata
    except AttributeError:
        return False
    return isinstance(metadata, dict) and "type_names" in metadata and "r_max" in metadata
