"""Sums of contiguous row segments, in a fixed order: bitwise the same result on every run.

    out[i] = values[rowptr[i]] + ... + values[rowptr[i + 1] - 1]        values [C, K] -> out [N, K]

The forces are such sums; atomics and CUB's prefix sums change the order of the additions from run to run. On
CUDA a warp owns a row (lane l adds elements l, l + 32, ... in order, then a fixed butterfly), accumulating in
FP64; on the CPU (and as the tests' oracle) differences of one FP64 prefix sum. The backward is a gather:
differentiable again.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .core.registry import SourceKernels

__all__ = ["SEGMENT_SUM_SOURCE", "segment_sum", "segment_sum_reference"]

_WARPS_PER_BLOCK = 8

SEGMENT_SUM_SOURCE = r"""
template <typename T>
__device__ void segment_sum(const T* __restrict__ values, const long long* __restrict__ rowptr,
                            T* __restrict__ out, int rows, int width) {
    const int row = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;  // uniform per warp: the shuffles below see all 32 lanes
    const long long start = rowptr[row], end = rowptr[row + 1];
    for (int k = 0; k < width; ++k) {
        double sum = 0.0;
        for (long long j = start + lane; j < end; j += 32) sum += (double)values[j * width + k];
        for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
        if (lane == 0) out[(long long)row * width + k] = (T)sum;
    }
}

extern "C" __global__ void segment_sum_f32(const float* values, const long long* rowptr, float* out, int rows,
                                           int width) {
    segment_sum<float>(values, rowptr, out, rows, width);
}

extern "C" __global__ void segment_sum_f64(const double* values, const long long* rowptr, double* out, int rows,
                                           int width) {
    segment_sum<double>(values, rowptr, out, rows, width);
}
"""

_KERNEL_NAMES = {torch.float32: "segment_sum_f32", torch.float64: "segment_sum_f64"}
_KERNELS = SourceKernels(SEGMENT_SUM_SOURCE, list(_KERNEL_NAMES.values()), "segment_sum")


def segment_sum_reference(values: Tensor, rowptr: Tensor) -> Tensor:
    """The same sums from one FP64 prefix sum over the columns laid end to end (one parallel 1-D scan; a column's
    carry cancels in the differences): any device, differentiable."""
    rows, width = values.shape
    flat = values.t().to(torch.float64).reshape(-1)
    prefix = torch.cat([flat.new_zeros(1), torch.cumsum(flat, 0)])
    column_start = (torch.arange(width, device=values.device) * rows).unsqueeze(1)  # [K, 1]
    ends = prefix.index_select(0, (column_start + rowptr[1:]).reshape(-1))
    starts = prefix.index_select(0, (column_start + rowptr[:-1]).reshape(-1))
    return (ends - starts).reshape(width, -1).t().to(values.dtype)


def _launch(values: Tensor, rowptr: Tensor) -> Tensor:
    from .core.runtime import I32

    values = values.contiguous()
    rowptr = rowptr.to(torch.int64).contiguous()
    rows, width = rowptr.shape[0] - 1, values.shape[1]
    out = values.new_empty((rows, width))
    if rows == 0 or width == 0:
        return out
    threads = 32 * _WARPS_PER_BLOCK
    _KERNELS.get(_KERNEL_NAMES[values.dtype], values.device).launch(
        (-(-rows // _WARPS_PER_BLOCK),), (threads,), [values, rowptr, out, I32(rows), I32(width)])
    return out


class _SegmentSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values: Tensor, rowptr: Tensor) -> Tensor:
        ctx.save_for_backward(rowptr)
        ctx.count = values.shape[0]
        return _launch(values, rowptr)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        (rowptr,) = ctx.saved_tensors
        # each element's row and whether it lies inside one (device arithmetic, no sync)
        element = torch.arange(ctx.count, device=rowptr.device, dtype=rowptr.dtype)
        row = (torch.searchsorted(rowptr, element, right=True) - 1).clamp(0, max(rowptr.shape[0] - 2, 0))
        inside = (element >= rowptr[0]) & (element < rowptr[-1])
        return grad.index_select(0, row) * inside.unsqueeze(1).to(grad.dtype), None


def segment_sum(values: Tensor, rowptr: Tensor) -> Tensor:
    """[N, K] sums of the rows rowptr[i] .. rowptr[i + 1] - 1 of ``values`` [C, K] (FP32, FP64) in a fixed order;
    rowptr [N + 1] non-decreasing, rowptr[-1] <= C (not checked: it lives on the device)."""
    if values.dim() != 2:
        raise ValueError(f"values: expected a [C, K] tensor, got shape {tuple(values.shape)}")
    if rowptr.dim() != 1 or rowptr.shape[0] < 1:
        raise ValueError(f"rowptr: expected a 1-D tensor of N + 1 row starts, got shape {tuple(rowptr.shape)}")
    if values.device.type != "cuda" or values.dtype not in _KERNEL_NAMES:
        return segment_sum_reference(values, rowptr)
    if rowptr.device != values.device:
        raise ValueError(f"rowptr: on {rowptr.device}, values on {values.device}")
    return _SegmentSum.apply(values, rowptr)

