"""CPU tests of the tensor-product pipeline against e3nn (FP64 and FP32)."""

import zlib

import pytest
import torch
from tp_cases import PROBLEMS, e3nn_tp, random_inputs, rel, single_path

from cgforge.kernels import TensorProduct, TPProblem
from cgforge.kernels.tensor_product.evaluate import run_backward, run_forward
from cgforge.kernels.tensor_product.schedule import build_schedule

SMALL = ["nequip-water", "nequip-lmax1-parity", "diffdock-L1", "tetris-poly"]


@pytest.mark.parametrize("name", list(PROBLEMS))
@pytest.mark.smoke
def test_problem_matches_e3nn_normalisation(name):
    tp = e3nn_tp(PROBLEMS[name])
    assert TPProblem.from_e3nn(tp) == TPProblem.build(*PROBLEMS[name])


@pytest.mark.parametrize("name", list(PROBLEMS))
@pytest.mark.parametrize("shared", [False, True])
def test_forward_backward_fp64(name, shared):
    tp = e3nn_tp(PROBLEMS[name], shared)
    ours = TensorProduct.from_e3nn(tp)
    x, y, w = random_inputs(tp, 7, seed=zlib.crc32(name.encode()) % 1000)  # stable: hash() varies with PYTHONHASHSEED
    ref, out = tp(x, y, w), ours(x, y, w)
    assert rel(out, ref) < 1e-12
    g = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, (x, y, w), g), torch.autograd.grad(ref, (x, y, w), g)):
        assert rel(a, b) < 1e-12


@pytest.mark.parametrize("name", ["mace-medium", "diffdock-L1"])
def test_forward_backward_fp32(name):
    tp64 = e3nn_tp(PROBLEMS[name])
    ours = TensorProduct.from_e3nn(tp64)
    x, y, w = random_inputs(tp64, 9)
    ref = tp64(x, y, w)
    x32, y32, w32 = (t.detach().float().requires_grad_() for t in (x, y, w))
    out = ours(x32, y32, w32)
    assert out.dtype == torch.float32
    assert rel(out.double(), ref) < 1e-5


@pytest.mark.parametrize("name", ["mace-medium", "diffdock-L1"])
def test_double_backward_matches_e3nn(name):
    tp = e3nn_tp(PROBLEMS[name])
    ours = TensorProduct.from_e3nn(tp)
    x, y, w = random_inputs(tp, 4)
    g = torch.randn(4, tp.irreps_out.dim, dtype=torch.float64)

    def second(m):
        gx, gy, gw = torch.autograd.grad(m(x, y, w), (x, y, w), g, create_graph=True)
        loss = (gx ** 2).sum() + (gy * y).sum() + gw.sin().sum()
        return torch.autograd.grad(loss, (x, y, w))

    for a, b in zip(second(ours), second(tp)):
        assert rel(a, b) < 1e-11


@pytest.mark.parametrize("shared", [False, True])
def test_gradcheck_and_gradgradcheck(shared):
    from tp_cases import fully_connected

    tp = e3nn_tp(fully_connected("1x0e+1x1o", "1x1o", "1x0e+1x1o+1x2e"), shared)
    ours = TensorProduct.from_e3nn(tp)
    x, y, w = random_inputs(tp, 2)
    assert torch.autograd.gradcheck(ours, (x, y, w))
    assert torch.autograd.gradgradcheck(ours, (x, y, w))


@pytest.mark.parametrize("l1,l2,l3", [(0, 0, 0), (1, 1, 2), (2, 3, 1), (3, 3, 6), (6, 6, 0), (6, 5, 4),
                                      (4, 6, 2), (5, 1, 6)])
@pytest.mark.parametrize("mode,mul1,mul2", [("uvu", 37, 1), ("uvu", 5, 3), ("uvw", 4, 2)])
def test_single_path_sweep(l1, l2, l3, mode, mul1, mul2):
    args = single_path(l1, l2, l3, mul1, mul2, mode, mul_out=3)
    tp = e3nn_tp(args)
    ours = TensorProduct.from_e3nn(tp)
    x, y, w = random_inputs(tp, 3)
    ref = tp(x, y, w)
    assert rel(ours(x, y, w), ref) < 1e-12
    sched = build_schedule(ours.problem, max_chunk=32)
    assert rel(run_forward(sched, x.detach(), y.detach(), w.detach()), ref.detach()) < 1e-12


@pytest.mark.parametrize("name", list(PROBLEMS))
@pytest.mark.slow
def test_schedule_interpreter(name):
    """The schedule, executed segment by segment as the kernel does, equals e3nn."""
    tp = e3nn_tp(PROBLEMS[name], shared=name == "tetris-poly")
    x, y, w = random_inputs(tp, 3)
    ref = tp(x, y, w)
    g = torch.randn_like(ref)
    grads = torch.autograd.grad(ref, (x, y, w), g)
    problem = TPProblem.from_e3nn(tp)
    for fwd_chunk, bwd_chunk in ((32, 128), (128, 32), (64, 64)):
        sched = build_schedule(problem, max_chunk=fwd_chunk, max_chunk_backward=bwd_chunk)
        assert rel(run_forward(sched, x.detach(), y.detach(), w.detach()), ref.detach()) < 1e-12
        for a, b in zip(run_backward(sched, x.detach(), y.detach(), w.detach(), g), grads):
            assert rel(a, b) < 1e-12


def test_large_multiplicity_is_chunked():
    args = single_path(6, 2, 6, 1024, 1, "uvu")
    problem = TPProblem.build(*args)
    sched = build_schedule(problem, itemsize=8)
    for launch in (sched.forward_launch, sched.backward_launch):
        assert launch.smem_per_warp * 8 * launch.warps_per_block <= 96 * 1024
    assert len(sched.forward) >= 8  # 1024 channels split into chunks
    tp = e3nn_tp(args)
    x, y, w = random_inputs(tp, 2)
    assert rel(run_forward(sched, x.detach(), y.detach(), w.detach()), tp(x, y, w).detach()) < 1e-12


def test_torch_compile_fullgraph():
    tp = e3nn_tp(PROBLEMS["nequip-water"])
    ours = TensorProduct.from_e3nn(tp)
    x, y, w = random_inputs(tp, 5)
    compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")
    out = compiled(x, y, w)
    assert rel(out, tp(x, y, w)) < 1e-12
    gx = torch.autograd.grad(out.sum(), x)[0]
    assert rel(gx, torch.autograd.grad(tp(x, y, w).sum(), x)[0]) < 1e-12


def test_nan_propagates_like_e3nn():
    tp = e3nn_tp(PROBLEMS["nequip-water"])
    ours = TensorProduct.from_e3nn(tp)
    x, y, w = random_inputs(tp, 3)
    x = x.detach().clone()
    x[1, 0] = float("nan")
    assert torch.equal(torch.isnan(ours(x, y, w)), torch.isnan(tp(x, y, w)))


def test_bad_inputs_name_the_problem():
    tp = e3nn_tp(PROBLEMS["nequip-water"])
    ours = TensorProduct.from_e3nn(tp)
    x, y, w = random_inputs(tp, 3)
    with pytest.raises(ValueError, match="x must have shape"):
        ours(x[:, :-1], y, w)
    with pytest.raises(ValueError, match="y must have 3 rows"):
        ours(x, y[:2], w)
    with pytest.raises(ValueError, match="weight must have shape"):
        ours(x, y, w[:, 1:])
    with pytest.raises(TypeError, match="y has dtype"):
        ours(x, y.float(), w)
    with pytest.raises(TypeError, match="float32 or float64"):
        ours(x.long(), y, w)
    with pytest.raises(ValueError, match="connection mode 'uuu' is not supported"):
        TensorProduct("2x0e", "1x0e", "2x0e", [(0, 0, 0, "uuu", True)])
    with pytest.raises(ValueError, match="l=7 exceeds"):
        TensorProduct("2x7e", "1x0e", "2x7e", [(0, 0, 0, "uvu", True)])
    with pytest.raises(ValueError, match="selection rule"):
        TensorProduct("2x1o", "1x1o", "2x1o", [(0, 0, 0, "uvu", True)])
    with pytest.raises(ValueError, match="irreps_in1"):
        TensorProduct("2xbanana", "1x0e", "2x0e", [(0, 0, 0, "uvu", True)])
    with pytest.raises(ValueError, match="internal_weights=False"):
        from e3nn import o3
        TensorProduct.from_e3nn(o3.FullyConnectedTensorProduct("2x0e", "1x0e", "2x0e"))
