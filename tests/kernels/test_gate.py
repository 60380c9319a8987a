"""The gate kernels (cgforge.kernels.gate) and their stand-in (cgforge.patches.gate.FusedGate): the table read off
e3nn's Gate gives e3nn's numbers and derivatives in FP64 on fresh random inputs; the CUDA source compiles (NVRTC,
no GPU needed) and runs on the CPU as C++ (``host_cuda``) equal to the torch reference; on a GPU the kernels equal
the reference, bitwise the same on a rerun, to the second derivative."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from e3nn.nn import Gate
from host_cuda import assert_compiles_without_spills, build, call

from cgforge.kernels.gate import GATE_SOURCE, GateTable, gate, gate_backward_reference, gate_reference
from cgforge.patches.gate import FusedGate, gate_table, swap_in, swap_out

silu, tanh, sigmoid = torch.nn.functional.silu, torch.tanh, torch.sigmoid

# (scalars, their activations, gates, theirs, gated): NequIP's layer, odd scalars and gates, an unsorted input,
# scalars only (NequIP's last layer), higher l
GATES = {
    "nequip": ("128x0e", [silu], "96x0e", [silu], "64x1o+32x2e"),
    "parity": ("16x0e+8x0o", [silu, tanh], "8x0e+4x0o", [sigmoid, tanh], "4x1o+2x2e+3x1e+3x0o"),
    "scalars": ("32x0e", [silu], "", [], ""),
    "high-l": ("4x0e", [silu], "6x0e", [silu], "2x1o+2x2e+2x3o"),
}


def make_gate(name: str) -> torch.nn.Module:
    return Gate(*GATES[name]).double()


def random_inputs(width: int, rows: int, seed: int, dtype=torch.float64, device="cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (2 * torch.randn(rows, width, generator=gen, dtype=torch.float64)).to(device=device, dtype=dtype)


@pytest.mark.smoke
@pytest.mark.parametrize("name", sorted(GATES))
def test_fused_gate_equals_e3nn_to_second_derivatives_fp64(name: str) -> None:
    original = make_gate(name)
    fused = FusedGate.wrap(original, name)
    assert fused is not None
    assert list(fused.state_dict()) == list(original.state_dict())
    x = random_inputs(original.irreps_in.dim, 13, seed=len(name)).requires_grad_()
    weights = random_inputs(original.irreps_out.dim, 13, seed=7)
    direction = random_inputs(original.irreps_in.dim, 13, seed=8)
    results = []
    for module in (fused, original):
        out = module(x)
        (grad,) = torch.autograd.grad((out * weights).sum(), x, create_graph=True)
        (second,) = torch.autograd.grad((grad * direction).sum(), x)
        results.append((out.detach(), grad.detach(), second))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_batch_dimensions_and_unpatch() -> None:
    model = torch.nn.Sequential(make_gate("parity"))
    x = random_inputs(model[0].irreps_in.dim, 12, seed=1).reshape(3, 4, -1)
    want = model(x)
    assert swap_in(model) == 1 and isinstance(model[0], FusedGate)
    torch.testing.assert_close(model(x), want, rtol=1e-12, atol=1e-12)
    assert swap_out(model) == 1 and isinstance(model[0], Gate)


def test_an_activation_the_kernels_lack_keeps_e3nn() -> None:
    original = Gate("4x0e", [torch.nn.functional.softplus], "2x0e", [silu], "2x1o")
    assert gate_table(original) is None
    model = torch.nn.Sequential(original)
    assert swap_in(model) == 0 and model[0] is original


def test_bad_tables_and_inputs_are_named() -> None:
    with pytest.raises(ValueError, match="no output columns"):
        GateTable(3, (), (), (), ())
    with pytest.raises(ValueError, match="src column 5"):
        GateTable(3, (5,), (-1,), (1,), (1.0,))
    with pytest.raises(ValueError, match="gate column 3"):
        GateTable(3, (0,), (3,), (1,), (1.0,))
    with pytest.raises(ValueError, match="activation code 9"):
        GateTable(3, (0,), (-1,), (9,), (1.0,))
    with pytest.raises(ValueError, match="differ in length"):
        GateTable(3, (0, 1), (-1,), (1,), (1.0,))
    with pytest.raises(ValueError, match="its own source"):
        GateTable(3, (1,), (1,), (1,), (1.0,))
    arrays = GateTable(3, (0, 1), (-1, 2), (1, 2), (1.0, 0.5)).arrays()
    with pytest.raises(ValueError, match=r"shape \[rows, 3\]"):
        gate(torch.zeros(4, 5, dtype=torch.float64), arrays)


def test_kernels_compile_without_spills() -> None:
    names = [f"gate_{direction}_{suffix}" for direction in ("forward", "backward") for suffix in ("f32", "f64")]
    assert_compiles_without_spills(GATE_SOURCE, "gate.cu", names)


_DRIVER = """
extern "C" void forward(const S* x, S* out, const int* src, const int* gate, const int* code, const S* scale,
                        long long rows, int in_width, int out_width) {
    blockDim.x = THREADS;
    for (long long b = 0; b * THREADS < rows * out_width; ++b)
        for (int t = 0; t < THREADS; ++t) {
            blockIdx.x = b; threadIdx.x = t;
            gate_forward_SUFFIX(x, out, src, gate, code, scale, rows, in_width, out_width);
        }
}
extern "C" void backward(const S* x, const S* g, S* gx, const int* src, const int* gate, const int* code,
                         const S* scale, const int* ptr, const int* col, const int* role, long long rows,
                         int in_width, int out_width) {
    blockDim.x = THREADS;
    for (long long b = 0; b * THREADS < rows * in_width; ++b)
        for (int t = 0; t < THREADS; ++t) {
            blockIdx.x = b; threadIdx.x = t;
            gate_backward_SUFFIX(x, g, gx, src, gate, code, scale, ptr, col, role, rows, in_width, out_width);
        }
}
"""


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cuda_source_run_as_cpp_equals_the_reference(dtype: torch.dtype, tmp_path) -> None:
    scalar, suffix = ("double", "f64") if dtype == torch.float64 else ("float", "f32")
    driver = f"typedef {scalar} S;\n" + _DRIVER.replace("SUFFIX", suffix).replace("THREADS", "64")
    library = build(GATE_SOURCE, driver, tmp_path, f"gate_{suffix}")
    fused = FusedGate.wrap(make_gate("parity"), "parity")
    arrays = fused.arrays()._replace(scale=fused.gate_scale.to(dtype))
    rows = 37
    x = random_inputs(arrays.in_width, rows, seed=3, dtype=dtype)
    g = random_inputs(arrays.out_width, rows, seed=4, dtype=dtype)
    tables = [a.numpy() for a in arrays]
    out = np.zeros((rows, arrays.out_width), dtype=x.numpy().dtype)
    grad_x = np.zeros((rows, arrays.in_width), dtype=x.numpy().dtype)
    ints = [rows, ctypes.c_int(arrays.in_width), ctypes.c_int(arrays.out_width)]
    call(library.forward, [x.numpy(), out, *tables[:4], *ints])
    call(library.backward, [x.numpy(), g.numpy(), grad_x, *tables, *ints])
    tol = 1e-13 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(torch.from_numpy(out), gate_reference(x, arrays), rtol=tol, atol=tol)
    torch.testing.assert_close(torch.from_numpy(grad_x), gate_backward_reference(x, g, arrays), rtol=tol, atol=tol)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", ["nequip", "parity"])
def test_cuda_kernels_equal_the_reference_and_repeat_bitwise(name: str, dtype: torch.dtype) -> None:
    fused = FusedGate.wrap(make_gate(name), name).to(device="cuda", dtype=dtype)
    arrays = fused.arrays()
    x = random_inputs(arrays.in_width, 5000, seed=5, dtype=dtype, device="cuda").requires_grad_()
    weights = random_inputs(arrays.out_width, 5000, seed=6, dtype=dtype, device="cuda")
    out = gate(x, arrays)
    (grad,) = torch.autograd.grad((out * weights).sum(), x)
    again = gate(x, arrays)
    (grad_again,) = torch.autograd.grad((again * weights).sum(), x)
    assert torch.equal(out, again) and torch.equal(grad, grad_again)
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    torch.testing.assert_close(out, gate_reference(x.detach(), arrays), rtol=tol, atol=tol)
    torch.testing.assert_close(grad, gate_backward_reference(x.detach(), weights, arrays), rtol=tol, atol=tol)


@pytest.mark.cuda
def test_cuda_fused_gate_equals_e3nn_to_second_derivatives() -> None:
    original = make_gate("nequip").cuda()
    fused = FusedGate.wrap(original, "nequip")
    x = random_inputs(original.irreps_in.dim, 300, seed=9, device="cuda").requires_grad_()
    weights = random_inputs(original.irreps_out.dim, 300, seed=10, device="cuda")
    direction = random_inputs(original.irreps_in.dim, 300, seed=11, device="cuda")
    results = []
    for module in (fused, original):
        (grad,) = torch.autograd.grad((module(x) * weights).sum(), x, create_graph=True)
        (second,) = torch.autograd.grad((grad * direction).sum(), x)
        (first_only,) = torch.autograd.grad((module(x) * weights).sum(), x)  # the kernel's backward
        results.append((grad.detach(), second, first_only))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
