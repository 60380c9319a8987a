"""Equivariant linear maps (e3nn's ``o3.Linear``, per-species self-connections) as one kernel, with no transposes.

    out[n, q, w, i] = sum over paths p = (j -> q) of  sum_u  x[n, j, u, i] * B_p[u, w]

x and out in e3nn's layout (irrep after irrep, each [mul, 2l + 1], channel outermost); B_p a [mul_in, mul_out]
block per path, its path weight folded in. A block stages ``R`` rows of x in shared memory, channel-major; a warp
takes an output component (q, i) and 32 channels w of it. Rows can be a subset in any order (``row_index``: one
launch per species). The backward (grad x) is the same kernel on the transposed map (``IrrepsMap.transpose``,
``transpose_blocks``), to any order; B is frozen. FP32 and FP64 on CUDA; ``map_reference`` (torch) elsewhere and
as the oracle.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from .core.registry import DTYPE_SUFFIX, SourceKernels

__all__ = ["IRREPS_LINEAR_SOURCE", "IrrepsMap", "LinearLaunch", "MapArrays", "apply_map", "launch_shape",
           "map_reference", "tile_rows", "transpose_blocks"]

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

// out[row, :] for the rows of the tiles this block takes (R rows a tile: rows row_index[first .. first + R) or
// first .. first + R). A warp computes one task at a time, a task being (output irrep q, component i, first
// channel w0) of task_info [T, 3]: lane w0 + lane accumulates its output channel w over the tile's R rows.
// irrep_info [Q, 3] per output irrep: first column, mul_out, 2l + 1; path_ptr [Q + 1] its paths' range in
// path_info [P, 3]: first input column, mul_in, offset of B_p in blocks.
// Why this mapping: all lanes of a warp read the same staged x values (a broadcast) and consecutive words of B_p
// (one wavefront); a thread per output column (w, i) made the lanes read 2l + 1 different x columns and a word of
// B per lane from L1, which the large shared-memory carveout leaves small: most stall cycles were on those B loads
// (measured: docs/measured-constants.md).
#define STAGE_BATCH 8  // loads a thread issues before it stores them to shared memory

template <typename T, int R>
__device__ void irreps_linear(const T* __restrict__ x, T* __restrict__ out, const T* __restrict__ blocks,
                              const long long* __restrict__ row_index, const int* __restrict__ task_info, int tasks,
                              const int* __restrict__ irrep_info, const int* __restrict__ path_ptr,
                              const int* __restrict__ path_info, long long rows, int in_width, int out_width,
                              int numel, int stage_blocks) {
    extern __shared__ __align__(16) unsigned char smem_bytes[];
    long long* tile_row = reinterpret_cast<long long*>(smem_bytes);  // [R]: the tile's rows of x and out, or -1
    T* staged = reinterpret_cast<T*>(tile_row + R);  // [in_width][R]: column k of tile row r at k * R + r
    const T* b_all = blocks;
    if (stage_blocks) {  // [numel] after the rows: read once per block, not once per tile
        T* staged_blocks = staged + (long long)in_width * R;
        for (int e0 = threadIdx.x; e0 < numel; e0 += STAGE_BATCH * blockDim.x) {
            T v[STAGE_BATCH];  // the batch's loads issued together, then stored: one latency, not STAGE_BATCH
            #pragma unroll
            for (int j = 0; j < STAGE_BATCH; ++j) {
                const int e = e0 + j * blockDim.x;
                v[j] = e < numel ? blocks[e] : T(0);
            }
            #pragma unroll
            for (int j = 0; j < STAGE_BATCH; ++j)
                if (e0 + j * blockDim.x < numel) staged_blocks[e0 + j * blockDim.x] = v[j];
        }
        b_all = staged_blocks;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    // blockDim.x is a multiple of R: a thread stages one row r of every tile, columns k0, k0 + k_step, ...
    const int r_own = threadIdx.x % R, k0 = threadIdx.x / R, k_step = blockDim.x / R;
    const long long tiles = (rows + R - 1) / R;
    for (long long tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const long long first = tile * R;
        __syncthreads();  // the previous tile's columns and rows are read (and the blocks staged)
        if (threadIdx.x < R)
            tile_row[threadIdx.x] = first + threadIdx.x >= rows ? -1
                                    : row_index ? row_index[first + threadIdx.x] : first + threadIdx.x;
        __syncthreads();
        const long long row = tile_row[r_own];
        for (int k = k0; k < in_width; k += STAGE_BATCH * k_step) {
            T v[STAGE_BATCH];
            #pragma unroll
            for (int j = 0; j < STAGE_BATCH; ++j) {
                const int kj = k + j * k_step;
                v[j] = row >= 0 && kj < in_width ? x[row * in_width + kj] : T(0);
            }
            #pragma unroll
            for (int j = 0; j < STAGE_BATCH; ++j)
                if (k + j * k_step < in_width) staged[(k + j * k_step) * R + r_own] = v[j];
        }
        __syncthreads();
        for (int t = warp; t < tasks; t += warps) {
            const int q = task_info[3 * t], i = task_info[3 * t + 1], w = task_info[3 * t + 2] + lane;
            const int start = irrep_info[3 * q], mul_out = irrep_info[3 * q + 1], d = irrep_info[3 * q + 2];
            if (w >= mul_out) continue;
            T acc[R];
            #pragma unroll
            for (int r = 0; r < R; ++r) acc[r] = T(0);
            for (int p = path_ptr[q]; p < path_ptr[q + 1]; ++p) {
                const int mul_in = path_info[3 * p + 1];
                const T* b = b_all + path_info[3 * p + 2] + w;
                const T* column = staged + (long long)(path_info[3 * p] + i) * R;
                #pragma unroll 4
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
                if (tile_row[r] >= 0) out[tile_row[r] * out_width + start + w * d + i] = acc[r];
        }
    }
}

#define CG_IRREPS_LINEAR(T, SUFFIX, R)                                                                           \
extern "C" __global__ void irreps_linear_##SUFFIX##_r##R(const T* x, T* out, const T* blocks,                   \
        const long long* row_index, const int* task_info, int tasks, const int* irrep_info, const int* path_ptr, \
        const int* path_info, long long rows, int in_width, int out_width, int numel, int stage_blocks) {       \
    irreps_linear<T, R>(x, out, blocks, row_index, task_info, tasks, irrep_info, path_ptr, path_info, rows,     \
                        in_width, out_width, numel, stage_blocks);                                               \
}
CG_IRREPS_LINEAR(float, f32, 8)
CG_IRREPS_LINEAR(float, f32, 4)
CG_IRREPS_LINEAR(double, f64, 8)
CG_IRREPS_LINEAR(double, f64, 2)
"""

_TILES = {torch.float32: (8, 4), torch.float64: (8, 2)}  # rows per block, largest first
_KERNELS = SourceKernels(IRREPS_LINEAR_SOURCE, [f"irreps_linear_{DTYPE_SUFFIX[t]}_r{r}" for t, rs in _TILES.items()
                                               for r in rs], "irreps_linear")
WARP = 32
MAX_WARPS = 16  # a block's warps: its tasks in as few passes as 16 warps take, spread evenly over the warps
MIN_WARPS = 4  # and at least 4, which share the staging (one warp staging a tile alone waited on it)
# What a block may stage (96 KiB: two blocks an SM on every GPU cgforge runs on): the rows, and the weight blocks
# beside them where the two fit, else the blocks are read from global memory.
MAX_STAGED_BYTES = 96 << 10
WARPS_PER_SM = 40  # the grid: about this many warps an SM, each block looping over row tiles beyond it


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

    def transpose(self) -> IrrepsMap:
        """The transposed map (out -> in), its blocks ``transpose_blocks`` of this map's, in the same path order."""
        return IrrepsMap(self.irreps_out, self.irreps_in, tuple((o, i) for i, o in self.paths))

    def tasks(self) -> list[tuple[int, int, int]]:
        """The kernel's warp tasks: (output irrep q, component i, first channel w0), 32 channels a task."""
        return [(q, i, w0) for q, (m, d) in enumerate(self.irreps_out) for i in range(d) for w0 in range(0, m, WARP)]

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
        task_info = [v for task in self.tasks() for v in task]
        irrep_info = [v for q, (m, d) in enumerate(self.irreps_out) for v in (out_start[q], m, d)]
        path_ptr, path_info = [0], []
        for q in range(len(self.irreps_out)):
            for p, (i, o) in enumerate(self.paths):
                if o == q:
                    path_info += [in_start[i], self.irreps_in[i][0], offsets[p]]
            path_ptr.append(len(path_info) // 3)

        def ints(values: list[int]) -> Tensor:
            return torch.tensor(values or [0], dtype=torch.int32, device=device)

        return MapArrays(ints(task_info), ints(irrep_info), ints(path_ptr), ints(path_info))


class MapArrays(NamedTuple):
    """``IrrepsMap.arrays``: the warp tasks (q, i, w0) (``IrrepsMap.tasks``), (first column, mul, 2l + 1) per
    output irrep, the range of its paths, and (first input column, mul_in, block offset) per path."""

    task_info: Tensor
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
    return next((r for r in _TILES.get(dtype, ()) if r * max(m.in_width, 1) * dtype.itemsize <= MAX_STAGED_BYTES), None)


class LinearLaunch(NamedTuple):
    """One launch of a map over rows: its tables, blocks [numel] (frozen, on the device, in x's dtype), and the
    rows (a [count] int64 index tensor, or None: rows 0 .. count - 1 of x)."""

    arrays: MapArrays
    blocks: Tensor
    row_index: Tensor | None
    count: int


@functools.lru_cache(maxsize=256)  # a few maps a model
def _block_shape(m: IrrepsMap, dtype: torch.dtype) -> tuple[int, int, int, bool]:
    """(rows a tile, warps a block, shared bytes, blocks staged) of ``m`` in ``dtype``: what ``launch_shape``
    does not take from the row count, made once per map (every force call launches the same maps)."""
    tile = tile_rows(m, dtype)
    if tile is None:
        raise ValueError(f"irreps_linear: {m.in_width} columns in {dtype} do not fit a block's shared memory")
    tasks = max(1, len(m.tasks()))
    warps = max(MIN_WARPS, -(-tasks // -(-tasks // MAX_WARPS)))
    rows_bytes = tile * 8 + tile * m.in_width * dtype.itemsize  # the tile's row indices, then its rows
    blocks_bytes = m.numel * dtype.itemsize
    stage = rows_bytes + blocks_bytes <= MAX_STAGED_BYTES
    return tile, warps, rows_bytes + (blocks_bytes if stage else 0), stage


def launch_shape(m: IrrepsMap, rows: int, dtype: torch.dtype, sms: int) -> tuple[int, int, int, bool]:
    """(blocks, warps a block, shared bytes, blocks staged) of one launch over ``rows`` rows on ``sms`` SMs: the
    warps (at least ``MIN_WARPS``) take the map's tasks in the fewest passes of at most ``MAX_WARPS``, evenly;
    the grid holds at most about ``WARPS_PER_SM`` warps an SM, its blocks looping over the same number of row
    tiles each; the blocks are staged where they fit."""
    tile, warps, smem, stage = _block_shape(m, dtype)
    tiles, cap = max(1, -(-rows // tile)), sms * max(1, WARPS_PER_SM // warps)
    blocks = -(-tiles // -(-tiles // cap))  # each block the same number of tiles: no last round of a few
    return blocks, warps, smem, stage


def _launch(x: Tensor, out: Tensor, m: IrrepsMap, launch: LinearLaunch) -> None:
    from .core.launch import sm_count
    from .core.runtime import I32, I64

    if launch.count == 0:
        return
    tile = _block_shape(m, x.dtype)[0]
    blocks, warps, smem, stage = launch_shape(m, launch.count, x.dtype, sm_count(x.device))
    a = launch.arrays
    _KERNELS.get(f"irreps_linear_{DTYPE_SUFFIX[x.dtype]}_r{tile}", x.device).launch(
        (blocks,), (warps * WARP,),
        [x, out, launch.blocks, launch.row_index, a.task_info, I32(a.task_info.numel() // 3), a.irrep_info,
         a.path_ptr, a.path_info, I64(launch.count), I32(m.in_width), I32(m.out_width), I32(m.numel),
         I32(int(stage))],
        shared_mem=smem)


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
    """The map ``m`` of ``x`` [rows, m.in_width] on CUDA by ``forward``'s launches, grad x by ``backward``'s (of
    ``m.transpose()``); the caller checks ``tile_rows(m, x.dtype)`` first."""
    if x.dim() != 2 or x.shape[1] != m.in_width:
        raise ValueError(f"apply_map: expected x of shape [rows, {m.in_width}], got {tuple(x.shape)}")
    return _Map.apply(x.contiguous(), (m, m.transpose()), (tuple(forward), tuple(backward)))
