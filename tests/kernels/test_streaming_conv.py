"""The streaming radial convolution (weights made per chunk of edges) against radial MLP + e3nn + index_add."""

import numpy as np
import pytest
import torch
from e3nn import nn as e3nn_nn
from e3nn import o3
from oracles import e3nn_conv
from tp_cases import PROBLEMS, e3nn_tp, rel

from cgforge.kernels import ConvGraph, Convolution, streaming_convolution
from cgforge.kernels.convolution import chunk_ranges


def _mlp(features: int, weight_numel: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    mlp = e3nn_nn.FullyConnectedNet([features, 16, 16, weight_numel], torch.nn.functional.silu)
    return mlp.double().requires_grad_(False)


def _case(problem: str, n: int, e: int, seed: int = 0):
    tp = e3nn_tp(PROBLEMS[problem])
    gen = torch.Generator().manual_seed(seed)
    s, r = torch.randint(0, n, (e,), generator=gen), torch.randint(0, n, (e,), generator=gen)
    s[:3], r[:3] = 0, 0  # a repeated self-edge and a high-degree node
    x = torch.randn(n, tp.irreps_in1.dim, generator=gen, dtype=torch.float64, requires_grad=True)
    y = torch.randn(e, tp.irreps_in2.dim, generator=gen, dtype=torch.float64, requires_grad=True)
    rad = torch.randn(e, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    scale = torch.rand(e, 1, generator=gen, dtype=torch.float64, requires_grad=True)
    return tp, s, r, x, y, rad, scale


def _reference(tp, mlp, s, r, x, y, rad, scale, n):
    w = mlp(rad) * scale
    return e3nn_conv(tp, x, y, w, s, r, n)


@pytest.mark.parametrize("problem,chunk_edges", [("nequip-water", 1), ("nequip-water", 7), ("nequip-water", 10_000),
                                                   ("mace-medium", 16)])
def test_matches_radial_mlp_e3nn_index_add(problem, chunk_edges):
    torch.set_default_dtype(torch.float64)
    n, e = 13, 90
    tp, s, r, x, y, rad, scale = _case(problem, n, e)
    mlp = _mlp(8, tp.weight_numel, seed=1)
    conv = Convolution.from_e3nn(tp)
    graph = ConvGraph(s, r, n)
    out = streaming_convolution(conv, x, y, rad, mlp, graph, chunk_edges, scale=scale)
    ref = _reference(tp, mlp, s, r, x, y, rad, scale, n)
    assert rel(out, ref) < 1e-12
    g = torch.randn_like(ref)
    got = torch.autograd.grad(out, (x, y, rad, scale), g)
    want = torch.autograd.grad(ref, (x, y, rad, scale), g)
    for name, a, b in zip(("x", "y", "radial_in", "scale"), got, want):
        assert rel(a, b) < 1e-11, name


def test_chunk_size_changes_nothing_but_rounding_and_scale_is_optional():
    torch.set_default_dtype(torch.float64)
    n, e = 20, 150
    tp, s, r, x, y, rad, _ = _case("nequip-water", n, e, seed=3)
    mlp = _mlp(8, tp.weight_numel, seed=2)
    conv = Convolution.from_e3nn(tp)
    graph = ConvGraph(s, r, n)
    results = []
    for chunk in (5, e):
        out = streaming_convolution(conv, x, y, rad, mlp, graph, chunk)
        results.append((out, *torch.autograd.grad(out.square().sum(), (x, y, rad))))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            # CPU BLAS blocks by batch size, so FP64 rounding may differ; the CUDA kernels sum each row in
            # the same CSR order whatever the chunk (bitwise, tested on the GPU)
            assert rel(a, b) < 1e-14
    ref = e3nn_conv(tp, x, y, mlp(rad), s, r, n)
    assert rel(results[0][0], ref) < 1e-12


def test_water_graph_forces_chain():
    """A periodic water graph: y and the radial input made from positions, so gradients reach them."""
    from cgforge.plugin.runtime.neighbours import neighbour_list
    from cgforge.plugin.water import water_box

    torch.set_default_dtype(torch.float64)
    atoms = water_box(n_molecules=8)
    pos = torch.tensor(atoms.positions, requires_grad=True)
    s, r, shifts = neighbour_list(pos.detach(), torch.tensor(np.array(atoms.cell)), tuple(atoms.pbc), 3.0)
    tp = e3nn_tp(PROBLEMS["nequip-water"])
    vec = pos[r] - pos[s] + shifts.to(pos.dtype)
    y = o3.spherical_harmonics(tp.irreps_in2, vec, normalize=True)
    length = vec.norm(dim=1, keepdim=True)
    rad = torch.cat([torch.sin(k * length) / length for k in range(1, 9)], dim=1)
    n = len(atoms)
    x = torch.randn(n, tp.irreps_in1.dim, generator=torch.Generator().manual_seed(0))
    mlp = _mlp(8, tp.weight_numel, seed=4)
    conv = Convolution.from_e3nn(tp)
    energy = streaming_convolution(conv, x, y, rad, mlp, ConvGraph(s, r, n), 50).square().sum()
    ref = e3nn_conv(tp, x, y, mlp(rad), s, r, n).square().sum()
    assert rel(energy, ref) < 1e-12
    f, = torch.autograd.grad(energy, pos, retain_graph=True)  # ref shares y and the radial input
    f_ref, = torch.autograd.grad(ref, pos)
    assert rel(f, f_ref) < 1e-11


def test_chunk_ranges_cover_rows_within_budget():
    rowptr = np.cumsum([0, 3, 0, 9, 1, 1, 0, 4])
    ranges = chunk_ranges(rowptr, 4)
    assert ranges[0][0] == 0 and ranges[-1][1] == len(rowptr) - 1
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    for r0, r1 in ranges:  # within the budget, or a single row that alone exceeds it
        assert rowptr[r1] - rowptr[r0] <= 4 or r1 - r0 == 1
    assert chunk_ranges(np.zeros(1, dtype=np.int64), 4) == []
    wide = chunk_ranges(rowptr, 4, min_rows=3)  # rows for parallelism win over the edge budget
    assert all(r1 - r0 >= 3 for r0, r1 in wide[:-1]) and wide[-1][1] == len(rowptr) - 1
    with pytest.raises(ValueError, match="chunk_edges"):
        chunk_ranges(rowptr, 0)


def test_bad_input_is_named():
    torch.set_default_dtype(torch.float64)
    tp, s, r, x, y, rad, scale = _case("nequip-water", 5, 12)
    conv = Convolution.from_e3nn(tp)
    graph = ConvGraph(s, r, 5)
    mlp = _mlp(8, tp.weight_numel, seed=0)
    with pytest.raises(ValueError, match="y must have shape"):
        streaming_convolution(conv, x, y[:-1], rad, mlp, graph, 4)
    with pytest.raises(ValueError, match="scale must have shape"):
        streaming_convolution(conv, x, y, rad, mlp, graph, 4, scale=scale[:, :0])
    with pytest.raises(ValueError, match="chunk_edges"):
        streaming_convolution(conv, x, y, rad, mlp, graph, 0)
    with pytest.raises(ValueError, match="deterministic"):
        streaming_convolution(conv, x, y, rad, mlp, ConvGraph(s, r, 5, deterministic=False), 4)
    with pytest.raises(RuntimeError, match="require"):
        streaming_convolution(conv, x, y, rad, mlp.requires_grad_(True), graph, 4)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cuda_streaming_matches_stored_path_and_is_bitwise_reproducible(dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.set_default_dtype(torch.float64)
    n, e = 300, 6000
    tp, s, r, x, y, rad, scale = _case("mace-medium", n, e, seed=5)
    mlp = _mlp(8, tp.weight_numel, seed=6).to("cuda", dtype)
    conv = Convolution.from_e3nn(tp)
    dev = [t.detach().to("cuda", dtype).requires_grad_() for t in (x, y, rad, scale)]
    graph = ConvGraph(s.cuda(), r.cuda(), n)

    def run(fn):
        out = fn(*dev)
        return (out, *torch.autograd.grad(out.square().sum(), dev))

    stored = run(lambda a, b, c, d: conv(a, b, mlp(c) * d, graph))
    first = run(lambda a, b, c, d: streaming_convolution(conv, a, b, c, mlp, graph, 1000, scale=d, min_rows=16))
    again = run(lambda a, b, c, d: streaming_convolution(conv, a, b, c, mlp, graph, 1000, scale=d, min_rows=16))
    tol = 1e-11 if dtype == torch.float64 else 2e-5
    for a, b, c in zip(first, stored, again):
        assert rel(a, b) < tol
        assert torch.equal(a, c)


def _geometry(lmax_irreps, mlp):
    """edge_fn from edge vectors and lengths: e3nn harmonics, a sine basis with a smooth cutoff, the MLP."""

    def basis(length):
        cut = (1 - (length / 3.0) ** 2).clamp(min=0) ** 2
        return torch.cat([torch.sin(k * length) / length for k in range(1, 9)], dim=1), cut

    def edge_fn(vec, length):
        rad, cut = basis(length)
        return o3.spherical_harmonics(lmax_irreps, vec, normalize=True), mlp(rad) * cut

    return edge_fn


def _geometry_case(seed: int, n: int, e: int):
    """A random graph; node features; edge vectors and their lengths as a separate input, as MACE passes them."""
    torch.set_default_dtype(torch.float64)
    gen = torch.Generator().manual_seed(seed)
    tp = e3nn_tp(PROBLEMS["nequip-water"])
    s, r = torch.randint(0, n, (e,), generator=gen), torch.randint(0, n, (e,), generator=gen)
    x = torch.randn(n, tp.irreps_in1.dim, generator=gen, requires_grad=True)
    vec = (torch.randn(e, 3, generator=gen) * 1.3).requires_grad_()
    length = vec.detach().norm(dim=1, keepdim=True).requires_grad_()
    return gen, tp, s, r, x, vec, length


@pytest.mark.parametrize("chunk_edges", [1, 7, 10_000])
def test_edge_geometry_streams_from_vectors_and_lengths(chunk_edges):
    """Only the vectors and lengths are edge inputs: harmonics, radial basis and weights made per chunk;
    values and gradients (x, vectors, lengths) equal e3nn TP + index_add in FP64."""
    from cgforge.kernels import streaming_edge_convolution

    n = 17
    gen, tp, s, r, x, vec, length = _geometry_case(11, n, 120)
    mlp = _mlp(8, tp.weight_numel, seed=5)
    edge_fn = _geometry(tp.irreps_in2, mlp)
    out = streaming_edge_convolution(Convolution.from_e3nn(tp), x, (vec, length), edge_fn, ConvGraph(s, r, n),
                                     chunk_edges, constants=(mlp,))
    y_ref, w_ref = edge_fn(vec, length)
    ref = e3nn_conv(tp, x, y_ref, w_ref, s, r, n)
    assert rel(out, ref) < 1e-12
    g = torch.randn(ref.shape, generator=gen)
    got = torch.autograd.grad(out, (x, vec, length), g)
    want = torch.autograd.grad(ref, (x, vec, length), g)
    for a, b in zip(got, want, strict=True):
        assert rel(a, b) < 1e-11


def test_edge_convolution_applies_an_affine_row_map_per_chunk():
    """out_fn (here a linear layer with a bias) applied per chunk equals out_fn after the whole convolution,
    values and gradients; its gradient is formed through its vector-Jacobian product at zero rows."""
    from cgforge.kernels import streaming_edge_convolution

    n = 15
    gen, tp, s, r, x, vec, length = _geometry_case(12, n, 100)
    mlp = _mlp(8, tp.weight_numel, seed=7)
    torch.manual_seed(8)
    linear = torch.nn.Linear(tp.irreps_out.dim, 5).double().requires_grad_(False)
    edge_fn = _geometry(tp.irreps_in2, mlp)
    out = streaming_edge_convolution(Convolution.from_e3nn(tp), x, (vec, length), edge_fn, ConvGraph(s, r, n), 9,
                                     constants=(mlp,), out_fn=linear)
    y_ref, w_ref = edge_fn(vec, length)
    ref = linear(e3nn_conv(tp, x, y_ref, w_ref, s, r, n))
    assert out.shape == (n, 5) and rel(out, ref) < 1e-12
    g = torch.randn(ref.shape, generator=gen)
    for a, b in zip(torch.autograd.grad(out, (x, vec, length), g), torch.autograd.grad(ref, (x, vec, length), g),
                    strict=True):
        assert rel(a, b) < 1e-11
    with pytest.raises(TypeError, match="out_fn must be a callable"):
        streaming_edge_convolution(Convolution.from_e3nn(tp), x, (vec, length), edge_fn, ConvGraph(s, r, n), 9,
                                   out_fn=3)


def test_edge_convolution_names_bad_edge_inputs_and_outputs():
    from cgforge.kernels import streaming_edge_convolution
    from cgforge.patches.streaming import EdgeRows

    torch.set_default_dtype(torch.float64)
    tp = e3nn_tp(PROBLEMS["nequip-water"])
    conv = Convolution.from_e3nn(tp)
    s, r = torch.tensor([0, 1, 2]), torch.tensor([1, 2, 0])
    x, vec = torch.randn(3, tp.irreps_in1.dim), torch.randn(3, 3)
    mlp = _mlp(8, tp.weight_numel, seed=6)
    edge_fn = _geometry(tp.irreps_in2, mlp)
    graph = ConvGraph(s, r, 3)
    with pytest.raises(ValueError, match=r"edge_inputs\[1\] must be a tensor with one row per edge"):
        streaming_edge_convolution(conv, x, (vec, vec[:2]), edge_fn, graph, 4)
    with pytest.raises(ValueError, match="edge_fn must return y"):
        streaming_edge_convolution(conv, x, (vec,), lambda v: (v, v), graph, 4)
    with pytest.raises(RuntimeError, match="require grad"):
        streaming_edge_convolution(conv, x, (vec, vec.norm(dim=1, keepdim=True)), edge_fn, graph, 4,
                                   constants=(mlp.requires_grad_(True),))
    deferred = EdgeRows(lambda v: v, (vec,))
    with pytest.raises(AttributeError, match="computed only inside the streaming convolution"):
        deferred.shape  # noqa: B018
    with pytest.raises(TypeError, match=r"one value per edge \(\[E, 1\]\)"):
        deferred * torch.ones(3, 2)


# ---------------------------------------------------------------------------------------------------------------
# Patched MACE models with streaming on


def _mace_case(interaction: str = "RealAgnosticResidualInteractionBlock", first: str | None = None):
    pytest.importorskip("mace")
    from mace_helpers import build_model, evaluate

    from cgforge.patches import mace as pm

    torch.set_default_dtype(torch.float64)
    plain = build_model(interaction=interaction, first=first)
    ref = evaluate(plain, _water_pair())
    patched = pm.patch(build_model(interaction=interaction, first=first))
    patched.requires_grad_(False)
    return pm, patched, ref, evaluate


def _water_pair():
    from mace_helpers import water_dimer

    return water_dimer()


@pytest.mark.parametrize("chunk_edges", [3, 1000])
def test_mace_streaming_equals_plain_model(chunk_edges):
    from mace_helpers import assert_same_outputs

    from cgforge.patches.mace.adapter import inert_beyond_cutoff
    from cgforge.patches.mace.streaming import AppliedLinear, DeferredRadialEmbedding, DeferredSphericalHarmonics

    pm, patched, ref, evaluate = _mace_case(first="RealAgnosticInteractionBlock")
    keys = list(patched.state_dict())
    inert = inert_beyond_cutoff(patched)
    harmonics = patched.spherical_harmonics  # the patch's (cgforge's kernel, by default)
    assert pm.set_streaming(patched, chunk_edges) == 2
    # every block streams: the harmonics and the radial embedding are deferred into the convolutions too
    assert isinstance(patched.spherical_harmonics, DeferredSphericalHarmonics)
    assert isinstance(patched.radial_embedding, DeferredRadialEmbedding)
    # and each block's linear after the convolution runs inside it; an untagged message is refused
    assert all(isinstance(b.linear, AppliedLinear) for b in patched.interactions)
    with pytest.raises(RuntimeError, match="applies its linear layer itself"):
        patched.interactions[0].linear(torch.zeros(2, 3))
    assert inert_beyond_cutoff(patched) == inert  # the analysis sees through the deferred MLP
    assert list(patched.state_dict()) == keys  # the stand-in adopts the MLP's parameters under their names
    assert_same_outputs(evaluate(patched, _water_pair()), ref, tol=1e-11)
    assert pm.set_streaming(patched, None) == 0
    assert patched.spherical_harmonics is harmonics
    assert type(patched.radial_embedding).__name__ == "RadialEmbeddingBlock"
    assert not any(isinstance(b.linear, AppliedLinear) or b.conv_tp.fused_linear for b in patched.interactions)
    assert_same_outputs(evaluate(patched, _water_pair()), ref, tol=1e-11)


def test_mace_streaming_unpatch_restores_plain_modules():
    from cgforge.patches.streaming import DeferredRadial

    pm, patched, ref, evaluate = _mace_case()
    pm.set_streaming(patched, 5)
    assert any(isinstance(m, DeferredRadial) for m in patched.modules())
    pm.unpatch(patched)
    assert not any(type(m).__module__.startswith("cgforge") for m in patched.modules())
    out = evaluate(patched, _water_pair())
    assert np.allclose(out["forces"], ref["forces"], rtol=0, atol=1e-12)


def test_mace_streaming_leaves_unsupported_blocks_on_the_stored_path_and_checks_arguments():
    pm, patched, ref, evaluate = _mace_case(interaction="RealAgnosticDensityInteractionBlock")
    harmonics = patched.spherical_harmonics
    assert pm.set_streaming(patched, 8) == 0
    # the density blocks read edge_feats themselves: the geometry stays stored
    assert patched.spherical_harmonics is harmonics
    assert type(patched.radial_embedding).__name__ == "RadialEmbeddingBlock"
    with pytest.raises(ValueError, match="chunk_edges"):
        pm.set_streaming(patched, 0)
    with pytest.raises(TypeError, match="MACE"):
        pm.set_streaming(torch.nn.Linear(2, 2), 8)


def test_streaming_options_leave_the_cuda_graph_choice_alone():
    pytest.importorskip("mace")
    from cgforge.plugin import Calculator

    for streaming in (None, False):  # only streaming=True turns the CUDA graph off
        with pytest.raises(ValueError, match="cuda_graph=True needs a CUDA device"):
            Calculator("mace", device="cpu", patch=True, streaming=streaming, cuda_graph=True, warmup=False)


@pytest.mark.slow
def test_calculator_streaming_equals_stored_path_and_checks_its_arguments():
    pytest.importorskip("mace")
    from cgforge.plugin import Calculator
    from cgforge.plugin.water import water_box

    torch.set_default_dtype(torch.float64)
    atoms = water_box(n_molecules=8)
    stored = Calculator("mace", device="cpu", dtype="float64", patch=True, streaming=False)
    streamed = Calculator("mace", device="cpu", dtype="float64", patch=True, streaming=True)
    assert streamed.streaming and not stored.streaming
    e0, f0 = stored.get_potential_energy(atoms), stored.get_forces(atoms)
    a = atoms.copy()
    e1, f1 = streamed.get_potential_energy(a), streamed.get_forces(a)
    assert abs(e1 - e0) < 1e-10 * abs(e0)
    assert np.abs(f1 - f0).max() < 1e-10
    with pytest.raises(TypeError, match="streaming"):
        Calculator("mace", device="cpu", streaming="yes", warmup=False)
    with pytest.raises(ValueError, match="cuda_graph=True and streaming=True"):
        Calculator("mace", device="cpu", patch=True, streaming=True, cuda_graph=True, warmup=False)
    with pytest.raises(ValueError, match="patch=True"):
        Calculator("mace", device="cpu", streaming=True, warmup=False)  # the CPU default runs MACE's own code


@pytest.mark.slow
def test_calculator_retries_streaming_when_the_stored_path_runs_out_of_memory(monkeypatch):
    pytest.importorskip("mace")
    from cgforge.plugin import Calculator
    from cgforge.plugin.water import water_box

    torch.set_default_dtype(torch.float64)
    atoms = water_box(n_molecules=8)
    calc = Calculator("mace", device="cpu", dtype="float64", patch=True, warmup=False)
    assert not calc.streaming
    reference = calc.get_forces(atoms.copy())
    run, calls = calc.step.run, []

    def out_of_memory_once(*args, **kwargs):
        calls.append(calc.streaming)
        if len(calls) == 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return run(*args, **kwargs)

    monkeypatch.setattr(calc.step, "run", out_of_memory_once)
    a = atoms.copy()
    a.positions[0, 0] += 1e-3
    with pytest.warns(UserWarning, match="streaming edges from now on"):
        forces = calc.get_forces(a)
    assert calls == [False, True] and calc.streaming
    assert np.abs(forces - Calculator("mace", device="cpu", dtype="float64", patch=True, warmup=False,
                                      streaming=False).get_forces(a)).max() < 1e-10
    assert np.abs(forces - reference).max() > 0  # the displaced structure, not a cached result
    streaming_off = Calculator("mace", device="cpu", dtype="float64", patch=True, warmup=False, streaming=False)
    monkeypatch.setattr(streaming_off.step, "run", lambda *a, **k: (_ for _ in ()).throw(
        torch.cuda.OutOfMemoryError("simulated")))
    with pytest.raises(torch.cuda.OutOfMemoryError):  # streaming=False: the user's choice stands
        streaming_off.get_forces(atoms.copy())


@pytest.mark.slow
def test_nequip_calculator_streaming_equals_stored_path():
    pytest.importorskip("nequip")
    from cgforge.plugin import Calculator
    from cgforge.plugin.water import water_box

    atoms = water_box(n_molecules=8)
    stored = Calculator("nequip", device="cpu", patch=True, streaming=False)
    streamed = Calculator("nequip", device="cpu", patch=True, streaming=True)
    assert streamed.streaming and streamed.inert_edges_reason == stored.inert_edges_reason
    e0, f0 = stored.get_potential_energy(atoms), stored.get_forces(atoms)
    a = atoms.copy()
    e1, f1 = streamed.get_potential_energy(a), streamed.get_forces(a)
    # the bundled model computes in FP32 (its model_dtype) with FP64 positions: FP32 rounding of a different order
    model_dtype = next(streamed.model.parameters()).dtype
    tol = 1e-10 if model_dtype == torch.float64 else 1e-5
    assert abs(e1 - e0) <= tol * max(abs(e0), 1.0)
    assert np.abs(f1 - f0).max() <= tol * max(np.abs(f0).max(), 1.0)
    from cgforge.patches import unpatch

    unpatch(streamed.model)
    assert not any(type(m).__module__.startswith("cgforge") for m in streamed.model.modules())
