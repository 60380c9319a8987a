"""Inputs at the edges: grid limits, 32-bit index ranges, index widths, memory exhaustion.

CPU: the launch arithmetic (pure functions, fake sizes), the kernels' 64-bit grid-stride row loop (in the
generated source), and the guards that refuse row sizes, edge counts, node counts and index widths the
kernels cannot address. CUDA (marked): a grid capped far below the row count still computes every row,
more than 2**31 rows are all computed, an output that cannot fit raises torch's OutOfMemoryError and the
GPU keeps working, and a graph tensor of the wrong width is refused by the op.

Not tested on CPU: a real out-of-memory. On Linux a huge CPU allocation may succeed lazily and then meet
the OOM killer, which would take the test run with it.
"""

from __future__ import annotations

import pytest
import torch

from cgforge.kernels import ConvGraph, Convolution, TensorProduct, TPProblem, TPTuning
from cgforge.kernels.convolution import GraphTensors
from cgforge.kernels.core import launch
from cgforge.kernels.core.runtime import KernelHandle
from cgforge.kernels.tensor_product.codegen import render
from cgforge.kernels.tensor_product.layout import Layout
from cgforge.kernels.tensor_product.module import MAX_ROW_ELEMENTS, check_row_sizes
from cgforge.kernels.tensor_product.schedule import build_schedule

INT32_LIMIT = 2**31


def _grid_stride_rows(rows: int, blocks: int, warps: int) -> list[int]:
    """The rows the generated kernels visit: warp k of the grid runs rows k, k + stride, ..."""
    stride = blocks * warps
    return sorted(row for first in range(stride) for row in range(first, rows, stride))


# expected: ceil(rows / warps), at least 1, at most cap (worked out by hand, not by the formula under test)
@pytest.mark.parametrize("rows,warps,cap,expected", [(0, 4, None, 1), (1, 4, None, 1), (5, 4, None, 2),
                                                     (8, 4, None, 2), (130, 4, 3, 3), (97, 2, 1, 1),
                                                     (64, 1, 1000, 64), (9, 4, 0, 1)])
def test_launch_blocks_cover_every_row(rows, warps, cap, expected):
    blocks = launch.launch_blocks(rows, warps, cap)
    assert blocks == expected
    assert _grid_stride_rows(rows, blocks, warps) == list(range(rows))


@pytest.mark.parametrize("items, threads", [(0, 256), (1, 256), (256, 256), (257, 256), (2**40 + 1, 128)])
def test_thread_blocks_give_a_thread_to_every_item(items, threads):
    blocks = launch.thread_blocks(items, threads)
    assert blocks >= 1 and blocks * threads >= items  # every item has a thread
    assert items == 0 or (blocks - 1) * threads < items  # and no block is left without one


@pytest.mark.parametrize("rows", [INT32_LIMIT * 4 - 3, 2**40 + 1, 2**62 + 12345])
def test_launch_blocks_are_clamped_to_the_grid_limit_exactly(rows):
    blocks = launch.launch_blocks(rows, 4)
    assert blocks == launch.MAX_BLOCKS == INT32_LIMIT - 1
    # integer arithmetic: no float rounding for row counts above 2**53
    assert launch.launch_blocks(2**60 + 1, 1, cap=2**62) == launch.MAX_BLOCKS
    assert launch.launch_blocks(rows, 4, cap=528) == 528
    assert launch.launch_blocks(rows, 4, max_blocks=3) == 3  # TPTuning.max_blocks


def test_launch_blocks_reject_nonsense():
    with pytest.raises(ValueError, match="rows must be >= 0"):
        launch.launch_blocks(-1, 4)
    with pytest.raises(ValueError, match="warps_per_block >= 1"):
        launch.launch_blocks(10, 0)


@pytest.mark.parametrize("layout,backward", [
    (Layout(), False), (Layout(), True),
    (Layout(csr=True, perm=True, xidx=True), False), (Layout(csr=True, perm=True, gidx=True), True),
    (Layout(xidx=True, atomic=True), False), (Layout(xidx=True, gidx=True, atomic=True), True),
])
def test_generated_kernels_loop_over_rows_with_a_64_bit_grid_stride(layout, backward):
    """What makes the clamped grid safe: every kernel walks rows with a 64-bit grid-stride loop."""
    problem = TPProblem.build("40x0e+3x1o", "1x0e+1x1o", "40x0e+40x1o", [(0, 0, 0, "uvu", True),
                                                                        (0, 1, 1, "uvu", True)])
    source, _ = render(build_schedule(problem), "float", layout, forward=not backward, backward=backward)
    assert ("long long rows)" in source) != backward  # the backward also takes its chunk pass
    assert ("long long rows,\n                    int group_pass)" in source) == backward
    assert "for (long long row = (long long)blockIdx.x * WARPS + warp; row < rows; " \
           "row += (long long)gridDim.x * WARPS)" in source


def test_runtime_refuses_a_grid_beyond_cuda_limits_before_any_driver_call():
    handle = KernelHandle(b"\x7fELF not loaded", "ab" * 32, "k")
    with pytest.raises(ValueError, match="exceeds the CUDA limits"):
        handle.launch((INT32_LIMIT, 1, 1), (128, 1, 1), [])
    with pytest.raises(ValueError, match="exceeds the CUDA limits"):
        handle.launch((1, 65536, 1), (128, 1, 1), [])


@pytest.mark.parametrize("args,name", [
    (("2147483648x0e", "1x0e", "2147483648x0e", [(0, 0, 0, "uvu", False)]), "irreps_in1"),
    (("1x0e", "1x0e", "2147483648x0e", [(0, 0, 0, "uvw", True)]), "irreps_out"),
    (("1024x0e", "2048x0e", "1024x0e", [(0, 0, 0, "uvw", True)]), "weight_numel"),  # 2**31 weights per row
])
def test_rows_beyond_32_bit_offsets_are_refused(args, name):
    with pytest.raises(ValueError, match=f"{name} has .* elements per row.*32-bit"):
        TensorProduct(*args)
    with pytest.raises(ValueError, match=name):
        Convolution(*args)


def test_row_size_limit_is_exact():
    ok = TPProblem.build("1x0e", "1x0e", f"{MAX_ROW_ELEMENTS}x0e", [(0, 0, 0, "uvw", True)])
    check_row_sizes(ok)  # 2**31 - 1 weights and outputs per row: still addressable
    too_big = TPProblem.build("1x0e", "1x0e", f"{MAX_ROW_ELEMENTS + 1}x0e", [(0, 0, 0, "uvw", True)])
    with pytest.raises(ValueError, match="irreps_out"):
        check_row_sizes(too_big)


def test_graph_sizes_beyond_int32_are_refused():
    # 2**31 edges without 8 GB of memory: a stride-0 view has the length and no storage to speak of
    many = torch.zeros(1, dtype=torch.int32).expand(INT32_LIMIT)
    with pytest.raises(ValueError, match=r"edge count \(2147483648\) must be in \[0, 2\^31\)"):
        ConvGraph(many, many, 10)
    with pytest.raises(ValueError, match=r"num_nodes \(2147483648\)"):
        ConvGraph(torch.tensor([0]), torch.tensor([0]), INT32_LIMIT)
    with pytest.raises(ValueError, match="edge indices must be in"):  # would wrap to a valid int32 index
        ConvGraph(torch.tensor([INT32_LIMIT + 3]), torch.tensor([0]), 10)
    # the largest node count is accepted (atomic mode: the CSR row pointers would take 16 GB)
    graph = ConvGraph(torch.tensor([INT32_LIMIT - 2]), torch.tensor([0]), INT32_LIMIT - 1, deterministic=False)
    assert graph.sender.dtype == torch.int32 and graph.sender.item() == INT32_LIMIT - 2


@pytest.mark.parametrize("deterministic", [True, False])
def test_conv_op_refuses_graph_tensors_of_another_width(deterministic):
    graph = ConvGraph(torch.tensor([0, 2, 1]), torch.tensor([1, 1, 0]), 3, deterministic=deterministic)
    graph.tensors().check()  # what ConvGraph builds passes
    tensors = list(graph.tensors())
    for k, name in enumerate(("sender", "receiver", "rowptr", "perm", "rowptr_t", "perm_t")):
        bad = list(tensors)
        other = torch.int64 if tensors[k].dtype == torch.int32 else torch.int32
        bad[k] = tensors[k].to(other)
        with pytest.raises(TypeError, match=f"{name} must be a contiguous 1-D {tensors[k].dtype}"):
            GraphTensors(*bad).check()
    strided = list(tensors)
    strided[0] = torch.tensor([0, 9, 2, 9, 1, 9], dtype=torch.int32)[::2]
    with pytest.raises(TypeError, match="sender must be a contiguous"):
        GraphTensors(*strided).check()


# ------------------------------------------------------------------------------------------ CUDA

cuda = pytest.mark.cuda


def _free_gib() -> float:
    free, _ = torch.cuda.mem_get_info()
    return free / 2**30


@cuda
@pytest.mark.parametrize("shared", [False, True])
def test_grid_capped_far_below_the_row_count_computes_every_row(shared):
    from tp_cases import PROBLEMS, e3nn_tp, random_inputs, rel

    tp = e3nn_tp(PROBLEMS["nequip-water"], shared, device="cuda")
    ours = TensorProduct.from_e3nn(tp, tuning=TPTuning(max_blocks=3))  # 12 warps for 1001 rows: ~84 rows a warp
    x, y, w = random_inputs(tp, 1001, device="cuda")
    ref = tp(x, y, w)
    ref_grads = torch.autograd.grad(ref.square().sum(), (x, y, w))
    out = ours(x, y, w)
    assert rel(out, ref) < 1e-12
    for a, b in zip(torch.autograd.grad(out.square().sum(), (x, y, w)), ref_grads):
        assert rel(a, b) < 1e-11


@cuda
def test_more_than_2_31_rows_are_all_computed():
    rows = INT32_LIMIT + 4097
    if _free_gib() < 40:
        pytest.skip("needs 40 GiB of free GPU memory")
    tp = TensorProduct("1x0e", "1x0e", "1x0e", [(0, 0, 0, "uvu", True)], shared_weights=True)
    x = torch.rand(rows, 1, device="cuda")
    y = torch.ones(rows, 1, device="cuda")
    w = torch.ones(1, device="cuda")
    out = tp(x, y, w)  # path weight 1, CG 1, y = w = 1: out equals x bit for bit, row by row
    del y
    assert out.shape == (rows, 1)
    step = 2**28
    for start in range(0, rows, step):
        assert torch.equal(out[start:start + step], x[start:start + step]), f"rows from {start}"


@cuda
def test_output_too_large_for_memory_raises_torch_oom_and_gpu_stays_usable():
    # inputs of 4 GiB each, an output of 2**30 rows x 2048 channels (8 TiB in FP32)
    tp = TensorProduct("1x0e", "1x0e", "2048x0e", [(0, 0, 0, "uvw", True)], shared_weights=True)
    rows = 2**30
    x = torch.randn(rows, 1, device="cuda")
    y = torch.randn(rows, 1, device="cuda")
    w = torch.randn(2048, device="cuda")
    with pytest.raises(torch.OutOfMemoryError):
        tp(x, y, w)
    conv = Convolution("1x0e", "1x0e", "2048x0e", [(0, 0, 0, "uvw", True)], shared_weights=True)
    graph = ConvGraph(torch.tensor([0, 5], device="cuda"), torch.tensor([3, rows - 1], device="cuda"), rows)
    with pytest.raises(torch.OutOfMemoryError):
        conv(x, y[:2], w, graph)
    torch.cuda.synchronize()  # no sticky CUDA error: the next call runs and is right
    out = tp(x[:100], y[:100], w)
    expected = (x[:100] * y[:100]) * w  # path weight 1 (one input element per output channel)
    assert torch.allclose(out, expected, rtol=1e-6, atol=1e-6)


@cuda
def test_conv_op_called_directly_with_int64_indices_is_refused():
    conv = Convolution("4x0e", "1x0e", "4x0e", [(0, 0, 0, "uvu", True)])
    graph = ConvGraph(torch.tensor([0, 1], device="cuda"), torch.tensor([1, 0], device="cuda"), 2)
    x = torch.randn(2, 4, device="cuda")
    y = torch.randn(2, 1, device="cuda")
    w = torch.randn(2, 4, device="cuda")
    tensors = list(graph.tensors())
    tensors[0] = tensors[0].long()
    with pytest.raises(TypeError, match="sender must be a contiguous 1-D torch.int32"):
        torch.ops.cgforge.conv_forward(x, y, w, *tensors, conv.key, True)
