"""Fixed-order segment sums (cgforge.kernels.segment_sum): the CPU reference, the generated kernel's compile
report (NVRTC works without a GPU), and on CUDA bitwise-repeatable sums equal to the reference."""

from __future__ import annotations

import pytest
import torch
from oracles import replayed

from cgforge.kernels.segment_sum import SEGMENT_SUM_SOURCE, segment_sum, segment_sum_reference


def _rows(seed: int, rows: int, max_len: int) -> torch.Tensor:
    lengths = torch.randint(0, max_len + 1, (rows,), generator=torch.Generator().manual_seed(seed))
    return torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])


def _loop_sums(values: torch.Tensor, rowptr: torch.Tensor) -> torch.Tensor:
    return torch.stack([values[a:b].double().sum(0) for a, b in zip(rowptr[:-1].tolist(), rowptr[1:].tolist())])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.smoke
def test_reference_equals_loop_sums_with_empty_rows_and_spare_elements(dtype: torch.dtype) -> None:
    rowptr = _rows(0, 50, 9)
    values = torch.randn(int(rowptr[-1]) + 7, 3, dtype=dtype, generator=torch.Generator().manual_seed(1))
    got = segment_sum(values, rowptr)  # CPU: the reference
    assert got.dtype == dtype and got.shape == (50, 3)
    torch.testing.assert_close(got.double(), _loop_sums(values, rowptr), rtol=1e-6 if dtype == torch.float32
                               else 1e-13, atol=1e-6 if dtype == torch.float32 else 1e-13)


def test_bad_shapes_are_named() -> None:
    with pytest.raises(ValueError, match="values"):
        segment_sum(torch.zeros(4), torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="rowptr"):
        segment_sum(torch.zeros(4, 3), torch.zeros(2, 2, dtype=torch.int64))


def test_kernel_compiles_without_spills() -> None:
    from cgforge.kernels.core.compiler import compile_cubin, nvrtc_available

    if not nvrtc_available():
        pytest.skip("NVRTC is not installed")
    result = compile_cubin(SEGMENT_SUM_SOURCE, arch="sm_80", name="segment_sum.cu")
    for name in ("segment_sum_f32", "segment_sum_f64"):
        res = result.resources(name)
        assert not res.spills and res.stack_frame == 0, res


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_kernel_is_bitwise_repeatable_and_equals_the_reference(dtype: torch.dtype) -> None:
    rowptr = _rows(2, 20000, 200).cuda()
    values = torch.randn(int(rowptr[-1]) + 5, 3, dtype=dtype, device="cuda",
                         generator=torch.Generator(device="cuda").manual_seed(3)) * 10.0 ** torch.randint(
        -8, 4, (int(rowptr[-1]) + 5, 1), device="cuda", generator=torch.Generator(device="cuda").manual_seed(4))
    first = segment_sum(values, rowptr)
    for _ in range(10):
        assert torch.equal(segment_sum(values, rowptr), first)
    ref = segment_sum_reference(values, rowptr)
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    assert float((first.double() - ref.double()).norm() / ref.double().norm()) < tol


@pytest.mark.cuda
def test_cuda_gradients_to_second_order_equal_the_reference() -> None:
    torch.manual_seed(0)
    rowptr = _rows(5, 300, 20).cuda()
    values = torch.randn(int(rowptr[-1]) + 3, 3, dtype=torch.float64, device="cuda")
    weights = torch.randn(300, 3, dtype=torch.float64, device="cuda")
    grads = []
    for fn in (segment_sum, segment_sum_reference):
        v = values.clone().requires_grad_()
        g, = torch.autograd.grad((torch.sin(fn(v, rowptr)) * weights).sum(), v, create_graph=True)
        gg, = torch.autograd.grad(g.square().sum(), v)
        grads.append((g.detach(), gg))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.cuda
def test_cuda_graph_capture() -> None:
    rowptr = _rows(6, 1000, 50).cuda()
    values = torch.randn(int(rowptr[-1]), 3, dtype=torch.float32, device="cuda")
    out = replayed(lambda: segment_sum(values, rowptr), values)
    torch.testing.assert_close(out, segment_sum_reference(values, rowptr), rtol=1e-6, atol=1e-5)
