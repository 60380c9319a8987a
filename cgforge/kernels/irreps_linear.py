"""Equivariant linear maps (e3nn's ``o3.Linear``, per-species self-connections) as one kernel, with no transposes.

    out[n, q, w, i] = sum over paths p = (j -> q) of  sum_u  x[n, j, u, i] * B_p[u, w]

x and out in e3nn's layout: irrep after irrep, each [mul, 2l + 1] with the channel outermost; B_p a [mul_in,
mul_out] block per path (its path weight folded in). cuBLAS wants the channel innermost (or outermost over all
rows), so a GEMM per path moves each l > 0 block twice ([n, u, i] -> [n * i, u] and back) and concatenates the
outputs: ~4 kernels per path forward and as many backward, each short next to its launch on MD-sized inputs.
Here one kernel writes whole output rows: a block stages ``R`` rows of x in shared memory, channel-major with the
R rows side by side (so one vector load gives a value of all R rows), and a thread owns an output column (q, w,
i), accumulating its R rows over q's paths and their channels u: each B entry is read once per R rows.

Rows can be a subset in any order (``row_index``): the per-species self-connection runs one launch per species
over that species' rows, each with its own B. The backward (grad x) is the same kernel on the transposed map
(``IrrepsMap.transpose``, blocks ``transpose_blocks``): the map is linear, so each derivative is one more call,
to any order. B is frozen (inference: no grad for the weights). FP32 and FP64 on CUDA; ``map_reference`` (torch)
elsewhere and as the oracle.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from .core.registry import SourceKernels

__all__ = ["IRREPS_LINEAR_SOURCE", "IrrepsMap", "LinearLaunch", "MapArrays", "apply_map", "map_reference",
           "tile_rows", "transpose_blocks"]

IRREPS_LINEAR_SOURCE = r"""
// The R staged values of one column: R consecutive scalars, 16-byte aligned (R a multiple of 4 floats, 2 doubles)
template <typename T, int R> struct Column { T v[R]; };
template <int R> __device__ __forceinline__ void load_column(const float* p, Column<float, R>& c) {
    #pragma unroll
    for (int k = 0; k < R; k += 4) {
        const float4 q = *reinterpret_cast<const float4*>(p + k);
        c.v[k] = q.x; c.v[k + 1] = q.y; c.v[k + 2] = q.z; c.v[k + 3] = q.w;
    }
}
template <int R> __device__ __forceinline__ void load_column(const double* p, Column<double, R>& c) {
    #pragma unroll
    for (int k = 0; k < R; k += 2) {
        const double2 q = *reinterpret_cast<const double2*>(p + k);
        c.v[k] = q.x; c.v[k + 1] = q.y;
    }
}

// out[row, :] for the R rows of this block's tile (rows row_index[first .. first + R) or first .. first + R).
// irrep_info [Q, 3] per output irrep: first column, mul_out, 2l + 1; path_ptr [Q + 1] its paths' range in
// path_info [P, 3]: first input column, mul_in, offset of B_p in blocks.
template <typename T, int R>
__device__ void irreps_linear(const T* __restrict__ x, T* __restrict__ out, const T* __restrict__ blocks,
                              const long long* __restrict__ row_index, const int* __restrict__ col_irrep,
                              const int* __restrict__ irrep_info, const int* __restrict__ path_ptr,
                              const int* __restrict__ path_info, long long rows, int in_width, int out_width) {
    extern __shared__ __align__(16) unsigned char smem_bytes[];
    T* staged = reinterpret_cast<T*>(smem_bytes);  // [in_width][R]: column k of tile row r at k * R + r
    const long long first = (long long)blockIdx.x * R;
    const int count = (int)min((long long)R, rows - first);
    for (int e = threadIdx.x; e < R * in_width; e += blockDim.x) {
        const int r = e / in_width, k = e - r * in_width;
        T value = T(0);
        if (r < count) value = x[(row_index ? row_index[first + r] : first + r) * in_width + k];
        staged[k * R + r] = value;
    }
    __syncthreads();
    for (int c = threadIdx.x; c < out_width; c += blockDim.x) {
        const int q = col_irrep[c];
        const int start = irrep_info[3 * q], mul_out = irrep_info[3 * q + 1], d = irrep_info[3 * q + 2];
        const int w = (c - start) / d, i = (c - start) - w * d;
        T acc[R];
        #pragma unroll
        for (int r = 0; r < R; ++r) acc[r] = T(0);
        for (int p = path_ptr[q]; p < path_ptr[q + 1]; ++p) {
            const int mul_in = path_info[3 * p + 1];
            const T* b = blocks + path_info[3 * p + 2] + w;
            const T* column = staged + (long long)(path_info[3 * p] + i) * R;
            for (int u = 0; u < mul_in; ++u) {
                const T m = b[u * mul_out];
                Column<T, R> xs;
                load_column<R>(column + (long long)u * d * R, xs);
                #pragma unroll
                for (int r = 0; r < R; ++r) acc[r] += xs.v[r] * m;
            }
        }
        #pragma unroll
        for (int r = 0; r < R; ++r)
            if (r < count) out[(row_index ? row_index[first + r] : first + r) * out_width + c] = acc[r];
    }
}

#define CG_IRREPS_LINEAR(T, SUFFIX, R)                                                                           \
extern "C" __global__ void irreps_linear_##SUFFIX##_r##R(const T* x, T* out, const T* blocks,                   \
        const long long* row_index, const int* col_irrep, const int* irrep_info, const int* path_ptr,           \
        const int* path_info, long long rows, int in_width, int out_width) {                                    \
    irreps_linear<T, R>(x, out, blocks, row_index, col_irrep, irrep_info, path_ptr, path_info, rows, in_width, \
                        out_width);                                                                              \
}
CG_IRREPS_LINEAR(float, f32, 8)
CG_IRREPS_LINEAR(float, f32, 4)
CG_IRREPS_LINEAR(double, f64, 8)
CG_IRREPS_LINEAR(double, f64, 2)
"""

_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}
_TILES = {torch.float32: (8, 4), torch.float64: (8, 2)}  # rows per block, largest first
_KERNELS = SourceKernels(IRREPS_LINEAR_SOURCE,
                         [f"irreps_linear_{_SUFFIX[t]}_r{r}" for t, rs in _TILES.items() for r in rs], "irreps_linear")
_THREADS = 128
# The staged rows a block may hold: 96 KiB leaves two blocks an SM on every GPU cgforge runs on.
MAX_STAGED_BYTES = 96 << 10


@dataclass(frozen=True)
class IrrepsMap:
    """The shape of an equivariant linear map: (mul, 2l + 1) of each input and output irrep, and its paths
    (i_in, i_out), each a [mul_in, mul_out] block of the weights, laid end to end in path order."""

    irreps_in: tuple[tuple[int, int], ...]
    irreps_out: tuple[tuple[int, int], ...]
    paths: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        for i_in, i_out in self.paths:
            if not (0 <= i_in < len(self.irreps_in) and 0 <= i_out < len(self.irreps_out)):
                raise ValueError(f"IrrepsMap: path ({i_in}, {i_out}) outside {len(self.irreps_in)} input and "
                                 f"{len(self.irreps_out)} output irreps")
            if self.irreps_in[i_in][1] != self.irreps_out[i_out][1]:
                raise ValueError(f"IrrepsMap: path ({i_in}, {i_out}) joins irreps of dimensions "
                                 f"{self.irreps_in[i_in][1]} and {self.irreps_out[i_out][1]}")

    @classmethod
    def of(cls, irreps_in: Sequence, irreps_out: Sequence, paths: Sequence[Sequence[int]]) -> IrrepsMap:
        """The map between e3nn ``Irreps`` (items with ``mul`` and ``ir.dim``) with paths (i_in, i_out, ...)."""
        return cls(tuple((m.mul, m.ir.dim) for m in irreps_in), tuple((m.mul, m.ir.dim) for m in irreps_out),
                   tuple((int(p[0]), int(p[1])) for p in paths))

    @property
    def in_width(self) -> int:
        return sum(m * d for m, d in self.irreps_in)

    @property
    def out_width(self) -> int:
        return sum(m * d for m, d in self.irreps_out)

    def block_shapes(self) -> list[tuple[int, int]]:
        return [(self.irreps_in[i][0], self.irreps_out[o][0]) for i, o in self.paths]

    @property
    def numel(self) -> int:
        return sum(u * w for u, w in self.block_shapes())

    @property
    def widest_block(self) -> int:
        """The most channels of any block (mul_in or mul_out), 0 for a map without paths."""
        return max((max(u, w) for u, w in self.block_shapes()), default=0)

    @property
    def macs_per_row(self) -> int:
        """Multiply-adds per row of x."""
        return sum(u * w * self.irreps_in[i][1] for (u, w), (i, _) in zip(self.block_shapes(), self.paths))

    def transpose(self) -> IrrepsMap:
        """The transposed map (out -> in), its blocks ``transpose_blocks`` of this map's, in the same path order."""
        return IrrepsMap(self.irreps_out, self.irreps_in, tuple((o, i) for i, o in self.paths))

    def arrays(self, device: torch.device | str = "cpu") -> MapArrays:
        """The int32 tables the kernel reads (``MapArrays``)."""
        def starts(irreps: tuple[tuple[int, int], ...]) -> list[int]:
            out, at = [], 0
            for m, d in irreps:
                out.append(at)
                at += m * d
            return out

        in_start, out_start = starts(self.irreps_in), starts(self.irreps_out)
        offsets, at = [], 0
        for u, w in self.block_shapes():
            offsets.append(at)
            at += u * w
        col_irrep = [q for q, (m, d) in enumerate(self.irreps_out) for _ in range(m * d)]
        irrep_info = [v for q, (m, d) in enumerate(self.irreps_out) for v in (out_start[q], m, d)]
        path_ptr, path_info = [0], []
        for q in range(len(self.irreps_out)):
            for p, (i, o) in enumerate(self.paths):
                if o == q:
                    path_info += [in_start[i], self.irreps_in[i][0], offsets[p]]
            path_ptr.append(len(path_info) // 3)

        def ints(values: list[int]) -> Tensor:
            return torch.tensor(values or [0], dtype=torch.int32, device=device)

        return MapArrays(ints(col_irrep), ints(irrep_info), ints(path_ptr), ints(path_info))


class MapArrays(NamedTuple):
    """``IrrepsMap.arrays``: the output irrep of each output column, (first column, mul, 2l + 1) per output
    irrep, the range of its paths, and (first input column, mul_in, block offset) per path."""

    col_irrep: Tensor
    irrep_info: Tensor
    path_ptr: Tensor
    path_info: Tensor


def transpose_blocks(m: IrrepsMap, blocks: Tensor) -> Tensor:
    """The blocks of ``m.transpose()`` from ``m``'s (``blocks`` [..., m.numel], each block transposed)."""
    pieces, at = [], 0
    for u, w in m.block_shapes():
        block = blocks[..., at:at + u * w].reshape(*blocks.shape[:-1], u, w)
        pieces.append(block.transpose(-1, -2).reshape(*blocks.shape[:-1], u * w))
        at += u * w
    return torch.cat(pieces, dim=-1) if pieces else blocks


def map_reference(x: Tensor, m: IrrepsMap, blocks: Tensor) -> Tensor:
    """The map of ``x`` [rows, m.in_width] by ``blocks`` [m.numel], in torch ops (any order of derivatives)."""
    rows = x.shape[0]
    pieces = x.split([mul * d for mul, d in m.irreps_in], dim=1)
    outs: list[Tensor | None] = [None] * len(m.irreps_out)
    at = 0
    for (i, o), (u, w) in zip(m.paths, m.block_shapes()):
        block = blocks[at:at + u * w].reshape(u, w)
        at += u * w
        y = torch.einsum("nui,uw->nwi", pieces[i].reshape(rows, u, -1), block).reshape(rows, -1)
        outs[o] = y if outs[o] is None else outs[o] + y
    return torch.cat([y if y is not None else x.new_zeros(rows, mul * d)
                      for y, (mul, d) in zip(outs, m.irreps_out)], dim=1)


def tile_rows(m: IrrepsMap, dtype: torch.dtype) -> int | None:
    """Rows a block stages for ``m`` in ``dtype`` (the largest tile whose rows fit ``MAX_STAGED_BYTES``), None if
    the kernel does not take this dtype or even the smallest tile's rows do not fit."""
    size = torch.empty((), dtype=dtype).element_size()
    return next((r for r in _TILES.get(dtype, ()) if r * max(m.in_width, 1) * size <= MAX_STAGED_BYTES), None)


class LinearLaunch(NamedTuple):
    """One launch of a map over rows: its tables, blocks [numel] (frozen, on the device, in x's dtype), and the
    rows (a [count] int64 index tensor, or None: rows 0 .. count - 1 of x)."""

    arrays: MapArrays
    blocks: Tensor
    row_index: Tensor | None
    count: int


def _launch(x: Tensor, out: Tensor, m: IrrepsMap, launch: LinearLaunch) -> None:
    from .core.runtime import I32, I64

    if launch.count == 0:
        return
    tile = tile_rows(m, x.dtype)
    a = launch.arrays
    _KERNELS.get(f"irreps_linear_{_SUFFIX[x.dtype]}_r{tile}", x.device).launch(
        (-(-launch.count // tile),), (_THREADS,),
        [x, out, launch.blocks, launch.row_index, a.col_irrep, a.irrep_info, a.path_ptr, a.path_info,
         I64(launch.count), I32(m.in_width), I32(m.out_width)],
        shared_mem=tile * m.in_width * x.element_size())


class _Map(torch.autograd.Function):
    """out = the map of x (all launches of one direction write their rows of one output); grad x = the transposed
    map of grad out, another ``_Map``: differentiable to any order."""

    @staticmethod
    def forward(ctx, x: Tensor, maps: tuple[IrrepsMap, IrrepsMap], launches: tuple[Sequence[LinearLaunch],
                Sequence[LinearLaunch]]) -> Tensor:
        ctx.maps, ctx.launches = maps, launches
        m = maps[0]
        out = x.new_empty(x.shape[0], m.out_width)
        for launch in launches[0]:
            _launch(x, out, m, launch)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):  # noqa: ANN205
        maps, launches = ctx.maps, ctx.launches
        return _Map.apply(grad_out.contiguous(), maps[::-1], launches[::-1]), None, None


def apply_map(x: Tensor, m: IrrepsMap, forward: Sequence[LinearLaunch], backward: Sequence[LinearLaunch]) -> Tensor:
    """The map ``m`` of ``x`` [rows, m.in_width] on CUDA: ``forward``'s launches write every row of the output,
    ``backward``'s (of ``m.transpose()``, its blocks ``transpose_blocks``) every row of grad x. The caller checks
    ``tile_rows(m, x.dtype)`` first."""
    if x.dim() != 2 or x.shape[1] != m.in_width:
        raise ValueError(f"apply_map: expected x of shape [rows, {m.in_width}], got {tuple(x.shape)}")
    return _Map.apply(x.contiguous(), (m, m.transpose()), (tuple(forward), tuple(backward)))
