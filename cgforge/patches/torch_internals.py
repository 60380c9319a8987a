"""Every private attribute of torch's ``nn.Module`` (and Tensor) that cgforge.patches touches, in one place.

Audited against torch 2.13: buffer persistence and ``None`` parameter slots (no public accessor), children
replaced in place, forward pre-hooks (their handles do not survive pickling), dict entries compared by identity.
Each function says which private name it reads or writes; the rest of cgforge.patches calls these.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from typing import Any

import torch


def is_persistent(module: torch.nn.Module, buffer: str) -> bool:
    """Whether ``buffer`` enters the state_dict (reads ``_non_persistent_buffers_set``)."""
    return buffer not in module._non_persistent_buffers_set


def parameter_slots(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter | None]]:
    """(name, parameter) of the module's own parameter slots, ``None`` ones too (reads ``_parameters``)."""
    return list(module._parameters.items())


def parameters_dict(module: torch.nn.Module) -> MutableMapping[str, Any]:
    """The module's own parameter dict (``_parameters``), for lookups by identity without ``__getattr__``."""
    return module._parameters


def buffers_dict(module: torch.nn.Module) -> MutableMapping[str, Any]:
    """The module's own buffer dict (``_buffers``): entries replaced in place keep their persistence."""
    return module._buffers


def children_dict(module: torch.nn.Module) -> MutableMapping[str, Any]:
    """The module's own submodule dict (``_modules``), for lookups by identity without ``__getattr__``."""
    return module._modules


def adopt(stand_in: torch.nn.Module, original: torch.nn.Module, *, children: bool = False) -> None:
    """Register the original's own parameters (``None`` slots too), buffers (same persistence) and, with
    ``children``, submodules in the stand-in under the same names: the same objects and state_dict."""
    for name, param in parameter_slots(original):
        stand_in.register_parameter(name, param)
    for name, buf in original.named_buffers(recurse=False):
        stand_in.register_buffer(name, buf, persistent=is_persistent(original, name))
    if children:
        for name, child in original.named_children():
            stand_in.add_module(name, child)


def give_back(stand_in: torch.nn.Module, original: torch.nn.Module, *, deep: bool = True) -> torch.nn.Module:
    """The original with the stand-in's current tensors (``.to()`` and ``load_state_dict(assign=True)`` replace them
    in the stand-in only), module by module along equal paths; ``deep=False``: the two modules' own tensors only."""
    mine = dict(stand_in.named_modules()) if deep else {"": stand_in}
    for path, theirs in (original.named_modules() if deep else [("", original)]):
        own = mine.get(path)
        if own is None or own is theirs:
            continue
        for name in theirs._parameters:
            if name in own._parameters:
                theirs._parameters[name] = own._parameters[name]
        for name in theirs._buffers:
            if name in own._buffers:
                theirs._buffers[name] = own._buffers[name]
    return original


def replace_child(parent: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    """``parent.<name> = module`` without ``__setattr__``'s checks against other attribute kinds (``_modules``)."""
    parent._modules[name] = module


def state_without(module: torch.nn.Module, child: str) -> dict:
    """``module.__dict__`` for pickling, its submodule ``child`` left out (copies ``_modules``)."""
    state = module.__dict__.copy()
    state["_modules"] = {k: v for k, v in module._modules.items() if k != child}
    return state


def forward_pre_hooks(module: torch.nn.Module) -> Iterator[Any]:
    """The module's forward pre-hooks (reads ``_forward_pre_hooks``: handles do not survive pickling)."""
    return iter(list(module._forward_pre_hooks.values()))


def remove_forward_pre_hooks(module: torch.nn.Module, kind: type) -> int:
    """Remove every forward pre-hook that is an instance of ``kind``; returns how many (``_forward_pre_hooks``)."""
    keys = [k for k, hook in module._forward_pre_hooks.items() if isinstance(hook, kind)]
    for key in keys:
        del module._forward_pre_hooks[key]
    return len(keys)


def base_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor a view was taken of, else ``t`` (``Tensor._base``)."""
    return t._base if t._base is not None else t


def tensor_version(t: torch.Tensor) -> int:
    """The in-place version counter (``Tensor._version``); -1 for inference tensors, which have none (the
    graph cache's per-call reset covers them)."""
    try:
        return t._version
    except RuntimeError:
        return -1
