"""CUDA-graph capture (``capture_graph``, ``capture_or_fall_back``) and buffer capacities (``room``), shared by the
model step, the MD engine and the LAMMPS step.

``capture_graph`` is the one capture routine (warm-up calls on a side stream, then the capture into a given memory
pool), ``resolve_cuda_graph`` the one rule of whether a step is captured, ``room`` the one capacity rounding of
static buffers. The cyclic garbage collector is off during a capture: a collection there could destroy an earlier
CUDA graph held in a dead cycle, which invalidates the capture (docs/measured-constants.md).
"""

from __future__ import annotations

import gc
import math
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from cgforge.kernels.edge_layout import conv_graph, layout_listed, pad_offset_vector  # noqa: F401 (LAMMPS's)

T = TypeVar("T")


def resolve_cuda_graph(cuda_graph: bool | None, device: torch.device | None, inert_edges_reason: str | None) -> bool:
    """Whether steps are captured: ``cuda_graph`` None is on CUDA for a model whose edges beyond the cutoff contribute
    zero (``inert_edges_reason`` None: the padding is exact); True on another device, or for a model not known to
    be inert, raises ValueError (``device`` None: the model alone is checked, its device chosen later)."""
    if cuda_graph is None:
        return device is not None and device.type == "cuda" and inert_edges_reason is None
    if cuda_graph and device is not None and device.type != "cuda":
        raise ValueError(f"cuda_graph=True needs a CUDA device, got {device}")
    if cuda_graph and inert_edges_reason is not None:
        raise ValueError("cuda_graph=True pads the edge arrays, which needs a model whose edges beyond the cutoff "
                         f"contribute zero; for this one that is not known: {inert_edges_reason}")
    return bool(cuda_graph)


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


def replay_or_capture(owner: Any, compute: Callable[[], T], what: str) -> T:
    """``compute()`` eagerly unless ``owner.cuda_graph``; else the replay of ``owner``'s one graph of it, captured in a
    new pool at the first call after ``owner.invalidate()`` (which sets ``_graph`` None) and kept in ``owner._graph``,
    ``_out``, ``_pool`` (``n_captures`` counts captures); a failed capture runs eagerly (``capture_or_fall_back``)."""
    if not owner.cuda_graph:
        return compute()
    if owner._graph is None:
        owner._pool = torch.cuda.graph_pool_handle()
        entry = capture_or_fall_back(owner, compute, owner._pool, what)
        if entry is None:  # eager from now on (the reason is in capture_error)
            return compute()
        owner._graph, owner._out = entry
        owner.n_captures += 1
    owner._graph.replay()
    return owner._out
