"""CPU tests of the fused convolution (reference path and autograd formulas) against e3nn."""

import numpy as np
import pytest
import torch
from oracles import e3nn_conv
from tp_cases import PROBLEMS, e3nn_tp, rel

from cgforge.kernels import ConvGraph, Convolution


def leaves(tp, n, e, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=gen, dtype=dtype).requires_grad_()
            for shape in ((n, tp.irreps_in1.dim), (e, tp.irreps_in2.dim), (e, tp.weight_numel))]


GRAPHS = [(1, 0, torch.int64), (1, 4, torch.int32), (7, 40, torch.int64), (30, 200, torch.int32)]


def random_graph(n, e):
    gen = torch.Generator().manual_seed(e)
    s, r = torch.randint(0, n, (e,), generator=gen), torch.randint(0, n, (e,), generator=gen)
    if e >= 4:
        s[:2], r[:2] = 0, 0  # a self-edge, repeated
    return s, r


# The CPU op sums with index_add whatever the graph's mode (the mode picks CUDA kernels): one run per graph,
# and the mode's CPU-visible effect, the CSR arrays the CUDA kernels read, is tested on its own below.
@pytest.mark.parametrize("n,e,index_dtype", GRAPHS)
@pytest.mark.smoke
def test_random_graph_matches_e3nn(n, e, index_dtype):
    tp = e3nn_tp(PROBLEMS["nequip-water"])
    conv = Convolution.from_e3nn(tp)
    s, r = random_graph(n, e)
    graph = ConvGraph(s.to(index_dtype), r.to(index_dtype), n)
    x, y, w = leaves(tp, n, e)
    ref = e3nn_conv(tp, x, y, w, s, r, n)
    out = conv(x, y, w, graph)
    assert rel(out, ref) < 1e-12
    g = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, (x, y, w), g), torch.autograd.grad(ref, (x, y, w), g)):
        assert rel(a, b) < 1e-12


def _check_csr(rowptr, perm, keys, n):
    """rowptr counts the edges of each row; perm (empty: identity) lists the edges sorted by row, stably."""
    order = perm.long() if perm.numel() else torch.arange(keys.shape[0])
    assert rowptr.dtype == torch.int64 and perm.dtype == torch.int32
    assert torch.equal(rowptr, torch.cat([torch.zeros(1, dtype=torch.int64),
                                          torch.bincount(keys, minlength=n).cumsum(0)]))
    assert torch.equal(order.sort().values, torch.arange(keys.shape[0]))  # a permutation
    sorted_keys = keys[order]
    assert bool((sorted_keys[1:] >= sorted_keys[:-1]).all())
    for row in range(n):  # stable: within a row, edges in their original order
        assert bool((order[rowptr[row]:rowptr[row + 1]].diff() > 0).all())


@pytest.mark.parametrize("n,e,index_dtype", GRAPHS + [(5, 12, torch.int64)])
def test_graph_modes_on_cpu(n, e, index_dtype):
    s, r = random_graph(n, e)
    if n == 5:
        r = r.sort().values  # already sorted receivers: perm stays empty (the kernels read edges in order)
    det = ConvGraph(s.to(index_dtype), r.to(index_dtype), n)
    assert det.deterministic and det.sender.dtype == det.receiver.dtype == torch.int32
    _check_csr(det.rowptr, det.perm, r, n)
    _check_csr(det.rowptr_t, det.perm_t, s, n)
    assert det.perm_t.numel() == e  # the backward kernel always reads perm_t
    if n == 5:
        assert det.perm.numel() == 0
    atomic = ConvGraph(s.to(index_dtype), r.to(index_dtype), n, deterministic=False)
    assert not atomic.deterministic
    assert [t.numel() for t in atomic.tensors()[2:]] == [0, 0, 0, 0]  # atomics need no CSR
    # the CPU op ignores the mode: both give the same sums, bit for bit
    tp = e3nn_tp(PROBLEMS["nequip-water"])
    conv = Convolution.from_e3nn(tp)
    x, y, w = (t.detach() for t in leaves(tp, n, e))
    assert torch.equal(conv(x, y, w, det), conv(x, y, w, atomic))


def test_water_box_graph_fp64_fp32_and_double_backward():
    from cgforge.plugin.runtime.neighbours import neighbour_list
    from cgforge.plugin.water import water_box

    atoms = water_box(n_molecules=8)
    s, r, _ = neighbour_list(torch.tensor(atoms.positions), torch.tensor(np.array(atoms.cell)),
                             tuple(atoms.pbc), 3.0)
    n, e = len(atoms), s.shape[0]
    assert e > 0
    tp = e3nn_tp(PROBLEMS["mace-medium"])
    conv = Convolution.from_e3nn(tp)
    graph = ConvGraph(s, r, n)
    x, y, w = leaves(tp, n, e)
    ref = e3nn_conv(tp, x, y, w, s, r, n)
    assert rel(conv(x, y, w, graph), ref) < 1e-12
    x32, y32, w32 = (t.detach().float() for t in (x, y, w))
    assert rel(conv(x32, y32, w32, graph).double(), ref) < 1e-5

    def second(f):
        gx, = torch.autograd.grad(f(x, y, w).square().sum(), x, create_graph=True)
        return torch.autograd.grad(gx.square().sum(), (x, y, w))

    got = second(lambda a, b, c: conv(a, b, c, graph))
    want = second(lambda a, b, c: e3nn_conv(tp, a, b, c, s, r, n))
    for a, b in zip(got, want):
        assert rel(a, b) < 1e-11


@pytest.mark.slow
def test_gradgradcheck_small():
    from tp_cases import channelwise

    tp = e3nn_tp(channelwise("2x0e+1x1o", "1x0e+1x1o", "2x0e+1x1o"))
    conv = Convolution.from_e3nn(tp)
    s, r = torch.tensor([0, 1, 2, 2]), torch.tensor([1, 0, 0, 2])
    graph = ConvGraph(s, r, 3)
    x, y, w = leaves(tp, 3, 4)
    assert torch.autograd.gradgradcheck(lambda a, b, c: conv(a, b, c, graph), (x, y, w))


def test_deterministic_repeats_bitwise():
    tp = e3nn_tp(PROBLEMS["nequip-water"])
    conv = Convolution.from_e3nn(tp)
    s, r = torch.randint(0, 20, (150,)), torch.randint(0, 20, (150,))
    graph = ConvGraph(s, r, 20)
    x, y, w = leaves(tp, 20, 150)
    assert torch.equal(conv(x, y, w, graph), conv(x, y, w, graph))


def test_graph_bad_input():
    with pytest.raises(ValueError, match=r"edge indices must be in \[0, num_nodes=3\)"):
        ConvGraph(torch.tensor([0, 3]), torch.tensor([1, 1]), 3)
    with pytest.raises(ValueError, match=r"edge indices must be in"):
        ConvGraph(torch.tensor([0, -1]), torch.tensor([1, 1]), 3)
    with pytest.raises(TypeError, match="int32 or int64"):
        ConvGraph(torch.tensor([0.0]), torch.tensor([1]), 3)
    with pytest.raises(ValueError, match="same length"):
        ConvGraph(torch.tensor([0, 1]), torch.tensor([1]), 3)
    tp = e3nn_tp(PROBLEMS["nequip-water"])
    conv = Convolution.from_e3nn(tp)
    graph = ConvGraph(torch.tensor([0, 1]), torch.tensor([1, 0]), 2)
    x, y, w = leaves(tp, 2, 2)
    with pytest.raises(ValueError, match="x must have 2 rows"):
        conv(x[:1], y, w, graph)
    with pytest.raises(ValueError, match="y must have 2 rows"):
        conv(x, y[:1], w, graph)
    with pytest.raises(TypeError, match="ConvGraph"):
        conv(x, y, w, (0, 1))
