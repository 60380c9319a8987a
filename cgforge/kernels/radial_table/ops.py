"""Evaluating a radial table for every edge: custom ops with a CUDA kernel, a torch path and autograd.

    radial_table(r, coeffs, r_max)[e, j] = W_j(r_e)          r [E], coeffs [N, 4, C] -> [E, C]

Two ops, each differentiable again, so forces (first derivatives in r) and their derivatives work:
``radial_table_eval`` (the table or its k-th derivative in r, [E, C]) and ``radial_table_dot``
(sum_j g[e, j] d^k W_j / dr^k (r_e), [E]: the backward, which never forms the derivative table for all
edges). r is clamped into [0, r_max], where the table is defined: the values hold their end values
outside, the derivatives are zero there (what the clamp's derivative is), and a NaN length gives NaN.

CUDA: the evaluation is one thread per output element (coalesced along the columns, memory-bound: it
writes the weights once and reads four coefficient rows per edge, mostly from L2); the dot product one
warp per edge, its lanes' partial sums met in a fixed butterfly, so the result is the same on every run.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from ..core.custom_op import custom_op

__all__ = ["RADIAL_TABLE_SOURCE", "radial_table", "radial_table_dot", "radial_table_eval", "radial_table_reference"]

_MAX_ORDER = 3  # a cubic's fourth derivative is zero

RADIAL_TABLE_SOURCE = r"""
// d^order/dr^order of the cubic of interval k at t (before the factor scale^order); c points at column j of
// interval k, whose four coefficients lie `cols` apart.
template <typename T>
__device__ __forceinline__ T cubic(const T* __restrict__ c, int cols, T t, int order) {
    const T c0 = c[0], c1 = c[cols], c2 = c[2 * cols], c3 = c[3 * cols];
    switch (order) {
        case 0: return ((c3 * t + c2) * t + c1) * t + c0;
        case 1: return ((T)3 * c3 * t + (T)2 * c2) * t + c1;
        case 2: return (T)6 * c3 * t + (T)2 * c2;
        case 3: return (T)6 * c3;
        default: return (T)0;
    }
}

// The interval and the position inside it of length r, clamped into [0, r_max]; `factor` multiplies the
// cubic's value: scale^order inside, 0 outside for derivatives (the clamp's), NaN for a NaN length.
template <typename T>
__device__ __forceinline__ const T* locate(const T* __restrict__ coeffs, T r, int n, int cols, T scale, T r_max,
                                           int order, int j, T& t, T& factor) {
    T u = r * scale;
    u = u > (T)0 ? u : (T)0;  // also maps NaN to 0: the read stays in bounds
    u = u < (T)n ? u : (T)n;
    const int k = min((int)u, n - 1);
    t = u - (T)k;
    factor = (T)1;
    for (int i = 0; i < order; ++i) factor *= scale;
    if (order > 0 && !(r >= (T)0 && r <= r_max)) factor = (T)0;
    if (r != r) factor = r;
    return coeffs + (long long)k * 4 * cols + j;
}

template <typename T>
__device__ void table_eval(const T* __restrict__ r, const T* __restrict__ coeffs, T* __restrict__ out,
                           long long edges, int n, int cols, T scale, T r_max, int order) {
    const long long total = edges * cols;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long e = i / cols;
        const int j = (int)(i - e * cols);
        T t, factor;
        const T* c = locate(coeffs, r[e], n, cols, scale, r_max, order, j, t, factor);
        out[i] = factor * cubic(c, cols, t, order);
    }
}

template <typename T>
__device__ void table_dot(const T* __restrict__ r, const T* __restrict__ coeffs, const T* __restrict__ g,
                          T* __restrict__ out, long long edges, int n, int cols, T scale, T r_max, int order) {
    const int lane = threadIdx.x & 31;
    const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
    for (long long e = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; e < edges; e += warps) {
        T t, factor, sum = (T)0;
        const T* c = locate(coeffs, r[e], n, cols, scale, r_max, order, 0, t, factor);
        for (int j = lane; j < cols; j += 32) sum += g[e * cols + j] * cubic(c + j, cols, t, order);
        for (int s = 16; s > 0; s >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, s);
        if (lane == 0) out[e] = factor * sum;
    }
}

#define RADIAL_TABLE_KERNELS(T, SUFFIX)                                                                        \
extern "C" __global__ void radial_table_eval_##SUFFIX(const T* r, const T* coeffs, T* out, long long edges,   \
                                                      int n, int cols, T scale, T r_max, int order) {         \
    table_eval<T>(r, coeffs, out, edges, n, cols, scale, r_max, order);                                       \
}                                                                                                              \
extern "C" __global__ void radial_table_dot_##SUFFIX(const T* r, const T* coeffs, const T* g, T* out,         \
                                                     long long edges, int n, int cols, T scale, T r_max,      \
                                                     int order) {                                              \
    table_dot<T>(r, coeffs, g, out, edges, n, cols, scale, r_max, order);                                      \
}
RADIAL_TABLE_KERNELS(float, f32)
RADIAL_TABLE_KERNELS(double, f64)
"""

_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}
_EVAL_THREADS = 256
_DOT_WARPS = 8
_BLOCKS_PER_SM = 32  # grid-stride loops: enough blocks to fill the GPU, no more


def radial_table_reference(r: Tensor, coeffs: Tensor, r_max: float, order: int = 0) -> Tensor:
    """The table's order-th derivative at every r (torch, any device): [E, C]; the same clamping as the kernels."""
    n = coeffs.shape[0]
    scale = n / r_max
    u = (r * scale).clamp(0.0, float(n))
    k = torch.nan_to_num(u, nan=0.0).floor().clamp(max=n - 1)
    t = (u - k).unsqueeze(1)
    c0, c1, c2, c3 = coeffs.index_select(0, k.long()).unbind(1)
    if order == 0:
        v = ((c3 * t + c2) * t + c1) * t + c0
    elif order == 1:
        v = ((3 * c3 * t + 2 * c2) * t + c1) * scale
    elif order == 2:
        v = (6 * c3 * t + 2 * c2) * scale ** 2
    elif order == 3:
        v = 6 * c3 * scale ** 3 + 0 * t
    else:
        v = torch.zeros_like(c0)
    if order > 0:
        v = v * ((r >= 0) & (r <= r_max)).unsqueeze(1).to(v.dtype)
    return torch.where(r.isnan().unsqueeze(1), r.unsqueeze(1), v)


@functools.cache
def _kernels(device_index: int) -> dict:
    from ..core.runtime import load_source

    names = [f"radial_table_{op}_{s}" for op in ("eval", "dot") for s in _SUFFIX.values()]
    with torch.cuda.device(device_index):
        return load_source(RADIAL_TABLE_SOURCE, names, name="radial_table.cu")


def _launch(op: str, r: Tensor, coeffs: Tensor, g: Tensor | None, out: Tensor, r_max: float, order: int) -> None:
    from ..core.runtime import F32, F64, I32, I64

    edges, (n, _, cols) = r.shape[0], coeffs.shape
    if out.numel() == 0:
        return
    device = r.device.index if r.device.index is not None else torch.cuda.current_device()
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    real = F32 if r.dtype == torch.float32 else F64
    if op == "eval":
        threads, work = _EVAL_THREADS, edges * cols
        tensors = [r, coeffs, out]
    else:
        threads, work = 32 * _DOT_WARPS, edges * 32
        tensors = [r, coeffs, g, out]
    blocks = max(1, min(-(-work // threads), _BLOCKS_PER_SM * sms))
    kernel = _kernels(device)[f"radial_table_{op}_{_SUFFIX[r.dtype]}"]
    kernel.launch((blocks,), (threads,), [*tensors, I64(edges), I32(n), I32(cols), real(n / r_max), real(r_max),
                                          I32(order)])


def _eval_fake(r, coeffs, r_max, order):
    return r.new_empty(r.shape[0], coeffs.shape[2])


def _eval_grad(ctx, g):
    r, coeffs = ctx.saved_tensors
    r_max, order = ctx.args
    return radial_table_dot(r, coeffs, g.contiguous(), r_max, order + 1), None, None, None


@custom_op("radial_table_eval", _eval_fake, _eval_grad)
def radial_table_eval(r: Tensor, coeffs: Tensor, r_max: float, order: int) -> Tensor:
    """The table's order-th derivative in r for every edge: [E, C]."""
    if r.device.type != "cuda" or order > _MAX_ORDER:
        return radial_table_reference(r, coeffs, r_max, order)
    out = r.new_empty(r.shape[0], coeffs.shape[2])
    _launch("eval", r.contiguous(), coeffs.contiguous(), None, out, r_max, order)
    return out


def _dot_fake(r, coeffs, g, r_max, order):
    return r.new_empty(r.shape[0])


def _dot_grad(ctx, gs):
    r, coeffs, g = ctx.saved_tensors
    r_max, order = ctx.args
    gg = gs.unsqueeze(1) * radial_table_eval(r, coeffs, r_max, order)
    return gs * radial_table_dot(r, coeffs, g, r_max, order + 1), None, gg, None, None


@custom_op("radial_table_dot", _dot_fake, _dot_grad)
def radial_table_dot(r: Tensor, coeffs: Tensor, g: Tensor, r_max: float, order: int) -> Tensor:
    """sum_j g[e, j] times the table's order-th derivative in r at r_e: [E]."""
    if r.device.type != "cuda" or order > _MAX_ORDER:
        return (g * radial_table_reference(r, coeffs, r_max, order)).sum(1)
    out = r.new_empty(r.shape[0])
    _launch("dot", r.contiguous(), coeffs.contiguous(), g.contiguous(), out, r_max, order)
    return out


def radial_table(r: Tensor, coeffs: Tensor, r_max: float) -> Tensor:
    """W(r) [E, C] for lengths r ([E] or [E, 1]) from a table's coefficients [N, 4, C] over [0, r_max] (in r's
    dtype and device; constants: they get no gradient). Differentiable in r to any order."""
    if not isinstance(r, Tensor) or not isinstance(coeffs, Tensor):
        raise TypeError(f"r and coeffs must be tensors, got {type(r).__name__} and {type(coeffs).__name__}")
    if r.dim() == 2 and r.shape[1] == 1:
        r = r.squeeze(1)
    if r.dim() != 1:
        raise ValueError(f"r: expected edge lengths [E] or [E, 1], got shape {list(r.shape)}")
    if coeffs.dim() != 3 or coeffs.shape[1] != 4 or coeffs.shape[0] < 1:
        raise ValueError(f"coeffs: expected [N, 4, C] cubic coefficients, got shape {list(coeffs.shape)}")
    if r.dtype not in _SUFFIX or coeffs.dtype != r.dtype:
        raise ValueError(f"r and coeffs must both be float32 or both float64, got {r.dtype} and {coeffs.dtype}")
    if r.device != coeffs.device:
        raise ValueError(f"r is on {r.device}, coeffs on {coeffs.device}")
    if coeffs.requires_grad:
        raise ValueError("coeffs: a table's coefficients are constants here (they require grad)")
    if not (isinstance(r_max, (int, float)) and r_max > 0):
        raise ValueError(f"r_max must be a positive number, got {r_max!r}")
    return radial_table_eval(r, coeffs, float(r_max), 0)
