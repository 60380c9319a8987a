"""The generated kernels on the GPU against e3nn (FP64 and FP32) with fresh random inputs."""

import pytest
import torch
from oracles import e3nn_conv
from tp_cases import PROBLEMS, e3nn_tp, random_inputs, rel

from cgforge.kernels import ConvGraph, Convolution, TensorProduct, TPTuning

pytestmark = pytest.mark.cuda
DEV = "cuda"
TOL = {torch.float64: 1e-12, torch.float32: 1e-5}


@pytest.mark.parametrize("name", list(PROBLEMS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("batch", [1, 33, 1000])
def test_tp_forward_backward(name, dtype, shared, batch):
    ref_tp = e3nn_tp(PROBLEMS[name], shared, device=DEV)
    ours = TensorProduct.from_e3nn(ref_tp)
    x, y, w = random_inputs(ref_tp, batch, device=DEV, seed=batch)
    ref = ref_tp(x, y, w)
    g = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (x, y, w), g)
    xs, ys, ws = (t.detach().to(dtype).requires_grad_() for t in (x, y, w))
    out = ours(xs, ys, ws)
    assert rel(out.double(), ref) < TOL[dtype]
    for a, b in zip(torch.autograd.grad(out, (xs, ys, ws), g.to(dtype)), ref_grads):
        assert rel(a.double(), b) < TOL[dtype] * 10


@pytest.mark.parametrize("name", ["mace-medium", "diffdock-L1", "nequip-water"])
def test_tp_double_backward(name):
    tp = e3nn_tp(PROBLEMS[name], device=DEV)
    ours = TensorProduct.from_e3nn(tp)
    x, y, w = random_inputs(tp, 17, device=DEV)
    g = torch.randn(17, tp.irreps_out.dim, dtype=torch.float64, device=DEV)

    def second(m):
        gx, gy, gw = torch.autograd.grad(m(x, y, w), (x, y, w), g, create_graph=True)
        loss = (gx ** 2).sum() + (gy * y).sum() + gw.sin().sum()
        return torch.autograd.grad(loss, (x, y, w))

    for a, b in zip(second(ours), second(tp)):
        assert rel(a, b) < 1e-11


def test_tp_empty_batch_noncontiguous_and_stream():
    tp = e3nn_tp(PROBLEMS["mace-medium"], device=DEV)
    ours = TensorProduct.from_e3nn(tp)
    x, y, w = random_inputs(tp, 64, device=DEV)
    assert ours(x[:0], y[:0], w[:0]).shape == (0, tp.irreps_out.dim)
    xt = x.detach().t().contiguous().t()  # column-major: not contiguous
    assert not xt.is_contiguous()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        out = ours(xt, y, w)
    s.synchronize()
    assert rel(out, tp(x, y, w)) < 1e-12


def test_tp_cuda_graph_capture():
    tp = e3nn_tp(PROBLEMS["mace-medium"], dtype=torch.float32, device=DEV)
    ours = TensorProduct.from_e3nn(tp)
    x, y, w = (t.detach().float() for t in random_inputs(tp, 256, device=DEV))
    ours(x, y, w)  # compile + load outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ours(x, y, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert rel(out, tp(x, y, w)) < 1e-5


def test_tp_torch_compile():
    tp = e3nn_tp(PROBLEMS["nequip-water"], device=DEV)
    ours = TensorProduct.from_e3nn(tp)
    x, y, w = random_inputs(tp, 100, device=DEV)
    out = torch.compile(ours, fullgraph=True)(x, y, w)
    assert rel(out, tp(x, y, w)) < 1e-12


def _graph(n, e, seed, device=DEV):
    gen = torch.Generator().manual_seed(seed)
    s, r = torch.randint(0, n, (e,), generator=gen), torch.randint(0, n, (e,), generator=gen)
    return s.to(device), r.to(device)


@pytest.mark.parametrize("name", ["mace-medium", "nequip-water", "diffdock-L1", "mace-large"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("n,e", [(1, 0), (1, 5), (50, 400), (300, 6000)])
def test_conv_forward_backward(name, dtype, deterministic, n, e):
    tp = e3nn_tp(PROBLEMS[name], device=DEV)
    conv = Convolution.from_e3nn(tp)
    s, r = _graph(n, e, seed=e)
    graph = ConvGraph(s, r, n, deterministic=deterministic)
    x = torch.randn(n, tp.irreps_in1.dim, dtype=torch.float64, device=DEV, requires_grad=True)
    y = torch.randn(e, tp.irreps_in2.dim, dtype=torch.float64, device=DEV, requires_grad=True)
    w = torch.randn(e, tp.weight_numel, dtype=torch.float64, device=DEV, requires_grad=True)
    ref = e3nn_conv(tp, x, y, w, s, r, n)
    g = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (x, y, w), g)
    xs, ys, ws = (t.detach().to(dtype).requires_grad_() for t in (x, y, w))
    out = conv(xs, ys, ws, graph)
    assert rel(out.double(), ref) < TOL[dtype] * 10
    for a, b in zip(torch.autograd.grad(out, (xs, ys, ws), g.to(dtype)), ref_grads):
        assert rel(a.double(), b) < TOL[dtype] * 10


@pytest.mark.parametrize("name", ["mace-medium", "diffdock-L1"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("order, chunk", [("edges", None), ("chunks", 32)])
def test_conv_edges_outer_loop_order(name, dtype, deterministic, order, chunk):
    """The other loop orders (edges outermost: every segment per edge, or the segments of one channel chunk per
    edge, chunk 32 so that there are several) on the GPU, against e3nn."""
    torch.set_default_dtype(torch.float64)
    tp = e3nn_tp(PROBLEMS[name], device=DEV)
    conv = Convolution.from_e3nn(tp, tuning=TPTuning(forward_chunk=chunk, backward_chunk=chunk, loop_order=order))
    n, e = 50, 400
    s, r = _graph(n, e, seed=7)
    graph = ConvGraph(s, r, n, deterministic=deterministic)
    x = torch.randn(n, tp.irreps_in1.dim, dtype=torch.float64, device=DEV, requires_grad=True)
    y = torch.randn(e, tp.irreps_in2.dim, dtype=torch.float64, device=DEV, requires_grad=True)
    w = torch.randn(e, tp.weight_numel, dtype=torch.float64, device=DEV, requires_grad=True)
    ref = e3nn_conv(tp, x, y, w, s, r, n)
    g = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (x, y, w), g)
    xs, ys, ws = (t.detach().to(dtype).requires_grad_() for t in (x, y, w))
    out = conv(xs, ys, ws, graph)
    assert rel(out.double(), ref) < TOL[dtype] * 10
    for a, b in zip(torch.autograd.grad(out, (xs, ys, ws), g.to(dtype)), ref_grads):
        assert rel(a.double(), b) < TOL[dtype] * 10


def test_conv_deterministic_is_bitwise_reproducible_and_double_backward():
    tp = e3nn_tp(PROBLEMS["mace-medium"], device=DEV)
    conv = Convolution.from_e3nn(tp)
    s, r = _graph(200, 5000, seed=3)
    graph = ConvGraph(s, r, 200)
    f32 = dict(dtype=torch.float32, device=DEV, requires_grad=True)  # FP32 whatever the default dtype
    x = torch.randn(200, tp.irreps_in1.dim, **f32)
    y = torch.randn(5000, tp.irreps_in2.dim, **f32)
    w = torch.randn(5000, tp.weight_numel, **f32)
    outs = [conv(x, y, w, graph) for _ in range(3)]
    grads = [torch.autograd.grad(o.square().sum(), (x, y, w)) for o in outs]
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert all(torch.equal(a, b) for gs in grads[1:] for a, b in zip(grads[0], gs))
    # double backward (force-training style) against e3nn in FP64
    xd, yd, wd = (t.detach().double()[: None].requires_grad_() for t in (x, y, w))

    def second(f):
        out = f(xd, yd, wd)
        gx, = torch.autograd.grad(out.square().sum(), xd, create_graph=True)
        return torch.autograd.grad(gx.square().sum(), (xd, yd, wd))

    tp64 = e3nn_tp(PROBLEMS["mace-medium"], device=DEV)
    ref = second(lambda a, b, c: e3nn_conv(tp64, a, b, c, s, r, 200))
    got = second(lambda a, b, c: conv(a, b, c, graph))
    for a, b in zip(got, ref):
        assert rel(a, b) < 1e-11


def test_conv_cuda_graph_capture():
    tp = e3nn_tp(PROBLEMS["mace-medium"], dtype=torch.float32, device=DEV)
    conv = Convolution.from_e3nn(tp)
    s, r = _graph(100, 2000, seed=5)
    graph = ConvGraph(s, r, 100)
    # FP32 stated, not inherited: under a float64 default (nequip's) the inputs would not match tp's FP32
    f32 = dict(dtype=torch.float32, device=DEV)
    x = torch.randn(100, tp.irreps_in1.dim, **f32)
    y = torch.randn(2000, tp.irreps_in2.dim, **f32)
    w = torch.randn(2000, tp.weight_numel, **f32)
    conv(x, y, w, graph)
    cg = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cg):
        out = conv(x, y, w, graph)
    x.copy_(torch.randn_like(x))
    cg.replay()
    torch.cuda.synchronize()
    ref = e3nn_conv(tp, x, y, w, s, r, 100)
    assert rel(out, ref) < 1e-5
