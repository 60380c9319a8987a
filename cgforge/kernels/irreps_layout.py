"""Layout moves around cuBLAS's equivariant linear maps, each one kernel launch that reads and writes whole runs.

cuBLAS contracts the channel u of an l > 0 irrep block only with the rows and components folded into one dimension,
[rows * (2l + 1), mul]; e3nn's rows hold [mul, 2l + 1], channel outermost. Row by row both layouts are one contiguous
run of mul * (2l + 1) values, so one kernel moves every block of a map's side at once (``to_segments``,
``from_segments``): runs read coalesced into shared memory, written coalesced in the other order.
``permute_columns`` is the same for whole rows permuted column by column (MACE's ``reshape_irreps``:
[N, mul * sum d] -> [N, mul, sum d]). FP32 and FP64 on CUDA; torch copies elsewhere (the tests' reference).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from .core.registry import SourceKernels

__all__ = ["IRREPS_LAYOUT_SOURCE", "Segments", "columns_permutation", "from_segments", "permute_columns",
           "to_segments"]

IRREPS_LAYOUT_SOURCE = r"""
// A position in a job's runs as the digits (row r, outer o, inner i) of a mixed radix (any, outer, inner): a thread
// divides once a job and then steps by blockDim.x with carries (a division per value cost more than the move).
struct Digits { int r, o, i; };
__device__ __forceinline__ Digits digits(int e, int outer, int inner) {
    const int r = e / (outer * inner), j = e - r * outer * inner, o = j / inner;
    return Digits{r, o, j - o * inner};
}
__device__ __forceinline__ void advance(Digits& p, const Digits& step, int outer, int inner) {
    p.i += step.i;
    if (p.i >= inner) { p.i -= inner; ++p.o; }
    p.o += step.o;
    if (p.o >= outer) { p.o -= outer; ++p.r; }
    p.r += step.r;
}

// Irrep blocks between e3nn's layout and component-major segments. Block k of info [K, 4] (first column c, mul m,
// 2l + 1 = d, segment offset s): row n's values at irreps[n * ld + c + u * d + i] (channel outermost), its segment's
// at segments[rows * s + (n * d + i) * m + u] (a [rows * d, m] matrix). A job is `tile` rows of one block; a CUDA
// block stages a job's runs (tile * m * d values, contiguous on both sides) and writes them in the other order.
template <typename T, bool TO_SEGMENTS>
__device__ void irreps_segments(const T* __restrict__ src, T* __restrict__ dst, const int* __restrict__ info,
                                int blocks, long long rows, long long ld, int tile) {
    extern __shared__ __align__(16) unsigned char smem_bytes[];
    T* run = reinterpret_cast<T*>(smem_bytes);
    const long long tiles = (rows + tile - 1) / tile;
    for (long long job = blockIdx.x; job < tiles * blocks; job += gridDim.x) {
        const int k = (int)(job % blocks);
        const long long first = (job / blocks) * tile;
        const int c = info[4 * k], m = info[4 * k + 1], d = info[4 * k + 2], len = m * d;
        const long long segment = rows * info[4 * k + 3] + first * len;  // the job's run in the segments
        const int total = (int)min((long long)tile, rows - first) * len;
        __syncthreads();  // the previous job's run is written out
        if (TO_SEGMENTS) {  // read row by row: digits (r, 0, column in the run)
            const Digits step = digits(blockDim.x, 1, len);
            Digits p = digits(threadIdx.x, 1, len);
            for (int e = threadIdx.x; e < total; e += blockDim.x, advance(p, step, 1, len))
                run[e] = src[(first + p.r) * ld + c + p.i];
        } else {
            for (int e = threadIdx.x; e < total; e += blockDim.x) run[e] = src[segment + e];
        }
        __syncthreads();
        // e: the position written, as digits of the written order; the value sits at the same (r, u, i) staged
        const int outer = TO_SEGMENTS ? d : m, inner = TO_SEGMENTS ? m : d;
        const Digits step = digits(blockDim.x, outer, inner);
        Digits p = digits(threadIdx.x, outer, inner);
        for (int e = threadIdx.x; e < total; e += blockDim.x, advance(p, step, outer, inner)) {
            if (TO_SEGMENTS)  // (r, i, u)
                dst[segment + e] = run[p.r * len + p.i * d + p.o];
            else  // (r, u, i)
                dst[(first + p.r) * ld + c + p.o * d + p.i] = run[p.r * len + p.i * m + p.o];
        }
    }
}

// out rows from in rows by a permutation of their columns: dst[n * ld_dst + j] = src[n * ld_src + perm[j]], j <
// width. A CUDA block stages `tile` whole rows (read coalesced), then writes whole rows (coalesced), perm from L1.
template <typename T>
__device__ void permute_columns(const T* __restrict__ src, T* __restrict__ dst, const int* __restrict__ perm,
                                long long rows, long long ld_src, long long ld_dst, int width, int tile) {
    extern __shared__ __align__(16) unsigned char smem_bytes[];
    T* run = reinterpret_cast<T*>(smem_bytes);
    const Digits step = digits(blockDim.x, 1, width);
    for (long long first = (long long)blockIdx.x * tile; first < rows; first += (long long)gridDim.x * tile) {
        const int total = (int)min((long long)tile, rows - first) * width;
        __syncthreads();  // the previous tile's rows are written out
        Digits p = digits(threadIdx.x, 1, width);
        for (int e = threadIdx.x; e < total; e += blockDim.x, advance(p, step, 1, width))
            run[e] = src[(first + p.r) * ld_src + p.i];
        __syncthreads();
        p = digits(threadIdx.x, 1, width);
        for (int e = threadIdx.x; e < total; e += blockDim.x, advance(p, step, 1, width))
            dst[(first + p.r) * ld_dst + p.i] = run[p.r * width + perm[p.i]];
    }
}

#define CG_IRREPS_LAYOUT(T, SUFFIX)                                                                            \
extern "C" __global__ void irreps_to_segments_##SUFFIX(const T* src, T* dst, const int* info, int blocks,       \
        long long rows, long long ld, int tile) {                                                               \
    irreps_segments<T, true>(src, dst, info, blocks, rows, ld, tile);                                           \
}                                                                                                               \
extern "C" __global__ void irreps_from_segments_##SUFFIX(const T* src, T* dst, const int* info, int blocks,     \
        long long rows, long long ld, int tile) {                                                               \
    irreps_segments<T, false>(src, dst, info, blocks, rows, ld, tile);                                          \
}                                                                                                               \
extern "C" __global__ void permute_columns_##SUFFIX(const T* src, T* dst, const int* perm, long long rows,      \
        long long ld_src, long long ld_dst, int width, int tile) {                                              \
    permute_columns<T>(src, dst, perm, rows, ld_src, ld_dst, width, tile);                                      \
}
CG_IRREPS_LAYOUT(float, f32)
CG_IRREPS_LAYOUT(double, f64)
"""

_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}
_KERNELS = SourceKernels(IRREPS_LAYOUT_SOURCE, [f"{kernel}_{s}" for kernel in ("irreps_to_segments",
                                                "irreps_from_segments", "permute_columns") for s in _SUFFIX.values()],
                         "irreps_layout")
MAX_STAGED_BYTES = 96 << 10  # a row of the widest block (or a whole row) staged at most: two blocks an SM
SEGMENT_STAGE_BYTES = 32 << 10  # a job's staged runs: several blocks an SM, whole rows of the widest irrep block
SEGMENT_THREADS = 256
SEGMENT_JOBS_PER_SM = 8  # the grid: about this many blocks an SM, each looping over the jobs beyond it


@dataclass(frozen=True)
class Segments:
    """Irrep blocks of one side of a map, each (first column, mul, 2l + 1), as component-major segments: for
    ``rows`` rows, block k's [rows * (2l + 1), mul] matrix starts at element ``rows * offsets[k]`` of one buffer
    of ``rows * width`` values."""

    blocks: tuple[tuple[int, int, int], ...]

    @property
    def offsets(self) -> tuple[int, ...]:
        at, out = 0, []
        for _, m, d in self.blocks:
            out.append(at)
            at += m * d
        return tuple(out)

    @property
    def width(self) -> int:
        return sum(m * d for _, m, d in self.blocks)

    def views(self, buffer: Tensor, rows: int) -> list[Tensor]:
        """Each block's [rows * (2l + 1), mul] matrix in ``buffer`` [rows * width]."""
        return [buffer.narrow(0, rows * o, rows * m * d).view(rows * d, m)
                for (_, m, d), o in zip(self.blocks, self.offsets, strict=True)]

    @property
    def longest(self) -> int:
        """The longest block's run (mul * (2l + 1) values), 0 without blocks."""
        return max((m * d for _, m, d in self.blocks), default=0)

    def tile(self, dtype: torch.dtype) -> int:
        """Rows a job stages: its runs fit ``SEGMENT_STAGE_BYTES`` (at least one row)."""
        return _tile(self.longest, dtype)

    @functools.lru_cache(maxsize=64)  # noqa: B019 (frozen and hashable: a few sides a model, kept for its life)
    def info(self, device: torch.device) -> Tensor:
        """The kernel's int32 table [K, 4]: first column, mul, 2l + 1, offset."""
        return torch.tensor([v for b, o in zip(self.blocks, self.offsets, strict=True) for v in (*b, o)] or [0],
                            dtype=torch.int32, device=device)


def _on_layout_kernel(t: Tensor, run: int) -> bool:
    """Whether a layout move of ``t`` (rows of unit-stride columns) whose longest run is ``run`` values runs as a
    kernel (CUDA, FP32/FP64, a run within ``MAX_STAGED_BYTES``, not under torch.compile), not as torch copies."""
    return (t.is_cuda and t.dtype in _SUFFIX and t.stride(1) == 1 and run * t.dtype.itemsize <= MAX_STAGED_BYTES
            and not torch.compiler.is_compiling())


def _move(src: Tensor, dst: Tensor, segments: Segments, irreps: Tensor, to: bool) -> None:
    from .core.launch import sm_count
    from .core.runtime import I32, I64

    rows, blocks = irreps.shape[0], len(segments.blocks)
    if rows == 0 or blocks == 0:
        return
    tile = segments.tile(src.dtype)
    grid = min(-(-rows // tile) * blocks, sm_count(src.device) * SEGMENT_JOBS_PER_SM)
    staged = tile * segments.longest * src.dtype.itemsize
    way = "to" if to else "from"
    _KERNELS.get(f"irreps_{way}_segments_{_SUFFIX[src.dtype]}", src.device).launch(
        (grid,), (SEGMENT_THREADS,), [src, dst, segments.info(src.device), I32(blocks), I64(rows),
                                      I64(irreps.stride(0)), I32(tile)], shared_mem=staged)


def to_segments(x: Tensor, segments: Segments) -> tuple[Tensor, list[Tensor]]:
    """``x`` [rows, width] (rows may be strided) -> (buffer, ``segments.views``): each block transposed to [rows *
    (2l + 1), mul], in one launch on CUDA (torch copies elsewhere: the reference)."""
    rows = x.shape[0]
    buffer = x.new_empty(rows * segments.width)
    views = segments.views(buffer, rows)
    if _on_layout_kernel(x, segments.longest):
        _move(x, buffer, segments, x, to=True)
    else:
        for (c, m, d), v in zip(segments.blocks, views, strict=True):
            v.view(rows, d, m).copy_(x.narrow(1, c, m * d).view(rows, m, d).transpose(1, 2))
    return buffer, views


def from_segments(buffer: Tensor, segments: Segments, out: Tensor) -> None:
    """Write ``buffer``'s segments into ``out`` [rows, width]'s columns (e3nn's layout; rows may be strided), in
    one launch on CUDA (torch copies elsewhere)."""
    rows = out.shape[0]
    if _on_layout_kernel(out, segments.longest):
        _move(buffer, out, segments, out, to=False)
        return
    for (c, m, d), v in zip(segments.blocks, segments.views(buffer, rows), strict=True):
        out.narrow(1, c, m * d).view(rows, m, d).copy_(v.view(rows, d, m).transpose(1, 2))


def _tile(run: int, dtype: torch.dtype) -> int:
    """Rows (or runs) a block stages: they fit ``SEGMENT_STAGE_BYTES`` (at least one)."""
    return max(1, SEGMENT_STAGE_BYTES // (max(run, 1) * dtype.itemsize))


@functools.lru_cache(maxsize=64)  # a few reshapes a model, kept for its life
def columns_permutation(mul: int, dims: tuple[int, ...], to_columns: bool, device: torch.device) -> Tensor:
    """int32 [mul * sum dims]: for each column of the written layout, the column it reads. e3nn's [mul, d] blocks
    side by side (``dims`` their 2l + 1) <-> MACE's columns [mul, sum dims]: (u, col_q + i) <-> start_q + u * d_q + i;
    ``to_columns``: the columns written from e3nn's layout, else the inverse."""
    blocks, start = [], 0
    for d in dims:  # block q's e3nn columns as the [mul, d] slice of the columns layout they fill
        blocks.append(start + torch.arange(mul * d, dtype=torch.long).view(mul, d))
        start += mul * d
    read = torch.cat(blocks, dim=1).reshape(-1)  # column (u, col_q + i) of MACE's layout reads e3nn's start_q + ...
    if not to_columns:  # the inverse: e3nn's column read[j] reads the columns layout's j
        read = torch.empty_like(read).scatter_(0, read, torch.arange(read.numel(), dtype=torch.long))
    return read.to(device=device, dtype=torch.int32)


def permute_columns(x: Tensor, perm: Tensor, out: Tensor) -> None:
    """``out[:, j] = x[:, perm[j]]`` for rows of unit-stride columns (rows may be strided), one launch on CUDA."""
    from .core.launch import sm_count
    from .core.runtime import I32, I64

    rows, width = x.shape[0], perm.numel()
    if not (_on_layout_kernel(x, width) and _on_layout_kernel(out, width)):
        out.copy_(x.index_select(1, perm.to(device=x.device, dtype=torch.long)))
        return
    if rows == 0:
        return
    tile = _tile(width, x.dtype)
    grid = min(-(-rows // tile), sm_count(x.device) * SEGMENT_JOBS_PER_SM)
    _KERNELS.get(f"permute_columns_{_SUFFIX[x.dtype]}", x.device).launch(
        (grid,), (SEGMENT_THREADS,), [x, out, perm, I64(rows), I64(x.stride(0)), I64(out.stride(0)), I32(width),
                                      I32(tile)], shared_mem=tile * width * x.dtype.itemsize)
