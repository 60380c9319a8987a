"""Property tests over random tensor-product problems (tests/problem_strategies.py) against e3nn in FP64.

CPU: the problem description (normalisation), the torch CPU path (forward, backward, double backward),
the schedule's CPU interpreter at several chunk sizes per direction, and the fused convolution's CPU path;
plus one problem holding every CG triple (l1, l2, l3) up to l = 6, which random draws may miss. NVRTC: the
generated source of a few random problems compiles (CPU machine, NVRTC wheel). CUDA (marked): the
generated tensor-product and convolution kernels on the same random problems, FP64 and FP32.

Examples are derandomized (see problem_strategies.hypothesis_settings): a failure prints the problem
and a `@reproduce_failure` blob, and the same examples run on every machine.
"""

from __future__ import annotations

import math
import os
from unittest import mock

import pytest
import torch
from e3nn import o3
from hypothesis import given
from hypothesis import strategies as st
from oracles import e3nn_conv
from problem_strategies import (
    MAX_L,
    RandomProblem,
    hypothesis_settings,
    problems,
    random_inputs,
    rel,
    seed_decorator,
)

from cgforge.kernels import ConvGraph, Convolution, TPProblem
from cgforge.kernels.tensor_product.evaluate import run_backward, run_forward
from cgforge.kernels.tensor_product.schedule import build_schedule

FP64_TOL = 1e-12
seeds = st.integers(0, 2**31 - 1)


def _grad_out(shape, seed: int, dtype=torch.float64, device="cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + 1)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype=dtype, device=device)


def _grads(out, inputs, g, **kwargs):
    """Gradients of <out, g>; zeros for an input the output does not depend on (an empty weight, say)."""
    return torch.autograd.grad(out, inputs, g, allow_unused=True, materialize_grads=True, **kwargs)


def _assert_close(got, want, tol: float, what: str) -> None:
    err = rel(got, want)
    assert err < tol, f"{what}: relative error {err:.3g} >= {tol:g}"


def _assert_same_problem(ours: TPProblem, theirs: TPProblem) -> None:
    """Same irreps, paths and weight layout; path weights (all normalisation folded in) equal to round-off."""
    assert (ours.irreps_in1, ours.irreps_in2, ours.irreps_out) == (theirs.irreps_in1, theirs.irreps_in2,
                                                                    theirs.irreps_out)
    assert ours.shared_weights == theirs.shared_weights and ours.weight_numel == theirs.weight_numel
    assert len(ours.instructions) == len(theirs.instructions)
    for k, (a, b) in enumerate(zip(ours.instructions, theirs.instructions)):
        assert (a.i_in1, a.i_in2, a.i_out, a.mode, a.has_weight, a.path_shape) == (
            b.i_in1, b.i_in2, b.i_out, b.mode, b.has_weight, b.path_shape), f"instruction {k}"
        assert math.isclose(a.path_weight, b.path_weight, rel_tol=1e-13), (
            f"instruction {k}: path weight {a.path_weight!r}, e3nn has {b.path_weight!r}")


# ------------------------------------------------------------------------------------------ CPU


@seed_decorator()
@hypothesis_settings(150)
@given(problem=problems(), batch=st.integers(1, 4), seed=seeds, chunk=st.sampled_from([32, 64, 128]),
       chunk_bwd=st.sampled_from([32, 64, 128]))
@pytest.mark.slow  # > 10 s on a CPU: the full tier (CI) runs it
def test_cpu_path_and_schedule_interpreter_match_e3nn(problem, batch, seed, chunk, chunk_bwd):
    tp = problem.e3nn()
    ours = problem.cgforge()
    _assert_same_problem(ours.problem, TPProblem.from_e3nn(tp))
    x, y, w = random_inputs(problem, batch, seed)
    ref = tp(x, y, w)
    g = _grad_out(ref.shape, seed)
    ref_grads = _grads(ref, (x, y, w), g)

    out = ours(x, y, w)
    _assert_close(out, ref, FP64_TOL, "CPU path forward")
    for name, a, b in zip(("x", "y", "weight"), _grads(out, (x, y, w), g), ref_grads):
        _assert_close(a, b, FP64_TOL, f"CPU path grad {name}")

    schedule = build_schedule(ours.problem, itemsize=8, max_chunk=chunk, max_chunk_backward=chunk_bwd)
    xd, yd, wd = x.detach(), y.detach(), w.detach()
    _assert_close(run_forward(schedule, xd, yd, wd), ref, FP64_TOL, f"interpreter forward (chunk {chunk})")
    for name, a, b in zip(("x", "y", "weight"), run_backward(schedule, xd, yd, wd, g), ref_grads):
        _assert_close(a, b, FP64_TOL, f"interpreter grad {name} (backward chunk {chunk_bwd})")


def every_cg_triple(max_l: int = MAX_L) -> RandomProblem:
    """One problem with a uvu path for every (l1, l2, l3) with l <= max_l, each into its own output: random
    problems may miss the one triple whose coefficients are wrong; this one misses none."""
    in1 = o3.Irreps([(3, (l, (-1) ** l)) for l in range(max_l + 1)])
    in2 = o3.Irreps([(1, (l, 1 if l % 3 else -1)) for l in range(max_l + 1)])  # both parities per l overall
    outputs, instructions = [], []
    for a, (_, ir1) in enumerate(in1):
        for b, (_, ir2) in enumerate(in2):
            for l3 in range(abs(ir1.l - ir2.l), min(ir1.l + ir2.l, max_l) + 1):
                instructions.append((a, b, len(outputs), "uvu", True))
                outputs.append((3, (l3, ir1.p * ir2.p)))
    return RandomProblem(in1, in2, o3.Irreps(outputs), tuple(instructions), False, "component", "element")


def test_every_cg_triple_up_to_l6_matches_e3nn():
    problem = every_cg_triple()
    assert len(problem.instructions) > 150
    tp, ours = problem.e3nn(), problem.cgforge()
    x, y, w = random_inputs(problem, 2, seed=0)
    ref = tp(x, y, w)
    g = _grad_out(ref.shape, 0)
    ref_grads = _grads(ref, (x, y, w), g)
    out = ours(x, y, w)
    _assert_close(out, ref, FP64_TOL, "CPU path forward")
    for name, a, b in zip(("x", "y", "weight"), _grads(out, (x, y, w), g), ref_grads):
        _assert_close(a, b, FP64_TOL, f"CPU path grad {name}")
    schedule = build_schedule(ours.problem, itemsize=8)
    xd, yd, wd = x.detach(), y.detach(), w.detach()
    _assert_close(run_forward(schedule, xd, yd, wd), ref, FP64_TOL, "interpreter forward")
    for name, a, b in zip(("x", "y", "weight"), run_backward(schedule, xd, yd, wd, g), ref_grads):
        _assert_close(a, b, FP64_TOL, f"interpreter grad {name}")


@seed_decorator()
@hypothesis_settings(40)
@given(problem=problems(max_mul=40, max_paths=3), batch=st.integers(1, 3), seed=seeds)
@pytest.mark.slow
def test_cpu_path_double_backward_matches_e3nn(problem, batch, seed):
    """The second derivatives (forces in a training loss, force Jacobians) go through the double-backward
    formulas of ops.py: a loss of all three first derivatives, differentiated again."""
    tp, ours = problem.e3nn(), problem.cgforge()
    x, y, w = random_inputs(problem, batch, seed)
    g = _grad_out((batch, tp.irreps_out.dim), seed)

    def second(module):
        gx, gy, gw = _grads(module(x, y, w), (x, y, w), g, create_graph=True)
        loss = gx.square().sum() + (gy * y).sum() + gw.sin().sum()
        return torch.autograd.grad(loss, (x, y, w), allow_unused=True, materialize_grads=True)

    for name, a, b in zip(("x", "y", "weight"), second(ours), second(tp)):
        _assert_close(a, b, 1e-11, f"double backward, d/d{name}")


@st.composite
def graphs(draw, max_nodes: int = 6, max_edges: int = 14):
    n = draw(st.integers(1, max_nodes))
    e = draw(st.integers(0, max_edges))
    s = draw(st.lists(st.integers(0, n - 1), min_size=e, max_size=e))
    r = draw(st.lists(st.integers(0, n - 1), min_size=e, max_size=e))
    return n, torch.tensor(s, dtype=torch.int64), torch.tensor(r, dtype=torch.int64)


def _conv_inputs(problem, n, e, seed, dtype=torch.float64, device="cpu"):
    x, _, _ = random_inputs(problem, n, seed, dtype, device)
    _, y, w = random_inputs(problem, e, seed + 7, dtype, device)
    return x, y, w


@seed_decorator()
@hypothesis_settings(60)
@given(problem=problems(max_mul=70, max_paths=3), graph=graphs(), deterministic=st.booleans(), seed=seeds)
@pytest.mark.slow
def test_convolution_cpu_path_matches_e3nn(problem, graph, deterministic, seed):
    n, s, r = graph
    tp = problem.e3nn()
    conv = Convolution(*problem.args())
    x, y, w = _conv_inputs(problem, n, s.shape[0], seed)
    ref = e3nn_conv(tp, x, y, w, s, r, n)
    out = conv(x, y, w, ConvGraph(s, r, n, deterministic=deterministic))
    _assert_close(out, ref, FP64_TOL, "forward")
    g = _grad_out(ref.shape, seed)
    for name, a, b in zip(("x", "y", "weight"), _grads(out, (x, y, w), g),
                          _grads(ref, (x, y, w), g)):
        _assert_close(a, b, FP64_TOL, f"grad {name}")


# ------------------------------------------------------------------------------------- NVRTC

def _nvrtc_available() -> bool:
    from cgforge.kernels.core.compiler import nvrtc_available

    return nvrtc_available()


@pytest.mark.skipif(not _nvrtc_available(), reason="NVRTC library not installed")
@seed_decorator()
@hypothesis_settings(8)
@given(problem=problems(max_paths=3), scalar=st.sampled_from(["float", "double"]),
       conv=st.booleans())
@pytest.mark.slow  # > 10 s on a CPU: the full tier (CI) runs it
def test_generated_source_compiles_with_nvrtc(problem, scalar, conv):
    """Random problems render to CUDA that NVRTC accepts, forward and backward, with a ptxas report.
    Compiled for real: no disk cache (random kernels would only litter it), no earlier in-memory hit."""
    from cgforge.kernels.core import compiler
    from cgforge.kernels.tensor_product.codegen import render
    from cgforge.kernels.tensor_product.layout import Layout

    compiler.clear_memory_cache()
    schedule = build_schedule(problem.cgforge().problem, itemsize=4 if scalar == "float" else 8)
    layouts = ((Layout(csr=True, perm=True, xidx=True), Layout(csr=True, perm=True, gidx=True)) if conv
               else (Layout(), Layout()))
    for layout, backward in zip(layouts, (False, True)):
        source, base = render(schedule, scalar, layout, forward=not backward, backward=backward)
        fn = f"{base}_{'backward' if backward else 'forward'}"
        with mock.patch.dict(os.environ, {"CGFORGE_CACHE_DISABLE": "1"}):
            result = compiler.compile_cubin(source, arch="sm_90", name=f"{fn}.cu")
        assert result.cubin[:4] == b"\x7fELF"
        assert 0 < result.resources(fn).registers <= 255


# -------------------------------------------------------------------------------------- CUDA
# The same strategies, the generated kernels. FP64 to 1e-11 (the kernels sum in another order than
# e3nn), FP32 to 1e-5 forward and 1e-4 backward, relative to the FP64 e3nn result.

CUDA_TOL = {torch.float64: (1e-11, 1e-11), torch.float32: (1e-5, 1e-4)}
dtypes = st.sampled_from([torch.float64, torch.float32])


@pytest.mark.cuda
@seed_decorator()
@hypothesis_settings(40)
@given(problem=problems(), batch=st.sampled_from([1, 2, 5, 33, 130]), dtype=dtypes, seed=seeds)
def test_generated_tp_kernels_match_e3nn(problem, batch, dtype, seed):
    tp = problem.e3nn(device="cuda")
    ours = problem.cgforge()
    x, y, w = random_inputs(problem, batch, seed, device="cuda")
    ref = tp(x, y, w)
    g = _grad_out(ref.shape, seed, device="cuda")
    ref_grads = _grads(ref, (x, y, w), g)
    xs, ys, ws = (t.detach().to(dtype).requires_grad_() for t in (x, y, w))
    out = ours(xs, ys, ws)
    fwd_tol, bwd_tol = CUDA_TOL[dtype]
    _assert_close(out, ref, fwd_tol, f"forward {dtype}")
    for name, a, b in zip(("x", "y", "weight"), _grads(out, (xs, ys, ws), g.to(dtype)), ref_grads):
        _assert_close(a, b, bwd_tol, f"grad {name} {dtype}")


@pytest.mark.cuda
def test_generated_kernels_every_cg_triple_up_to_l6():
    """FP64 only: NVRTC takes ~1 min per dtype for these 175 paths (forward and backward)."""
    dtype = torch.float64
    problem = every_cg_triple()
    tp, ours = problem.e3nn(device="cuda"), problem.cgforge()
    x, y, w = random_inputs(problem, 37, seed=0, device="cuda")
    ref = tp(x, y, w)
    g = _grad_out(ref.shape, 0, device="cuda")
    ref_grads = _grads(ref, (x, y, w), g)
    xs, ys, ws = (t.detach().to(dtype).requires_grad_() for t in (x, y, w))
    out = ours(xs, ys, ws)
    fwd_tol, bwd_tol = CUDA_TOL[dtype]
    _assert_close(out, ref, fwd_tol, f"forward {dtype}")
    for name, a, b in zip(("x", "y", "weight"), _grads(out, (xs, ys, ws), g.to(dtype)), ref_grads):
        _assert_close(a, b, bwd_tol, f"grad {name} {dtype}")


@pytest.mark.cuda
@seed_decorator()
@hypothesis_settings(25)
@given(problem=problems(max_paths=3), graph=graphs(max_nodes=40, max_edges=200), deterministic=st.booleans(),
       dtype=dtypes, seed=seeds)
def test_generated_conv_kernels_match_e3nn(problem, graph, deterministic, dtype, seed):
    n, s, r = graph
    s, r = s.cuda(), r.cuda()
    tp = problem.e3nn(device="cuda")
    conv = Convolution(*problem.args())
    x, y, w = _conv_inputs(problem, n, s.shape[0], seed, device="cuda")
    ref = e3nn_conv(tp, x, y, w, s, r, n)
    g = _grad_out(ref.shape, seed, device="cuda")
    ref_grads = _grads(ref, (x, y, w), g)
    xs, ys, ws = (t.detach().to(dtype).requires_grad_() for t in (x, y, w))
    out = conv(xs, ys, ws, ConvGraph(s, r, n, deterministic=deterministic))
    fwd_tol, bwd_tol = CUDA_TOL[dtype]
    _assert_close(out, ref, fwd_tol * 10, f"forward {dtype}")
    for name, a, b in zip(("x", "y", "weight"), _grads(out, (xs, ys, ws), g.to(dtype)), ref_grads):
        _assert_close(a, b, bwd_tol * 10, f"grad {name} {dtype}")
