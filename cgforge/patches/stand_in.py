"""What every module stand-in of cgforge.patches shares: giving the original back, and the walker that does it.

A stand-in replaces one module of a model (an e3nn layer, a radial MLP layer, a self-connection) and keeps
the original in ``original`` (a one-element tuple: not a submodule, so the state_dict is the original's
own). ``restore()`` returns the original with the stand-in's current tensors; ``swap_out`` walks a model and
restores every stand-in of the given kinds. Imported by e3nn_layers, radial_precision and species_linear
(none of them imports another for this).
"""

from __future__ import annotations

import torch

__all__ = ["restore_original", "swap_out"]


def restore_original(stand_in: torch.nn.Module) -> torch.nn.Module:
    """``stand_in.original[0]`` given the stand-in's own parameters and buffers (as moved/converted since
    patching: ``.to()`` replaced them in the stand-in only)."""
    (original,) = stand_in.original
    for name in original._parameters:
        original._parameters[name] = stand_in._parameters[name]
    for name in original._buffers:
        original._buffers[name] = stand_in._buffers[name]
    return original


def swap_out(model: torch.nn.Module, kinds: tuple[type, ...]) -> int:
    """Put the originals of the ``kinds`` stand-ins back (with the tensors as moved/converted since).
    In place; returns how many."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, kinds):
                parent._modules[name] = child.restore()
                count += 1
    return count
