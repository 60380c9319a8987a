"""Launching the tensor product's generated kernels over any layout (the tensor product's rows and the
convolution's, which run the same program): grid, shared memory window and per-chunk backward launches from the
plan's schedule and tuning.
"""

from __future__ import annotations

import torch

from ..core.launch import l2_bytes, launch_blocks, sm_count
from . import plan as plans
from .layout import Layout
from .problem import TPProblem
from .schedule import Schedule


def _grid(rows: int, warps: int, device: torch.device, shared_weights: bool, max_blocks: int | None) -> int:
    # shared weights: bounded so the per-warp grad-W partial rows stay small
    return launch_blocks(rows, warps, 4 * sm_count(device) if shared_weights else None, max_blocks)


def backward_launches(schedule: Schedule, rows: int, device: torch.device) -> list[int]:
    """The group_pass argument of each backward launch: one per channel chunk where ``Schedule.backward_passes``
    allows it and the grad-out rows exceed the L2, else [-1] (one launch, every chunk)."""
    passes = schedule.backward_passes()
    if passes > 1 and rows * schedule.problem.irreps_out.dim * schedule.itemsize > l2_bytes(device):
        return list(range(passes))
    return [-1]


def needs_zero_fill(p: TPProblem, out_side: bool) -> bool:
    """Whether an output (``out_side``) or grad-x buffer has irreps no instruction writes (then zero-filled)."""
    irreps = p.irreps_out if out_side else p.irreps_in1
    used = {(i.i_out if out_side else i.i_in1) for i in p.instructions}
    return any(mul > 0 and k not in used for k, (mul, _) in enumerate(irreps))


def launch(key: str, backward: bool, layout: Layout, rows: int, args: list, dtype: torch.dtype,
           device: torch.device, gw_partial: bool = False) -> int:
    """Launch one generated kernel over `rows` rows; returns the number of warps launched."""
    from ..core.runtime import I32, I64

    plan = plans.get(key)
    schedule = plan.schedule(dtype, layout.csr)
    launch = schedule.launch(backward)
    warps = launch.warps_per_block
    blocks = _grid(rows, warps, device, gw_partial, plan.tuning.max_blocks)
    if rows == 0:
        return 0
    handle = plan.kernel(dtype, layout, backward, device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    # passes keep gathered grad-out rows in the L2; a backward over the receivers reads each row's own once
    passes = (backward_launches(schedule, rows, device) if layout.gidx else [-1]) if backward else [None]
    for group_pass in passes:
        extra = [] if group_pass is None else [I32(group_pass)]
        handle.launch((blocks, 1, 1), (32 * warps, 1, 1), [*args, I64(rows), *extra],
                      shared_mem=warps * launch.smem_per_warp * itemsize)
    return blocks * warps


def backward_buffers(key: str, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, rows_for_partials: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad x, grad y, grad W) buffers of a backward launch; shared weights: one partial grad-W row per warp."""
    plan = plans.get(key)
    p = plan.problem
    gx = torch.zeros_like(x) if needs_zero_fill(p, out_side=False) else torch.empty_like(x)
    gy = torch.zeros_like(y)
    if p.shared_weights:
        wpb = plan.schedule(x.dtype).backward_launch.warps_per_block  # the same for every layout
        warps = _grid(rows_for_partials, wpb, x.device, True, plan.tuning.max_blocks) * wpb
        gw = torch.zeros(warps, max(p.weight_numel, 1), dtype=x.dtype, device=x.device)
    else:
        gw = torch.empty_like(w)
    return gx, gy, gw


def finish_gw(key: str, gw: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """grad W from the launch's buffer: shared weights sum the per-warp partial rows."""
    if plans.get(key).problem.shared_weights:
        return gw.sum(0)[: w.shape[0]].reshape(w.shape)
    return gw


def has_unweighted_paths(key: str) -> bool:
    return any(not ins.has_weight for ins in plans.get(key).problem.instructions)
