"""The layout moves around the GEMM path's linear maps (cgforge.kernels.irreps_layout): the torch path against the
definition, the CUDA source compiled by NVRTC (no GPU needed) and run on the CPU as C++ (``host_cuda``, one warp a
block) against the torch path, bit for bit; on a GPU the kernels against the torch path."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from host_cuda import assert_compiles_without_spills, build, call

from cgforge.kernels.irreps_layout import (
    IRREPS_LAYOUT_SOURCE,
    Segments,
    columns_permutation,
    from_segments,
    permute_columns,
    to_segments,
)


def random_rows(rows: int, width: int, seed: int, dtype=torch.float64, device="cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, width, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)


# MACE's second linear's sides in small: 1o, 2e, 3o blocks of several muls at shuffled columns, rows strided; one
# block's run (40 values) longer than the host's block of 32 threads, the others shorter
SEGMENTS = Segments(((2, 3, 3), (11, 2, 5), (40, 4, 7), (68, 8, 5), (21, 5, 3)))
SEGMENT_LD = 110  # the irreps side's row stride: columns 0-1, 36-39 and 108-109 are no block's


def test_segments_reference_moves_each_block_to_its_component_major_matrix() -> None:
    """The torch path of to_segments / from_segments (the kernel's oracle): block k's [rows * d, mul] matrix holds
    x[n, c + u * d + i] at (n * d + i, u), and from_segments puts every value back and touches no other column."""
    rows = 6
    x = torch.randn(rows, SEGMENT_LD, dtype=torch.float64)
    buffer, views = to_segments(x, SEGMENTS)
    assert buffer.shape == (rows * SEGMENTS.width,) and SEGMENTS.width == 9 + 10 + 28 + 40 + 15
    for (c, m, d), v, o in zip(SEGMENTS.blocks, views, SEGMENTS.offsets, strict=True):
        assert v.data_ptr() == buffer[rows * o:].data_ptr() and v.shape == (rows * d, m)
        for n, i, u in ((0, 0, 0), (rows - 1, d - 1, m - 1), (2, d // 2, 1)):
            assert v[n * d + i, u] == x[n, c + u * d + i]
    back = torch.full((rows, SEGMENT_LD), float("nan"), dtype=torch.float64)
    from_segments(buffer, SEGMENTS, back)
    covered = torch.zeros(SEGMENT_LD, dtype=torch.bool)
    for c, m, d in SEGMENTS.blocks:
        covered[c:c + m * d] = True
    torch.testing.assert_close(back[:, covered], x[:, covered], rtol=0, atol=0)
    assert back[:, ~covered].isnan().all()
    assert SEGMENTS.tile(torch.float32) == (32 << 10) // (40 * 4) and Segments(()).width == 0


_DRIVER = """
extern "C" void run_segments(const S* src, S* dst, const int* info, int blocks, long long rows, long long ld,
                             int tile, int to) {
    blockIdx.x = 0;
    gridDim.x = 1;
    run_warps(1, [&] {
        if (to) irreps_to_segments_SUFFIX(src, dst, info, blocks, rows, ld, tile);
        else irreps_from_segments_SUFFIX(src, dst, info, blocks, rows, ld, tile);
    });
}
extern "C" void run_permute(const S* src, S* dst, const int* perm, long long rows, long long ld_src,
                            long long ld_dst, int width, int tile) {
    blockIdx.x = 0;
    gridDim.x = 1;
    run_warps(1, [&] { permute_columns_SUFFIX(src, dst, perm, rows, ld_src, ld_dst, width, tile); });
}
"""


@pytest.fixture(scope="module", params=[torch.float64, torch.float32], ids=["f64", "f32"])
def host_kernels(request, tmp_path_factory) -> tuple[torch.dtype, ctypes.CDLL]:  # noqa: ANN001
    """The layout source compiled as C++ for one dtype (``host_cuda``: one warp a block), with its drivers."""
    dtype = request.param
    scalar, suffix = ("double", "f64") if dtype == torch.float64 else ("float", "f32")
    driver = f"typedef {scalar} S;\n" + _DRIVER.replace("SUFFIX", suffix)
    return dtype, build("#define __syncthreads() __syncwarp()\n" + IRREPS_LAYOUT_SOURCE, driver,
                        tmp_path_factory.mktemp("irreps_layout"), f"irreps_layout_{suffix}")


def test_segments_cuda_source_run_as_cpp_equals_the_reference(host_kernels) -> None:  # noqa: ANN001
    """The segment kernels (one warp, its job loop over every tile of every block, 3 rows a tile: the last tile
    short) both ways against the torch path, on rows with a stride wider than the blocks."""
    dtype, library = host_kernels
    rows, tile = 8, 3
    x = random_rows(rows, SEGMENT_LD, seed=9, dtype=dtype)
    want, _ = to_segments(x, SEGMENTS)
    info = SEGMENTS.info(torch.device("cpu")).numpy()
    got = np.full(rows * SEGMENTS.width, 7.0, dtype=x.numpy().dtype)
    k = ctypes.c_int(len(SEGMENTS.blocks))
    call(library.run_segments, [x.numpy(), got, info, k, rows, SEGMENT_LD, ctypes.c_int(tile), ctypes.c_int(1)])
    torch.testing.assert_close(torch.from_numpy(got), want, rtol=0, atol=0)
    back_want = torch.full((rows, SEGMENT_LD), 7.0, dtype=dtype)
    from_segments(want, SEGMENTS, back_want)
    back = np.full((rows, SEGMENT_LD), 7.0, dtype=x.numpy().dtype)
    call(library.run_segments, [want.numpy(), back, info, k, rows, SEGMENT_LD, ctypes.c_int(tile), ctypes.c_int(0)])
    torch.testing.assert_close(torch.from_numpy(back), back_want, rtol=0, atol=0)


def test_layout_kernels_compile_without_spills() -> None:
    assert_compiles_without_spills(IRREPS_LAYOUT_SOURCE, "irreps_layout.cu",
                                   [f"{k}_{s}" for k in ("irreps_to_segments", "irreps_from_segments",
                                                         "permute_columns") for s in ("f32", "f64")])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rows", [1, 37, 5184])
def test_cuda_segments_equal_the_reference(dtype: torch.dtype, rows: int) -> None:
    """On CUDA to_segments / from_segments run as the kernel (rows strided, runs shorter and longer than a block's
    threads, the last job short): bit for bit the torch path's values, and no column outside the blocks written."""
    segments = Segments(SEGMENTS.blocks + ((SEGMENT_LD + 2, 64, 7),))  # a run of 448 values: MACE's 3o in half
    ld = SEGMENT_LD + 2 + 448 + 1
    x = random_rows(rows, ld, seed=10, dtype=dtype)
    want, _ = to_segments(x, segments)
    got, views = to_segments(x.cuda(), segments)
    assert views[2].shape == (rows * 7, 4) and views[5].shape == (rows * 7, 64)
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)
    wide = torch.full((rows, ld + 3), 7.0, dtype=dtype)
    from_segments(want, segments, wide[:, 1:1 + ld])
    wide_cuda = torch.full((rows, ld + 3), 7.0, dtype=dtype, device="cuda")
    from_segments(got, segments, wide_cuda[:, 1:1 + ld])
    torch.testing.assert_close(wide_cuda.cpu(), wide, rtol=0, atol=0)


DIMS = (1, 3, 5, 7)  # MACE's message: mul x (0e + 1o + 2e + 3o)


def _maces_columns(x: torch.Tensor, mul: int, dims: tuple[int, ...]) -> torch.Tensor:
    """MACE's reshape_irreps by definition: each [N, mul, d] block side by side -> [N, mul * sum d]."""
    blocks, start = [], 0
    for d in dims:
        blocks.append(x[:, start:start + mul * d].reshape(x.shape[0], mul, d))
        start += mul * d
    return torch.cat(blocks, dim=2).reshape(x.shape[0], -1)


def test_columns_permutation_is_maces_reshape_and_its_inverse() -> None:
    mul, rows = 3, 5
    x = random_rows(rows, mul * sum(DIMS), seed=11)
    to_cols = columns_permutation(mul, DIMS, True, torch.device("cpu"))
    back = columns_permutation(mul, DIMS, False, torch.device("cpu"))
    assert to_cols.dtype == torch.int32 and sorted(to_cols.tolist()) == list(range(x.shape[1]))
    cols = torch.empty_like(x)
    permute_columns(x, to_cols, cols)
    torch.testing.assert_close(cols, _maces_columns(x, mul, DIMS), rtol=0, atol=0)
    again = torch.full_like(x, float("nan"))
    permute_columns(cols, back, again)
    torch.testing.assert_close(again, x, rtol=0, atol=0)


def test_permute_columns_cuda_source_run_as_cpp_equals_the_reference(host_kernels) -> None:  # noqa: ANN001
    """The column permutation kernel (one warp, 2 rows a tile, the last short; rows strided on both sides) both
    ways of MACE's reshape against the torch path: nothing outside the rows' columns written."""
    dtype, library = host_kernels
    mul, rows = 3, 5
    width = mul * sum(DIMS)
    base = random_rows(rows, width + 4, seed=12, dtype=dtype)
    x = base[:, 1:1 + width]
    for to_columns in (True, False):
        perm = columns_permutation(mul, DIMS, to_columns, torch.device("cpu"))
        want = torch.full((rows, width + 2), 7.0, dtype=dtype)
        permute_columns(x, perm, want[:, :width])
        got = np.full((rows, width + 2), 7.0, dtype=want.numpy().dtype)
        call(library.run_permute, [base.numpy()[:, 1:], got, perm.numpy(), rows, width + 4, width + 2,
                           ctypes.c_int(width), ctypes.c_int(2)])
        torch.testing.assert_close(torch.from_numpy(got), want, rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rows", [1, 37, 5184])
def test_cuda_permute_columns_equals_the_reference(dtype: torch.dtype, rows: int) -> None:
    """MACE-MP-medium's reshape (128 x 16 columns) both ways on CUDA as the kernel, rows strided: the torch path's
    values bit for bit."""
    mul, width = 128, 128 * sum(DIMS)
    x = random_rows(rows, width + 3, seed=13, dtype=dtype)[:, 2:2 + width]
    for to_columns in (True, False):
        want = torch.empty(rows, width, dtype=dtype)
        permute_columns(x, columns_permutation(mul, DIMS, to_columns, torch.device("cpu")), want)
        got = torch.full((rows, width + 1), 7.0, dtype=dtype, device="cuda")
        permute_columns(x.cuda(), columns_permutation(mul, DIMS, to_columns, torch.device("cuda", 0)),
                        got[:, :width])
        torch.testing.assert_close(got[:, :width].cpu(), want, rtol=0, atol=0)
        assert (got[:, width] == 7.0).all()
