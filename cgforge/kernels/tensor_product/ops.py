"""torch.library custom ops for the tensor product, and the launch helpers the convolution shares.

Each op has a CUDA implementation (generated kernels), a CPU implementation (the torch reference),
a fake implementation (shapes only, for torch.compile) and an autograd formula. The backward ops
are differentiable too: their derivatives are combinations of forward and backward calls (the op
is trilinear in x, y, W), so any derivative order works, e.g. forces in a training loss.
"""

from __future__ import annotations

import torch

from ..core.custom_op import custom_op
from . import plan as plans
from .layout import TP_LAYOUT, Layout
from .reference import reference_tp, reference_tp_backward

_MAX_BLOCKS = 2**31 - 1  # CUDA's limit on gridDim.x


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def launch_blocks(rows: int, warps_per_block: int, cap: int | None = None) -> int:
    """Blocks for `rows` rows at one warp per row: ceil(rows / warps_per_block), clamped to [1, cap] and
    to CUDA's grid limit. Clamping never drops rows: the kernels loop over rows with a grid stride
    (64-bit row index), so a smaller grid runs more rows per warp."""
    if rows < 0 or warps_per_block < 1:
        raise ValueError(f"rows must be >= 0 and warps_per_block >= 1, got {rows} and {warps_per_block}")
    blocks = max(1, -(-rows // warps_per_block))  # integer ceil: exact for any row count
    if cap is not None:
        blocks = min(blocks, max(1, cap))
    return min(blocks, _MAX_BLOCKS)


def _grid(rows: int, warps: int, device: torch.device, shared_weights: bool) -> int:
    # shared weights: bounded so the per-warp grad-W partial rows stay small
    return launch_blocks(rows, warps, 4 * _sm_count(device) if shared_weights else None)


_L2_BYTES: dict[torch.device, int] = {}


def l2_bytes(device: torch.device) -> int:
    """The device's L2 cache in bytes (50 MiB where torch does not say)."""
    if device not in _L2_BYTES:
        _L2_BYTES[device] = int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20))
    return _L2_BYTES[device]


def backward_launches(schedule, rows: int, device: torch.device) -> list[int]:
    """The group_pass argument of each launch of a backward kernel: one per channel chunk (in order) where the
    schedule allows it and the grad-out rows (``rows`` x out width) exceed the L2, else [-1]: one launch, every
    chunk (see ``schedule.BACKWARD_CHUNK_PASSES``)."""
    passes = schedule.backward_passes()
    if passes > 1 and rows * schedule.problem.irreps_out.dim * schedule.itemsize > l2_bytes(device):
        return list(range(passes))
    return [-1]


def needs_zero_fill(p, out_side: bool) -> bool:
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
    blocks = _grid(rows, warps, device, gw_partial)
    if rows == 0:
        return 0
    handle = plan.kernel(dtype, layout, backward, device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    for group_pass in backward_launches(schedule, rows, device) if backward else [None]:
        extra = [] if group_pass is None else [I32(group_pass)]
        handle.launch((blocks, 1, 1), (32 * warps, 1, 1), [*args, I64(rows), *extra],
                      shared_mem=warps * launch.smem_per_warp * itemsize)
    return blocks * warps


def backward_buffers(key: str, x, y, w, rows_for_partials: int):
    p = plans.get(key).problem
    gx = torch.zeros_like(x) if needs_zero_fill(p, out_side=False) else torch.empty_like(x)
    gy = torch.zeros_like(y)
    if p.shared_weights:
        wpb = plans.get(key).schedule(x.dtype).backward_launch.warps_per_block  # the same for every layout
        warps = _grid(rows_for_partials, wpb, x.device, True) * wpb
        gw = torch.zeros(warps, max(p.weight_numel, 1), dtype=x.dtype, device=x.device)
    else:
        gw = torch.empty_like(w)
    return gx, gy, gw


def finish_gw(key: str, gw: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if plans.get(key).problem.shared_weights:
        return gw.sum(0)[: w.shape[0]].reshape(w.shape)
    return gw


def has_unweighted_paths(key: str) -> bool:
    return any(not ins.has_weight for ins in plans.get(key).problem.instructions)


def trilinear_double_backward(fwd, bwd, x, y, w, g, ggx, ggy, ggw, unweighted: bool = False):
    """Gradients of <ggx, Bx> + <ggy, By> + <ggw, Bw> for a trilinear f(x, y, w) with backward B.

    With `unweighted` paths (uvu without weights) f is only affine in w: f = f_w(x, y, w) + f_u(x, y).
    The ggw terms need f_w alone, so f_u (f and B at w = 0) is subtracted from them.
    """
    dx = dy = dw = dg = None

    def add(a, b):
        return b if a is None else a + b

    if ggx is not None:
        dg = add(dg, fwd(ggx, y, w))
        _, by, bw = bwd(ggx, y, w, g)
        dy, dw = add(dy, by), add(dw, bw)
    if ggy is not None:
        dg = add(dg, fwd(x, ggy, w))
        bx, _, bw = bwd(x, ggy, w, g)
        dx, dw = add(dx, bx), add(dw, bw)
    if ggw is not None:
        fw = fwd(x, y, ggw)
        bx, by, _ = bwd(x, y, ggw, g)
        if unweighted:
            zero = torch.zeros_like(ggw)
            bx0, by0, _ = bwd(x, y, zero, g)
            fw, bx, by = fw - fwd(x, y, zero), bx - bx0, by - by0
        dg = add(dg, fw)
        dx, dy = add(dx, bx), add(dy, by)
    return dx, dy, dw, dg


# ---------------------------------------------------------------- tensor product

def _tp_fake(x, y, w, key):
    return x.new_empty(x.shape[0], plans.get(key).problem.irreps_out.dim)


def _tp_grad(ctx, g):
    x, y, w = ctx.saved_tensors
    gx, gy, gw = tp_backward(x, y, w, g.contiguous(), *ctx.args)
    return gx, gy, gw, None


@custom_op("tp_forward", _tp_fake, _tp_grad)
def tp_forward(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, key: str) -> torch.Tensor:
    p = plans.get(key).problem
    if x.device.type != "cuda":
        return reference_tp(p, x, y, w)
    x, y, w = x.contiguous(), y.contiguous(), w.contiguous()
    rows = x.shape[0]
    shape = (rows, p.irreps_out.dim)
    out = (x.new_zeros(shape) if needs_zero_fill(p, out_side=True) else x.new_empty(shape))
    launch(key, False, TP_LAYOUT, rows, [x, y, w, out, None, None, None, None], x.dtype, x.device)
    return out


def _tp_bwd_fake(x, y, w, g, key):
    return torch.empty_like(x), torch.empty_like(y), torch.empty_like(w)


def _tp_bwd_grad(ctx, ggx, ggy, ggw):
    x, y, w, g = ctx.saved_tensors
    (key,) = ctx.args
    dx, dy, dw, dg = trilinear_double_backward(
        lambda a, b, c: tp_forward(a, b, c, key),
        lambda a, b, c, d: tp_backward(a, b, c, d, key),
        x, y, w, g, ggx, ggy, ggw, has_unweighted_paths(key))
    return dx, dy, dw, dg, None


@custom_op("tp_backward", _tp_bwd_fake, _tp_bwd_grad)
def tp_backward(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, g: torch.Tensor, key: str
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    p = plans.get(key).problem
    if x.device.type != "cuda":
        return reference_tp_backward(p, x, y, w, g)
    x, y, w, g = x.contiguous(), y.contiguous(), w.contiguous(), g.contiguous()
    rows = x.shape[0]
    gx, gy, gw = backward_buffers(key, x, y, w, rows)
    launch(key, True, TP_LAYOUT, rows, [x, y, w, g, gx, gy, gw, None, None, None, None], x.dtype, x.device,
           gw_partial=p.shared_weights)
    return gx, gy, finish_gw(key, gw, w)
