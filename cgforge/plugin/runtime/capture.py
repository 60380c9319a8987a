"""CUDA-graph capture (``capture_graph``, ``capture_or_fall_back``) and buffer capacities (``room``), shared by the
model step, the MD engine and the LAMMPS step.

The cyclic garbage collector is off during a capture: a collection there could destroy an earlier CUDA graph held
in a dead cycle, which invalidates the capture (docs/measured-constants.md).
"""

from __future__ import annotations

import gc
import math
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def room(count: int, margin: float) -> int:
    """Buffer slots for ``count`` entries with ``margin`` (a fraction) to spare, in whole blocks of 64, plus one
    spare block (so a capacity is never 0)."""
    return int(math.ceil(count * (1 + margin) / 64.0) + 1) * 64


def capture_graph(compute: Callable[[], T], device: torch.device, pool: object, *, warmups: int = 2,
                  restore: Callable[[], None] | None = None) -> tuple[torch.cuda.CUDAGraph, T]:
    """(graph, what the captured call returned) of ``compute()`` captured in a new CUDA graph from ``pool``, after
    ``warmups`` calls on a side stream; ``restore`` undoes what ``compute`` changed in its inputs (after the
    warm-up, and once the capture ended or failed). Raises what the warm-up or the capture raised."""
    torch.cuda.synchronize(device)
    try:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(warmups):
                compute()
        torch.cuda.current_stream(device).wait_stream(side)
        if restore is not None:
            restore()
        graph = torch.cuda.CUDAGraph()
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=pool):
                out = compute()
        finally:
            if collecting:
                gc.enable()
    finally:
        if restore is not None:
            torch.cuda.synchronize(device)
            restore()
    return graph, out


def capture_or_fall_back(owner: Any, compute: Callable[[], T], pool: object, what: str, *, warmups: int = 2,
                         restore: Callable[[], None] | None = None) -> tuple[torch.cuda.CUDAGraph, T] | None:
    """``capture_graph(compute, owner.device, pool, ...)``, or None when that fails: ``owner`` is then
    invalidated and runs eagerly (``cuda_graph`` False), the reason in ``capture_error`` and a warning."""
    try:
        return capture_graph(compute, owner.device, pool, warmups=warmups, restore=restore)
    except Exception as err:  # noqa: BLE001 - any failure to capture falls back to eager steps
        torch.cuda.synchronize(owner.device)
        owner.invalidate()
        owner.cuda_graph = False
        owner.capture_error = f"{type(err).__name__}: {err}"
        warnings.warn(f"cgforge: CUDA-graph capture of {what} failed, running it eagerly ({owner.capture_error})",
                      RuntimeWarning, stacklevel=4)
        return None
