"""The equivariant linear kernel (cgforge.kernels.irreps_linear): the map's tables and reference against e3nn's
o3.Linear in FP64 on fresh random inputs, its transpose, the CUDA source compiled by NVRTC (no GPU needed) and run
on the CPU as C++ (``host_cuda``, one warp a block) over all rows and over a permuted subset; on a GPU the kernel
against the reference, forward and two derivatives."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from e3nn import o3
from host_cuda import assert_compiles_without_spills, build, call

from cgforge.kernels.irreps_linear import (
    IRREPS_LINEAR_SOURCE,
    MAX_STAGED_BYTES,
    MIN_WARPS,
    WARPS_PER_SM,
    IrrepsMap,
    LinearLaunch,
    apply_map,
    launch_shape,
    map_reference,
    tile_rows,
    transpose_blocks,
)

LINEARS = [("8x0e+4x1o+2x2e", "6x0e+3x1o+2x2e+1x3o"), ("5x0e+3x1o+3x1e+2x0e", "4x0e+2x1o"), ("3x1o", "7x1o"),
           ("40x0e+33x1o", "35x0e+2x1o+70x1o")]  # more than one warp task per component (channels w0 = 32, 64)


def e3nn_map(irreps_in: str, irreps_out: str, seed: int = 0) -> tuple[o3.Linear, IrrepsMap, torch.Tensor]:
    """An e3nn Linear, its IrrepsMap and its blocks (path weights folded), FP64."""
    torch.manual_seed(seed)
    linear = o3.Linear(irreps_in, irreps_out).double()
    m = IrrepsMap(tuple((mul, ir.dim) for mul, ir in linear.irreps_in),
                  tuple((mul, ir.dim) for mul, ir in linear.irreps_out),
                  tuple((ins.i_in, ins.i_out) for ins in linear.instructions))
    blocks, at = [], 0
    for ins in linear.instructions:
        u, w = ins.path_shape
        blocks.append(linear.weight.detach()[at:at + u * w] * ins.path_weight)
        at += u * w
    return linear, m, torch.cat(blocks)


def random_rows(rows: int, width: int, seed: int, dtype=torch.float64, device="cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, width, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)


@pytest.mark.smoke
@pytest.mark.parametrize("irreps_in, irreps_out", LINEARS)
def test_reference_and_transpose_equal_e3nn(irreps_in: str, irreps_out: str) -> None:
    linear, m, blocks = e3nn_map(irreps_in, irreps_out)
    x = random_rows(9, m.in_width, seed=1)
    torch.testing.assert_close(map_reference(x, m, blocks), linear(x), rtol=1e-12, atol=1e-12)
    g = random_rows(9, m.out_width, seed=2)  # the transposed map is the gradient of <g, map(x)> in x
    xr = x.clone().requires_grad_()
    (want,) = torch.autograd.grad((linear(xr) * g).sum(), xr)
    got = map_reference(g, m.transpose(), transpose_blocks(m, blocks))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert m.widest_block == max(max(u, w) for u, w in m.block_shapes())


def test_bad_maps_are_named() -> None:
    with pytest.raises(ValueError, match="outside"):
        IrrepsMap(((2, 1),), ((2, 1),), ((0, 1),))
    with pytest.raises(ValueError, match="dimensions 1 and 3"):
        IrrepsMap(((2, 1),), ((2, 3),), ((0, 0),))
    m = IrrepsMap(((2, 1),), ((2, 1),), ((0, 0),))
    with pytest.raises(ValueError, match=r"shape \[rows, 2\]"):
        apply_map(torch.zeros(3, 5), m, [], [])
    assert tile_rows(m, torch.float16) is None and tile_rows(m, torch.float32) == 8


def test_kernels_compile_without_spills() -> None:
    names = ("irreps_linear_f32_r8", "irreps_linear_f32_r4", "irreps_linear_f64_r8", "irreps_linear_f64_r2")
    assert_compiles_without_spills(IRREPS_LINEAR_SOURCE, "irreps_linear.cu", names)


# One block of one warp: its loop over the row tiles covers every tile, the warp takes every task (the host runs
# a block's warps one after another, so a block of several would split the staging between runs).
_DRIVER = """
extern "C" void run(const S* x, S* out, const S* blocks, const long long* row_index, const int* task_info,
                    int tasks, const int* irrep_info, const int* path_ptr, const int* path_info, long long rows,
                    int in_width, int out_width, int numel, int stage_blocks) {
    blockIdx.x = 0;
    gridDim.x = 1;
    run_warps(1, [&] { irreps_linear_SUFFIX_rTILE(x, out, blocks, row_index, task_info, tasks, irrep_info, path_ptr,
                                                  path_info, rows, in_width, out_width, numel, stage_blocks); });
}
"""


@pytest.mark.parametrize("dtype, tile", [(torch.float64, 8), (torch.float32, 4)])
@pytest.mark.parametrize("irreps", [LINEARS[0], LINEARS[3]], ids=["small", "wide"])
def test_cuda_source_run_as_cpp_equals_the_reference(dtype: torch.dtype, tile: int, irreps, tmp_path) -> None:
    scalar, suffix = ("double", "f64") if dtype == torch.float64 else ("float", "f32")
    driver = f"typedef {scalar} S;\n" + _DRIVER.replace("SUFFIX", suffix).replace("TILE", str(tile))
    library = build("#define __syncthreads() __syncwarp()\n" + IRREPS_LINEAR_SOURCE, driver, tmp_path,
                    f"irreps_linear_{suffix}")
    _, m, blocks = e3nn_map(*irreps)
    rows = 19  # not a multiple of the tile
    x = random_rows(rows, m.in_width, seed=3, dtype=dtype)
    b = blocks.to(dtype)
    a = [t.numpy() for t in m.arrays()]
    tol = 1e-13 if dtype == torch.float64 else 1e-5
    # all rows in order, then 11 of them in a shuffled order (the rows of one species): the others untouched;
    # the blocks read from global memory and staged in shared memory
    subset = torch.randperm(rows, generator=torch.Generator().manual_seed(4))[:11]
    for index, stage in ((None, 0), (subset, 0), (None, 1), (subset, 1)):
        out = np.full((rows, m.out_width), 7.0, dtype=x.numpy().dtype)
        count = rows if index is None else index.numel()
        call(library.run, [x.numpy(), out, b.numpy(), None if index is None else index.numpy(), a[0],
                           ctypes.c_int(len(m.tasks())), *a[1:], count, ctypes.c_int(m.in_width),
                           ctypes.c_int(m.out_width), ctypes.c_int(m.numel), ctypes.c_int(stage)])
        want = map_reference(x, m, b)
        got = torch.from_numpy(out)
        if index is None:
            torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        else:
            torch.testing.assert_close(got[index], want[index], rtol=tol, atol=tol)
            others = torch.ones(rows, dtype=torch.bool)
            others[index] = False
            assert bool((got[others] == 7.0).all())


def test_launch_shape_spreads_the_tasks_and_stages_blocks_that_fit() -> None:
    """The warps (at least MIN_WARPS) take a map's tasks in the fewest passes of at most MAX_WARPS, evenly; the grid
    stops at about WARPS_PER_SM warps an SM; the blocks are staged beside the rows where the two fit
    MAX_STAGED_BYTES."""
    m = IrrepsMap(((32, 1), (32, 3), (32, 5)), ((32, 1), (32, 3), (32, 5)), ((0, 0), (1, 1), (2, 2)))
    assert len(m.tasks()) == 9
    blocks, warps, smem, stage = launch_shape(m, 5184, torch.float32, sms=132)
    # 648 tiles, at most 132 * 4 blocks of 9 warps: two tiles a block
    assert (blocks, warps, stage) == (324, 9, True) and smem == 8 * 8 + 8 * 288 * 4 + 3 * 32 * 32 * 4
    dims = (1, 1, 3, 3, 3, 5, 5)  # the bundled MACE's second linear, transposed: 21 tasks
    wide = IrrepsMap(((32, 1), (32, 3), (32, 5)), tuple((32, d) for d in dims),
                     ((0, 0), (0, 1), (1, 2), (1, 3), (1, 4), (2, 5), (2, 6)))
    assert len(wide.tasks()) == 21
    assert launch_shape(wide, 10, torch.float32, sms=132)[:2] == (2, 11)  # two passes of 11 warps, not 16 + 5
    cap = 4 * (WARPS_PER_SM // 9)
    assert launch_shape(m, 8 * cap * 1000, torch.float32, sms=4)[0] == cap
    assert launch_shape(m, 8 * cap + 8, torch.float32, sms=4)[0] == cap // 2 + 1
    scalars = IrrepsMap(((32, 1),), ((32, 1),), ((0, 0),))  # one task, yet MIN_WARPS warps to stage the tile
    assert launch_shape(scalars, 80, torch.float32, sms=132)[:2] == (10, MIN_WARPS)
    big = IrrepsMap(((32, 1),) * 25, ((32, 1),), tuple((i, 0) for i in range(25)))  # 100 KiB of blocks
    _, _, smem, stage = launch_shape(big, 100, torch.float32, sms=132)
    assert not stage and smem == 8 * 8 + 8 * big.in_width * 4 < MAX_STAGED_BYTES < smem + big.numel * 4


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("irreps_in, irreps_out", LINEARS)
def test_cuda_map_equals_the_reference_to_second_derivatives(irreps_in: str, irreps_out: str,
                                                             dtype: torch.dtype) -> None:
    _, m, blocks = e3nn_map(irreps_in, irreps_out)
    blocks = blocks.to(device="cuda", dtype=dtype)
    rows = 1000
    half = torch.randperm(rows, generator=torch.Generator().manual_seed(5)).cuda()
    parts = (half[:400], half[400:])  # two "species", each its own blocks
    scaled = (blocks, 2.0 * blocks)
    fwd = [LinearLaunch(m.arrays("cuda"), b, p, p.numel()) for b, p in zip(scaled, parts)]
    t = m.transpose()
    bwd = [LinearLaunch(t.arrays("cuda"), transpose_blocks(m, b), p, p.numel()) for b, p in zip(scaled, parts)]
    x = random_rows(rows, m.in_width, seed=6, dtype=dtype, device="cuda").requires_grad_()
    weights = random_rows(rows, m.out_width, seed=7, dtype=dtype, device="cuda")
    direction = random_rows(rows, m.in_width, seed=8, dtype=dtype, device="cuda")

    def reference(v: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(rows, m.out_width, dtype=dtype, device="cuda")
        for b, p in zip(scaled, parts):
            out = out.index_put((p,), map_reference(v[p], m, b))
        return out

    results = []
    for fn in (lambda v: apply_map(v, m, fwd, bwd), reference):
        out = fn(x)  # a loss quadratic in out: grad x depends on x, through the transposed map
        (grad,) = torch.autograd.grad((out.square() * weights).sum(), x, create_graph=True)
        (second,) = torch.autograd.grad((grad * direction).sum(), x)
        results.append((out.detach(), grad.detach(), second))
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
