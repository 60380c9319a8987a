"""Evaluating a radial table for every edge: custom ops with a CUDA kernel, a torch path and autograd.

    radial_table(r, coeffs, r_max)[e, j] = W_j(r_e)          r [E], coeffs [N, C, 4] -> [E, C]

``radial_table_eval`` (the table or its k-th derivative, [E, C]) and ``radial_table_dot`` (sum_j g[e, j]
d^k W_j / dr^k (r_e), [E]: the backward), each differentiable again. r is clamped into [0, r_max] (end values
outside, zero derivatives there; NaN stays NaN). CUDA: a warp per edge, lanes over columns, a column's four
coefficients one 16-byte load. Wide tables (``SORT_MIN_COLUMNS``; ``by_length``: -1 this rule, 0 never, 1 always)
visit the edges in order of length, so a block's edges share intervals in L1. The dot product's partial sums meet
in a fixed butterfly: the same result every run.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.custom_op import custom_op
from ..core.registry import DTYPE_SUFFIX, SourceKernels

_MAX_ORDER = 3  # a cubic's fourth derivative is zero

# The device functions that read a table (also rendered into the convolution kernels that read one: a layer's
# weights evaluated per edge inside the tensor product, ``convolution.ops.conv_table_forward``).
CUBIC_SOURCE = r"""
// The four cubic coefficients of one column of one interval: adjacent in memory ([N, C, 4] layout), one 16-byte
// load in FP32, two in FP64.
template <typename T> struct Cubic;
template <> struct Cubic<float> {
    float c0, c1, c2, c3;
    __device__ __forceinline__ static Cubic load(const float* p) {
        const float4 v = __ldg(reinterpret_cast<const float4*>(p));
        return {v.x, v.y, v.z, v.w};
    }
};
template <> struct Cubic<double> {
    double c0, c1, c2, c3;
    __device__ __forceinline__ static Cubic load(const double* p) {
        const double2* q = reinterpret_cast<const double2*>(p);
        const double2 a = __ldg(q), b = __ldg(q + 1);
        return {a.x, a.y, b.x, b.y};
    }
};

// d^ORDER/dt^ORDER of the cubic at t (the caller multiplies by scale^ORDER); a compile-time order, so the column
// loops below have no branch and unroll.
template <int ORDER, typename T>
__device__ __forceinline__ T derivative(const Cubic<T>& c, T t) {
    if (ORDER == 0) return ((c.c3 * t + c.c2) * t + c.c1) * t + c.c0;
    if (ORDER == 1) return ((T)3 * c.c3 * t + (T)2 * c.c2) * t + c.c1;
    if (ORDER == 2) return (T)6 * c.c3 * t + (T)2 * c.c2;
    return (T)6 * c.c3;
}

// The interval's coefficients and the position t inside it of length r, clamped into [0, r_max]; `factor`
// multiplies the cubic: scale^order inside, 0 outside for derivatives (the clamp's), NaN for a NaN length.
template <typename T>
__device__ __forceinline__ const T* locate(const T* __restrict__ coeffs, T r, int n, int cols, T scale, T r_max,
                                           int order, T& t, T& factor) {
    T u = r * scale;
    u = u > (T)0 ? u : (T)0;  // also maps NaN to 0: the read stays in bounds
    u = u < (T)n ? u : (T)n;
    const int k = min((int)u, n - 1);
    t = u - (T)k;
    factor = (T)1;
    for (int i = 0; i < order; ++i) factor *= scale;
    if (order > 0 && !(r >= (T)0 && r <= r_max)) factor = (T)0;
    if (r != r) factor = r;
    return coeffs + (long long)k * cols * 4;
}
"""

RADIAL_TABLE_SOURCE = CUBIC_SOURCE + r"""
// Block b takes positions [b * per_block, (b + 1) * per_block) of `by_length` (edge ids in order of length; null:
// the edges' own order), one warp per edge, lanes over the columns.
#define FOR_EACH_EDGE(...)                                                                                     \
    const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;                                                \
    const long long p_end = min((long long)(blockIdx.x + 1) * per_block, edges);                               \
    for (long long p = (long long)blockIdx.x * per_block + (threadIdx.x >> 5); p < p_end; p += warps) {        \
        const long long e = by_length ? by_length[p] : p;                                                      \
        T t, factor;                                                                                           \
        const T* row = locate(coeffs, r[e], n, cols, scale, r_max, ORDER, t, factor);                          \
        __VA_ARGS__                                                                                            \
    }

template <typename T, int ORDER>
__device__ void table_eval(const T* __restrict__ r, const long long* __restrict__ by_length,
                           const T* __restrict__ coeffs, T* __restrict__ out, long long edges, long long per_block,
                           int n, int cols, T scale, T r_max) {
    FOR_EACH_EDGE(
        T* o = out + e * cols;
        for (int j = lane; j < cols; j += 32) o[j] = factor * derivative<ORDER>(Cubic<T>::load(row + 4 * j), t);
    )
}

template <typename T, int ORDER>
__device__ void table_dot(const T* __restrict__ r, const long long* __restrict__ by_length,
                          const T* __restrict__ coeffs, const T* __restrict__ g, T* __restrict__ out, long long edges,
                          long long per_block, int n, int cols, T scale, T r_max) {
    FOR_EACH_EDGE(
        const T* ge = g + e * cols;
        T sum = (T)0;
#pragma unroll 4  // the loads of four columns in flight at once
        for (int j = lane; j < cols; j += 32) sum += ge[j] * derivative<ORDER>(Cubic<T>::load(row + 4 * j), t);
        for (int s = 16; s > 0; s >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, s);
        if (lane == 0) out[e] = factor * sum;
    )
}

#define RADIAL_TABLE_KERNELS(T, SUFFIX)                                                                        \
extern "C" __global__ void radial_table_eval_##SUFFIX(const T* r, const long long* by_length, const T* coeffs, \
                                                      T* out, long long edges, long long per_block, int n,     \
                                                      int cols, T scale, T r_max, int order) {                 \
    switch (order) {  /* orders above 3 never reach a kernel: the op returns zeros */                          \
        case 0: table_eval<T, 0>(r, by_length, coeffs, out, edges, per_block, n, cols, scale, r_max); break;   \
        case 1: table_eval<T, 1>(r, by_length, coeffs, out, edges, per_block, n, cols, scale, r_max); break;   \
        case 2: table_eval<T, 2>(r, by_length, coeffs, out, edges, per_block, n, cols, scale, r_max); break;   \
        default: table_eval<T, 3>(r, by_length, coeffs, out, edges, per_block, n, cols, scale, r_max);         \
    }                                                                                                          \
}                                                                                                              \
extern "C" __global__ void radial_table_dot_##SUFFIX(const T* r, const long long* by_length, const T* coeffs,  \
                                                     const T* g, T* out, long long edges, long long per_block, \
                                                     int n, int cols, T scale, T r_max, int order) {           \
    switch (order) {                                                                                           \
        case 0: table_dot<T, 0>(r, by_length, coeffs, g, out, edges, per_block, n, cols, scale, r_max); break; \
        case 1: table_dot<T, 1>(r, by_length, coeffs, g, out, edges, per_block, n, cols, scale, r_max); break; \
        case 2: table_dot<T, 2>(r, by_length, coeffs, g, out, edges, per_block, n, cols, scale, r_max); break; \
        default: table_dot<T, 3>(r, by_length, coeffs, g, out, edges, per_block, n, cols, scale, r_max);       \
    }                                                                                                          \
}
RADIAL_TABLE_KERNELS(float, f32)
RADIAL_TABLE_KERNELS(double, f64)
"""

_WARPS = 8
_BLOCKS_PER_SM = 8  # runs of edges per SM: long runs share intervals, enough blocks to balance the SMs
SORT_MIN_EDGES = 16384
SORT_MIN_COLUMNS = 640  # 1280 columns gain from the sort, 512 tie, 224 lose (measured: docs/measured-constants.md)


def radial_table_reference(r: Tensor, coeffs: Tensor, r_max: float, order: int = 0) -> Tensor:
    """The table's order-th derivative at every r (torch, any device): [E, C]; the same clamping as the kernels."""
    n = coeffs.shape[0]
    scale = n / r_max
    u = (r * scale).clamp(0.0, float(n))
    k = torch.nan_to_num(u, nan=0.0).floor().clamp(max=n - 1)
    t = (u - k).unsqueeze(1)
    c0, c1, c2, c3 = coeffs.index_select(0, k.long()).unbind(2)
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


_KERNELS = SourceKernels(RADIAL_TABLE_SOURCE, [f"radial_table_{op}_{s}" for op in ("eval", "dot")
                                               for s in DTYPE_SUFFIX.values()], "radial_table")


def sorts_by_length(edges: int, columns: int, by_length: int = -1) -> bool:
    """Whether the kernels visit the edges in order of length: ``by_length`` 1 always, 0 never, -1 (default) for
    ``SORT_MIN_EDGES`` edges or more of ``SORT_MIN_COLUMNS`` columns or more (module doc)."""
    if by_length not in (-1, 0, 1):
        raise ValueError(f"by_length must be -1 (the size rule), 0 or 1, got {by_length!r}")
    if by_length >= 0:
        return bool(by_length)
    return edges >= SORT_MIN_EDGES and columns >= SORT_MIN_COLUMNS


def _launch(op: str, r: Tensor, coeffs: Tensor, g: Tensor | None, out: Tensor, r_max: float, order: int,
            by_length: int) -> None:
    from ..core.runtime import F32, F64, I32, I64

    edges, (n, cols, _) = r.shape[0], coeffs.shape
    if out.numel() == 0:
        return
    device = r.device.index if r.device.index is not None else torch.cuda.current_device()
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    real = F32 if r.dtype == torch.float32 else F64
    if coeffs.data_ptr() % 16:  # the kernels read each column's four coefficients as one 16-byte vector
        coeffs = coeffs.clone()
    order_by_length = torch.argsort(r) if sorts_by_length(edges, cols, by_length) else None
    per_block = max(1, -(-edges // (_BLOCKS_PER_SM * sms)))
    blocks = -(-edges // per_block)
    threads = 32 * _WARPS
    tensors = [r, order_by_length, coeffs, out] if op == "eval" else [r, order_by_length, coeffs, g, out]
    kernel = _KERNELS.get(f"radial_table_{op}_{DTYPE_SUFFIX[r.dtype]}", r.device)
    kernel.launch((blocks,), (threads,), [*tensors, I64(edges), I64(per_block), I32(n), I32(cols), real(n / r_max),
                                          real(r_max), I32(order)])


def _eval_fake(r, coeffs, r_max, order, by_length=-1):
    return r.new_empty(r.shape[0], coeffs.shape[1])


def _eval_grad(ctx, g):
    r, coeffs = ctx.saved_tensors
    r_max, order, by_length = ctx.args
    return radial_table_dot(r, coeffs, g.contiguous(), r_max, order + 1, by_length), None, None, None, None


@custom_op("radial_table_eval", _eval_fake, _eval_grad)
def radial_table_eval(r: Tensor, coeffs: Tensor, r_max: float, order: int, by_length: int = -1) -> Tensor:
    """The table's order-th derivative in r for every edge: [E, C]. ``by_length``: see ``sorts_by_length``."""
    if r.device.type != "cuda" or order > _MAX_ORDER:
        return radial_table_reference(r, coeffs, r_max, order)
    out = r.new_empty(r.shape[0], coeffs.shape[1])
    _launch("eval", r.contiguous(), coeffs.contiguous(), None, out, r_max, order, by_length)
    return out


def _dot_fake(r, coeffs, g, r_max, order, by_length=-1):
    return r.new_empty(r.shape[0])


def _dot_grad(ctx, gs):
    r, coeffs, g = ctx.saved_tensors
    r_max, order, by_length = ctx.args
    gg = gs.unsqueeze(1) * radial_table_eval(r, coeffs, r_max, order, by_length)
    return gs * radial_table_dot(r, coeffs, g, r_max, order + 1, by_length), None, gg, None, None, None


@custom_op("radial_table_dot", _dot_fake, _dot_grad)
def radial_table_dot(r: Tensor, coeffs: Tensor, g: Tensor, r_max: float, order: int, by_length: int = -1) -> Tensor:
    """sum_j g[e, j] times the table's order-th derivative in r at r_e: [E]. ``by_length``: see ``sorts_by_length``."""
    if r.device.type != "cuda" or order > _MAX_ORDER:
        return (g * radial_table_reference(r, coeffs, r_max, order)).sum(1)
    out = r.new_empty(r.shape[0])
    _launch("dot", r.contiguous(), coeffs.contiguous(), g.contiguous(), out, r_max, order, by_length)
    return out


def radial_table(r: Tensor, coeffs: Tensor, r_max: float, *, by_length: int = -1) -> Tensor:
    """W(r) [E, C] for lengths r ([E] or [E, 1]) from a table's coefficients [N, C, 4] over [0, r_max] (in r's
    dtype and device; constants: they get no gradient). Differentiable in r to any order. ``by_length``: the order
    the CUDA kernels visit the edges in (``sorts_by_length``; the same numbers either way)."""
    if not isinstance(r, Tensor) or not isinstance(coeffs, Tensor):
        raise TypeError(f"r and coeffs must be tensors, got {type(r).__name__} and {type(coeffs).__name__}")
    if r.dim() == 2 and r.shape[1] == 1:
        r = r.squeeze(1)
    if r.dim() != 1:
        raise ValueError(f"r: expected edge lengths [E] or [E, 1], got shape {list(r.shape)}")
    check_table(coeffs, r_max)
    if r.dtype not in DTYPE_SUFFIX or coeffs.dtype != r.dtype:
        raise ValueError(f"r and coeffs must both be float32 or both float64, got {r.dtype} and {coeffs.dtype}")
    if r.device != coeffs.device:
        raise ValueError(f"r is on {r.device}, coeffs on {coeffs.device}")
    sorts_by_length(0, 0, by_length)  # checks it
    return radial_table_eval(r, coeffs, float(r_max), 0, by_length)


def check_table(coeffs: Tensor, r_max: float, columns: int | None = None) -> None:
    """A table's coefficients [N, C, 4] (C = ``columns`` when given), constants, over [0, r_max], r_max > 0."""
    if (coeffs.dim() != 3 or coeffs.shape[2] != 4 or coeffs.shape[0] < 1
            or (columns is not None and coeffs.shape[1] != columns)):
        raise ValueError(f"coeffs: expected [N, {'C' if columns is None else columns}, 4] cubic coefficients (N "
                         f"intervals), got shape {list(coeffs.shape)}")
    if coeffs.requires_grad:
        raise ValueError("coeffs: a table's coefficients are constants here (they require grad)")
    if not (isinstance(r_max, (int, float)) and r_max > 0):
        raise ValueError(f"r_max must be a positive number, got {r_max!r}")
