"""Launch arithmetic every op shares: grid sizes, the device facts they read, and the double-backward rule of a
trilinear op. The generated kernels loop over rows with a grid stride, so a small grid drops no row.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

MAX_BLOCKS = 2**31 - 1  # CUDA's limit on gridDim.x


def sm_count(device: torch.device) -> int:
    """The device's streaming multiprocessors."""
    return torch.cuda.get_device_properties(device).multi_processor_count


_L2_BYTES: dict[torch.device, int] = {}


def l2_bytes(device: torch.device) -> int:
    """The device's L2 cache in bytes (50 MiB where torch does not say)."""
    if device not in _L2_BYTES:
        _L2_BYTES[device] = int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20))
    return _L2_BYTES[device]


def launch_blocks(rows: int, warps_per_block: int, cap: int | None = None, max_blocks: int | None = None) -> int:
    """Blocks for `rows` rows at one warp per row: ceil(rows / warps_per_block), clamped to [1, cap] and to
    ``max_blocks`` (None: CUDA's grid limit). Clamping never drops rows (module doc)."""
    if rows < 0 or warps_per_block < 1:
        raise ValueError(f"rows must be >= 0 and warps_per_block >= 1, got {rows} and {warps_per_block}")
    blocks = max(1, -(-rows // warps_per_block))  # integer ceil: exact for any row count
    if cap is not None:
        blocks = min(blocks, max(1, cap))
    return min(blocks, MAX_BLOCKS if max_blocks is None else max(1, min(max_blocks, MAX_BLOCKS)))


def thread_blocks(items: int, threads: int) -> int:
    """Blocks of ``threads`` threads for a kernel with one thread per item (no grid-stride loop): ceil(items /
    threads), at least 1 (a launch of no block is an error; the kernel's bound check idles the extra threads)."""
    return max(1, -(-items // threads))


def trilinear_double_backward(fwd: Callable, bwd: Callable, x, y, w, g, ggx, ggy, ggw, unweighted: bool = False):
    """Gradients of <ggx, Bx> + <ggy, By> + <ggw, Bw> for a trilinear f(x, y, w) with backward B; with `unweighted`
    paths f is affine in w (f = f_w + f_u) and f_u (f and B at w = 0) is subtracted from the ggw terms."""
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
