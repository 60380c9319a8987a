"""Gated activations in one pass: e3nn's ``Gate`` and ``Activation`` as a table of output columns, each one of

    out[:, j] = scale_j * f_j(x[:, src_j])                      (a scalar: gate_j = -1)
    out[:, j] = scale_j * x[:, src_j] * f_j(x[:, gate_j])       (a component of a gated irrep)

with f_j one of ``ACTIVATIONS``. One kernel forward (a thread per output element), one backward (a thread per input
element summing the columns that read it, ``GateTable.readers``: no atomics). A differentiable backward runs
``gate_backward_reference``; off CUDA, other dtypes and under torch.compile the layer is ``gate_reference``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from .core.registry import DTYPE_SUFFIX, SourceKernels

# The activations the kernels evaluate, by code (the table's ``code`` entries).
ACTIVATIONS = ("identity", "silu", "tanh", "sigmoid")

GATE_SOURCE = r"""
__device__ __forceinline__ float cg_exp(float x) { return expf(x); }
__device__ __forceinline__ double cg_exp(double x) { return exp(x); }
__device__ __forceinline__ float cg_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ double cg_tanh(double x) { return tanh(x); }

// f(x) for the codes of ACTIVATIONS: identity, silu, tanh, sigmoid
template <typename T>
__device__ __forceinline__ T activation(int code, T x) {
    if (code == 1) return x / (T(1) + cg_exp(-x));
    if (code == 2) return cg_tanh(x);
    if (code == 3) return T(1) / (T(1) + cg_exp(-x));
    return x;
}

// f'(x)
template <typename T>
__device__ __forceinline__ T activation_slope(int code, T x) {
    if (code == 1) { const T s = T(1) / (T(1) + cg_exp(-x)); return s * (T(1) + x * (T(1) - s)); }
    if (code == 2) { const T t = cg_tanh(x); return T(1) - t * t; }
    if (code == 3) { const T s = T(1) / (T(1) + cg_exp(-x)); return s * (T(1) - s); }
    return T(1);
}

// This thread's element (row, col) of a [rows, width] array, one thread per element; false past the end.
__device__ __forceinline__ bool element_of_thread(long long rows, int width, long long& row, int& col) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    row = i / width;
    col = (int)(i - row * width);
    return i < rows * width;
}

// One thread per output element.
template <typename T>
__device__ void gate_forward(const T* __restrict__ x, T* __restrict__ out, const int* __restrict__ src,
                             const int* __restrict__ gate, const int* __restrict__ code,
                             const T* __restrict__ scale, long long rows, int in_width, int out_width) {
    long long row;
    int j;
    if (!element_of_thread(rows, out_width, row, j)) return;
    const T* xr = x + row * in_width;
    const T v = xr[src[j]];
    const int g = gate[j];
    out[row * out_width + j] = g < 0 ? scale[j] * activation(code[j], v) : scale[j] * v * activation(code[j], xr[g]);
}

// One thread per input element: the sum over the output columns that read it (readers, a CSR by input column;
// role 0: it is column j's scalar, 1: j's gated value, 2: j's gate).
template <typename T>
__device__ void gate_backward(const T* __restrict__ x, const T* __restrict__ grad_out, T* __restrict__ grad_x,
                              const int* __restrict__ src, const int* __restrict__ gate,
                              const int* __restrict__ code, const T* __restrict__ scale,
                              const int* __restrict__ reader_ptr, const int* __restrict__ reader_col,
                              const int* __restrict__ reader_role, long long rows, int in_width, int out_width) {
    long long row;
    int c;
    if (!element_of_thread(rows, in_width, row, c)) return;
    const T* xr = x + row * in_width;
    const T* gr = grad_out + row * out_width;
    const T v = xr[c];
    T sum = T(0);
    for (int k = reader_ptr[c]; k < reader_ptr[c + 1]; ++k) {
        const int j = reader_col[k];
        const int role = reader_role[k];
        const T weighted = gr[j] * scale[j];
        if (role == 0) sum += weighted * activation_slope(code[j], v);
        else if (role == 1) sum += weighted * activation(code[j], xr[gate[j]]);
        else sum += weighted * xr[src[j]] * activation_slope(code[j], v);
    }
    grad_x[row * in_width + c] = sum;
}

#define CG_GATE_KERNELS(T, SUFFIX)                                                                               \
extern "C" __global__ void gate_forward_##SUFFIX(const T* x, T* out, const int* src, const int* gate,           \
        const int* code, const T* scale, long long rows, int in_width, int out_width) {                         \
    gate_forward<T>(x, out, src, gate, code, scale, rows, in_width, out_width);                                 \
}                                                                                                                \
extern "C" __global__ void gate_backward_##SUFFIX(const T* x, const T* grad_out, T* grad_x, const int* src,     \
        const int* gate, const int* code, const T* scale, const int* reader_ptr, const int* reader_col,         \
        const int* reader_role, long long rows, int in_width, int out_width) {                                  \
    gate_backward<T>(x, grad_out, grad_x, src, gate, code, scale, reader_ptr, reader_col, reader_role, rows,   \
                     in_width, out_width);                                                                       \
}
CG_GATE_KERNELS(float, f32)
CG_GATE_KERNELS(double, f64)
"""

_KERNELS = SourceKernels(GATE_SOURCE, [f"gate_{d}_{s}" for s in DTYPE_SUFFIX.values() for d in ("forward", "backward")],
                         "gate")
_THREADS = 256


@dataclass(frozen=True)
class GateTable:
    """A gated activation layer as values: per output column its source column, its gate column (-1: none), the
    code of its activation (``ACTIVATIONS``) and its scale; ``in_width`` columns in, at least one out."""

    in_width: int
    src: tuple[int, ...]
    gate: tuple[int, ...]
    code: tuple[int, ...]
    scale: tuple[float, ...]

    def __post_init__(self) -> None:
        width = len(self.src)
        if width == 0:
            raise ValueError("GateTable: no output columns")
        if not (len(self.gate) == len(self.code) == len(self.scale) == width):
            raise ValueError(f"GateTable: src, gate, code and scale differ in length "
                             f"({width}, {len(self.gate)}, {len(self.code)}, {len(self.scale)})")
        for name, cols, least in (("src", self.src, 0), ("gate", self.gate, -1)):
            bad = [c for c in cols if not least <= c < self.in_width]
            if bad:
                raise ValueError(f"GateTable: {name} column {bad[0]} outside [{least}, {self.in_width})")
        bad = [c for c in self.code if not 0 <= c < len(ACTIVATIONS)]
        if bad:
            raise ValueError(f"GateTable: activation code {bad[0]}; the codes are 0..{len(ACTIVATIONS) - 1} "
                             f"({', '.join(ACTIVATIONS)})")
        if any(s == g for s, g in zip(self.src, self.gate)):
            raise ValueError("GateTable: a column gated by its own source")

    def readers(self) -> tuple[list[int], list[int], list[int]]:
        """The table's transpose, a CSR by input column: (row pointer [in_width + 1], output column, role), role 0
        where the input is column j's scalar, 1 its gated value, 2 its gate."""
        entries: list[list[tuple[int, int]]] = [[] for _ in range(self.in_width)]
        for j, (s, g) in enumerate(zip(self.src, self.gate)):
            entries[s].append((j, 0 if g < 0 else 1))
            if g >= 0:
                entries[g].append((j, 2))
        ptr = [0]
        for e in entries:
            ptr.append(ptr[-1] + len(e))
        return ptr, [j for e in entries for j, _ in e], [r for e in entries for _, r in e]

    def arrays(self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float64) -> GateArrays:
        """The table as the tensors the kernels read (``scale`` in ``dtype``)."""
        def ints(values: list[int] | tuple[int, ...]) -> Tensor:
            return torch.tensor(list(values) or [0], dtype=torch.int32, device=device)

        ptr, col, role = self.readers()
        return GateArrays(ints(self.src), ints(self.gate), ints(self.code),
                          torch.tensor(self.scale, dtype=dtype, device=device), ints(ptr), ints(col), ints(role))


class GateArrays(NamedTuple):
    """``GateTable.arrays``: int32 ``src``, ``gate``, ``code`` and ``scale`` per output column, and the readers'
    CSR (``reader_ptr`` [in_width + 1], ``reader_col``, ``reader_role``). A module keeps them as buffers, so they
    move with it (and none is made while a CUDA graph is being captured)."""

    src: Tensor
    gate: Tensor
    code: Tensor
    scale: Tensor
    reader_ptr: Tensor
    reader_col: Tensor
    reader_role: Tensor

    @property
    def in_width(self) -> int:
        return self.reader_ptr.shape[0] - 1

    @property
    def out_width(self) -> int:
        return self.src.shape[0]


def _activation(code: Tensor, v: Tensor, slope: bool) -> Tensor:
    """f(v) (or f'(v)) with each column's activation ``code`` [width] (torch ops, any order of derivatives). Every
    activation is evaluated and selected per column: no value of ``code`` is read on the host, so torch.compile
    traces it as one graph."""
    out = torch.ones_like(v) if slope else v
    for c in range(1, len(ACTIVATIONS)):
        if c == 1:
            s = torch.sigmoid(v)
            value = s * (1 + v * (1 - s)) if slope else v * s
        elif c == 2:
            value = 1 - torch.tanh(v) ** 2 if slope else torch.tanh(v)
        else:
            s = torch.sigmoid(v)
            value = s * (1 - s) if slope else s
        out = torch.where(code == c, value, out)
    return out


def _columns(t: GateArrays, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(which columns are gated, each column's source values, its gate's values, its scale in x's dtype)."""
    return t.gate >= 0, x.index_select(1, t.src), x.index_select(1, t.gate.clamp(min=0)), t.scale.to(x.dtype)


def gate_reference(x: Tensor, t: GateArrays) -> Tensor:
    """The layer in torch ops (module doc): x [rows, in_width] -> [rows, out_width]."""
    gated, xs, xg, scale = _columns(t, x)
    return scale * torch.where(gated, xs * _activation(t.code, xg, False), _activation(t.code, xs, False))


def gate_backward_reference(x: Tensor, grad_out: Tensor, t: GateArrays) -> Tensor:
    """dL/dx of the layer from dL/dout, in torch ops: differentiable in x and grad_out to any order."""
    gated, xs, xg, scale = _columns(t, x)
    weighted = grad_out * scale
    to_src = weighted * torch.where(gated, _activation(t.code, xg, False), _activation(t.code, xs, True))
    to_gate = torch.where(gated, weighted * xs * _activation(t.code, xg, True), torch.zeros_like(xs))
    return torch.zeros_like(x).index_add(1, t.src, to_src).index_add(1, t.gate.clamp(min=0), to_gate)


def _launch(direction: str, x: Tensor, t: GateArrays, grad_out: Tensor | None = None) -> Tensor:
    from .core.runtime import I32, I64

    rows = x.shape[0]
    width = t.out_width if grad_out is None else t.in_width
    out = x.new_empty(rows, width)
    if rows:
        head = [x, out] if grad_out is None else [x, grad_out, out]
        tail = [] if grad_out is None else [t.reader_ptr, t.reader_col, t.reader_role]
        _KERNELS.get(f"gate_{direction}_{DTYPE_SUFFIX[x.dtype]}", x.device).launch(
            (-(-rows * width // _THREADS),), (_THREADS,),
            [*head, t.src, t.gate, t.code, t.scale, *tail, I64(rows), I32(t.in_width), I32(t.out_width)])
    return out


class _Gate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, t: GateArrays) -> Tensor:
        ctx.arrays = t
        ctx.save_for_backward(x)
        return _launch("forward", x, t)

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor, None]:
        (x,) = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        if torch.is_grad_enabled():  # create_graph: a backward that differentiates again
            return gate_backward_reference(x, grad_out, ctx.arrays), None
        return _launch("backward", x, ctx.arrays, grad_out), None


def gate(x: Tensor, t: GateArrays) -> Tensor:
    """The gated activation of ``x`` [rows, in_width] by the table ``t`` (module doc): the kernels on CUDA in FP32
    and FP64 (``t`` on x's device, its scale in x's dtype), ``gate_reference`` elsewhere and under torch.compile."""
    if x.dim() != 2 or x.shape[1] != t.in_width:
        raise ValueError(f"gate: expected x of shape [rows, {t.in_width}], got {tuple(x.shape)}")
    if t.src.device != x.device:
        raise ValueError(f"gate: the table is on {t.src.device}, x on {x.device}")
    if x.device.type != "cuda" or x.dtype not in DTYPE_SUFFIX or torch.compiler.is_compiling():
        return gate_reference(x, t)
    if t.scale.dtype != x.dtype:
        raise ValueError(f"gate: the table's scale is {t.scale.dtype}, x is {x.dtype}")
    return _Gate.apply(x.contiguous(), t)
