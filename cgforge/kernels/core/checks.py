"""Argument checks shared by the modules: each error names the argument and what was expected."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float64)


def check_float(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32 or float64, got {t.dtype}")


def check_features(name: str, t: torch.Tensor, dim: int, rows: int | None = None) -> None:
    check_float(name, t)
    if t.dim() != 2 or t.shape[1] != dim:
        raise ValueError(f"{name} must have shape [rows, {dim}], got {list(t.shape)}")
    if rows is not None and t.shape[0] != rows:
        raise ValueError(f"{name} must have {rows} rows, got {t.shape[0]}")


def check_weights(w: torch.Tensor, numel: int, shared: bool, rows: int) -> None:
    check_float("weight", w)
    expected = [numel] if shared else [rows, numel]
    if list(w.shape) != expected:
        kind = "shared weights" if shared else "per-row weights"
        raise ValueError(f"weight must have shape {expected} ({kind}), got {list(w.shape)}")


def check_same(tensors: dict[str, torch.Tensor]) -> None:
    names = list(tensors)
    first = tensors[names[0]]
    for n in names[1:]:
        t = tensors[n]
        if t.dtype != first.dtype:
            raise TypeError(f"{n} has dtype {t.dtype} but {names[0]} has {first.dtype}: all must match")
        if t.device != first.device:
            raise ValueError(f"{n} is on {t.device} but {names[0]} is on {first.device}: all must match")
