"""MACE adapter: patched models give e3nn's energies, forces and stress; patching is safe and reversible."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from mace_helpers import MP_SHAPES, assert_same_outputs, build_model, evaluate, water_dimer

from cgforge import kernels
from cgforge.patches import mace as pm

cuda = pytest.mark.cuda
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _patched_copy(model: torch.nn.Module) -> torch.nn.Module:
    return pm.patch(copy.deepcopy(model))


@pytest.mark.parametrize("interaction", [  # 3-5 s a block on 2 cores: the fast tier runs the plain one
    block if block == "RealAgnosticInteractionBlock" else pytest.param(block, marks=pytest.mark.slow)
    for block in pm.SUPPORTED_INTERACTIONS])
def test_every_interaction_block_matches_e3nn_fp64(interaction: str) -> None:
    model = build_model(interaction=interaction, hidden="8x0e+8x1o+8x2e", max_ell=2)
    ref = evaluate(model, water_dimer())
    patched = _patched_copy(model)
    assert all(isinstance(b.conv_tp, pm.FusedConvTP) for b in patched.interactions)
    assert all(b.conv_fusion == "cgforge" for b in patched.interactions)
    assert_same_outputs(evaluate(patched, water_dimer()), ref, tol=1e-10)


@pytest.mark.slow  # > 10 s on a CPU: the full tier (CI) runs it
@pytest.mark.parametrize("size", sorted(MP_SHAPES))
def test_mace_mp_shapes_match_e3nn_fp64(size: str) -> None:
    model = build_model(
        interaction="RealAgnosticResidualInteractionBlock",
        first="RealAgnosticInteractionBlock",
        hidden=MP_SHAPES[size],
        max_ell=3,
        correlation=3,
        r_max=5.0,
        radial_mlp=[64, 64, 64],
    )
    ref = evaluate(model, water_dimer())
    assert_same_outputs(evaluate(_patched_copy(model), water_dimer()), ref, tol=1e-10)


def test_fp32_matches_e3nn() -> None:
    model = build_model(dtype=torch.float32)
    ref = evaluate(model, water_dimer())
    assert_same_outputs(evaluate(_patched_copy(model), water_dimer()), ref, tol=1e-5)


def test_fused_path_runs_and_builds_one_graph_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    built = []

    class CountingGraph(kernels.ConvGraph):
        def __init__(self, *args, **kwargs):
            built.append(args[2])
            super().__init__(*args, **kwargs)

    model = pm.patch(build_model(num_interactions=3))  # (its self-checks build graphs of their own)
    monkeypatch.setattr(kernels, "ConvGraph", CountingGraph)
    evaluate(model, water_dimer())
    assert built == [6], "one ConvGraph for the 3 interaction blocks of one call"
    evaluate(model, water_dimer(shift=0.1))
    assert built == [6, 6], "a new call gets a new graph"


def test_graph_cache_rebuilds_after_in_place_change() -> None:
    cache = pm.GraphCache()
    edge_index = torch.tensor([[0, 1, 2], [1, 2, 0]])
    g1 = cache.get(edge_index, 3)
    assert cache.get(edge_index, 3) is g1
    assert cache.get(edge_index.clone(), 3) is not g1, "another tensor, another graph"
    g2 = cache.get(edge_index, 3)
    edge_index[1, 0] = 2
    g3 = cache.get(edge_index, 3)
    assert g3 is not g2 and g3.receiver[0].item() == 2
    assert cache.get(edge_index, 4) is not g3, "another node count, another graph"
    assert pickle.loads(pickle.dumps(cache))._graph is None, "graphs are not pickled"


def test_patch_is_in_place_and_idempotent() -> None:
    model = build_model()
    assert pm.patch(model) is model
    fused = [b.conv_tp for b in model.interactions]
    hooks = len(model._forward_pre_hooks)
    pm.patch(model)
    assert [b.conv_tp for b in model.interactions] == fused
    assert len(model._forward_pre_hooks) == hooks == 1
    assert len({id(f.graphs) for f in fused}) == 1, "one graph cache shared by all blocks"


@pytest.mark.smoke
def test_state_dict_is_unchanged_and_loads_both_ways() -> None:
    plain = build_model()
    patched = _patched_copy(plain)
    sd_plain, sd_patched = plain.state_dict(), patched.state_dict()
    assert list(sd_plain) == list(sd_patched)
    for key, value in sd_plain.items():
        assert torch.equal(value, sd_patched[key]), key
    other = pm.patch(_scrambled(build_model()))
    other.load_state_dict(sd_plain, strict=True)
    assert_same_outputs(evaluate(other, water_dimer()), evaluate(plain, water_dimer()), tol=1e-10)
    other_plain = _scrambled(build_model())
    other_plain.load_state_dict(sd_patched, strict=True)
    assert_same_outputs(evaluate(other_plain, water_dimer()), evaluate(plain, water_dimer()), tol=1e-10)


def _scrambled(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-0.7).add_(0.1)
    return model


@pytest.mark.smoke
def test_unpatch_restores_a_plain_mace_model() -> None:
    plain = build_model()
    ref = evaluate(plain, water_dimer())
    model = pm.unpatch(_patched_copy(plain))
    assert not pm.is_patched(model)
    assert all(type(b.conv_tp).__module__.startswith("e3nn.") for b in model.interactions)
    assert not any(hasattr(b, "conv_fusion") for b in model.interactions)
    assert len(model._forward_pre_hooks) == 0
    buf = io.BytesIO()
    torch.save(model, buf)
    assert b"cgforge" not in buf.getvalue(), "the unpatched pickle must not refer to cgforge"
    assert_same_outputs(evaluate(model, water_dimer()), ref, tol=1e-12)


def test_not_a_mace_model_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="expected a MACE model"):
        pm.patch(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="state_dict"):
        pm.patch({"model": {}, "optimizer": {}})


def test_unsupported_block_is_refused_and_nothing_changes() -> None:
    class HomeMadeInteraction(torch.nn.Module):
        conv_tp = None

    model = build_model(num_interactions=3)
    model.interactions[2] = HomeMadeInteraction()
    before = [b.conv_tp for b in model.interactions]
    with pytest.raises(pm.UnsupportedModelError, match="interactions.2.*HomeMadeInteraction.*not supported"):
        pm.patch(model)
    assert [b.conv_tp for b in model.interactions] == before
    assert not any(hasattr(b, "conv_fusion") for b in model.interactions)
    assert len(model._forward_pre_hooks) == 0


def test_other_fused_backend_is_refused() -> None:
    model = build_model()
    model.interactions[1].conv_fusion = "atomic"  # what an OpenEquivariance model looks like
    with pytest.raises(pm.UnsupportedModelError, match="another fused convolution"):
        pm.patch(model)
    assert not isinstance(model.interactions[0].conv_tp, pm.FusedConvTP)


def test_convolution_the_kernels_cannot_build_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(tp, **options):
        raise ValueError("connection mode 'uuu' not supported")

    monkeypatch.setattr(kernels.Convolution, "from_e3nn", staticmethod(refuse))
    model = build_model()
    with pytest.raises(pm.UnsupportedModelError, match="interactions.0.conv_tp.*uuu"):
        pm.patch(model)
    assert not pm.is_patched(model)


@pytest.mark.slow
def test_deepcopy_and_pickle_of_a_patched_model_run() -> None:
    plain = build_model()
    ref = evaluate(plain, water_dimer())
    patched = _patched_copy(plain)
    evaluate(patched, water_dimer())  # fill the graph cache before copying
    buf = io.BytesIO()
    torch.save(patched, buf)
    buf.seek(0)
    for model in (copy.deepcopy(patched), torch.load(buf, weights_only=False)):
        caches = {id(b.conv_tp.graphs) for b in model.interactions}
        assert len(caches) == 1 and model._forward_pre_hooks
        assert next(iter(model._forward_pre_hooks.values())) is model.interactions[0].conv_tp.graphs
        assert_same_outputs(evaluate(model, water_dimer()), ref, tol=1e-10)


@cuda
@needs_gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("interaction", pm.SUPPORTED_INTERACTIONS)
def test_gpu_matches_e3nn(interaction: str, dtype: torch.dtype, tol: float) -> None:
    model = build_model(interaction=interaction, hidden="16x0e+16x1o+16x2e", max_ell=3, dtype=dtype).cuda()
    ref = evaluate(model, water_dimer(), device="cuda")
    patched = _patched_copy(model)
    assert_same_outputs(evaluate(patched, water_dimer(), device="cuda"), ref, tol=tol)


@cuda
@needs_gpu
@pytest.mark.parametrize("size", sorted(MP_SHAPES))
def test_gpu_mace_mp_shapes_match_e3nn(size: str) -> None:
    model = build_model(
        interaction="RealAgnosticResidualInteractionBlock", first="RealAgnosticInteractionBlock",
        hidden=MP_SHAPES[size], max_ell=3, correlation=3, r_max=5.0, radial_mlp=[64, 64, 64],
    ).cuda()
    ref = evaluate(model, water_dimer(), device="cuda")
    assert_same_outputs(evaluate(_patched_copy(model), water_dimer(), device="cuda"), ref, tol=1e-10)


def _exact_constants(model: torch.nn.Module) -> int:
    """Put exact float64 values into the constants a MACE model built in float32 carries rounded: e3nn's
    Wigner 3j values in its generated TensorProduct modules (buffers ``_w3j_l1_l2_l3``) and the symmetric
    contractions' U tensors (from their definition); returns how many tensors changed."""
    from e3nn import o3

    from cgforge.patches.mace.symmetric_contraction import mace_u_matrices

    changed = 0

    def put(buf: torch.Tensor, exact: torch.Tensor) -> None:
        nonlocal changed
        exact = exact.to(buf).reshape(buf.shape)
        changed += int(not torch.equal(exact, buf))
        buf.copy_(exact)

    for module in model.modules():
        for name, buf in list(module.named_buffers(recurse=False)):
            if name.startswith("_w3j_"):
                put(buf, o3.wigner_3j(*(int(v) for v in name.split("_")[2:5]), dtype=torch.float64))
        contractions = getattr(module, "contractions", None)
        if hasattr(module, "irreps_out") and isinstance(contractions, torch.nn.ModuleList):
            coupling = str(o3.Irreps([ir for _, ir in o3.Irreps(module.irreps_in)]))
            for c, (_, ir_out) in zip(contractions, o3.Irreps(module.irreps_out)):
                for nu in range(1, int(c.correlation) + 1):
                    put(getattr(c, f"U_matrix_{nu}"),
                        torch.as_tensor(mace_u_matrices(coupling, str(ir_out), nu), dtype=torch.float64))
            if callable(getattr(module, "_build", None)):
                module._build(only_if_changed=True)  # cgforge's contraction plans from the U it holds
    return changed


@pytest.mark.slow
def test_fp64_difference_from_the_bundled_model_is_its_fp32_constants() -> None:
    """The bundled MACE model was built in float32: its e3nn TensorProducts carry Clebsch-Gordan values and its
    symmetric contractions U tensors rounded to float32, and cast to float64 they stay rounded. cgforge's
    kernels use exact CG values and an exact coupling basis fitted to U, so in FP64 they differ from the
    model's own code by ~1e-9 relative (seen by the LAMMPS Kokkos check on the H100). With exact constants in
    both models, the unpatched model equals the patched one to 1e-12: the constants are the whole difference."""
    from cgforge.plugin import Calculator
    from cgforge.plugin.water import water_box

    torch.set_default_dtype(torch.float64)
    atoms = water_box(32, seed=0)

    def energy_forces(calc: Calculator) -> tuple[float, torch.Tensor]:
        a = atoms.copy()
        a.calc = calc
        return a.get_potential_energy(), torch.as_tensor(a.get_forces())

    def rel(a: tuple[float, torch.Tensor], b: tuple[float, torch.Tensor]) -> tuple[float, float]:
        return abs(a[0] - b[0]) / abs(b[0]), float((a[1] - b[1]).norm() / b[1].norm())

    plain, patched = (Calculator("mace", device="cpu", dtype="float64", patch=p) for p in (False, True))
    before = rel(energy_forces(plain), energy_forces(patched))
    assert min(before) > 1e-11, before  # the difference this test explains
    for calc in (plain, patched):
        assert _exact_constants(calc.adapter.model) > 0  # the model did carry rounded values
        calc.reset()  # ASE's cache would hand back the results of the same positions
    after = rel(energy_forces(plain), energy_forces(patched))
    assert max(after) < 1e-12, after
