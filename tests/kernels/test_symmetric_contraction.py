"""cgforge's SymmetricContraction against MACE's own (mace-torch 0.3.16), its schedule, program and kernels."""

from __future__ import annotations

import copy
import io
from functools import cache

import numpy as np
import pytest
import torch
from e3nn import o3
from mace.modules.symmetric_contraction import SymmetricContraction as MaceSC
from mace_helpers import MP_SHAPES, assert_same_outputs, build_model, evaluate, water_dimer

from cgforge.kernels.core.compiler import compile_cubin, nvrtc_available
from cgforge.kernels.core.ir import evaluate as run_program
from cgforge.kernels.symmetric_contraction import ops as sc_ops
from cgforge.kernels.symmetric_contraction.codegen import render
from cgforge.kernels.symmetric_contraction.program import backward_program, forward_program
from cgforge.kernels.symmetric_contraction.reference import interpret_sc, reference_sc
from cgforge.kernels.symmetric_contraction.schedule import build_sc_schedule
from cgforge.patches import mace as pm
from cgforge.patches.mace.symmetric_contraction import SymmetricContraction, mace_problem, mace_u_matrices

cuda = pytest.mark.cuda
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

HIDDEN_IN = "0e+1o+2e+3o"  # node features of a max_ell 3 model, per channel
OUT = {"small": "0e", "medium": "0e+1o", "large": "0e+1o+2e"}  # product outputs of MACE-MP shapes
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def irreps(channels: int, irs: str) -> o3.Irreps:
    return o3.Irreps("+".join(f"{channels}x{ir}" for ir in irs.split("+")))


class default_dtype:
    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def __enter__(self):
        self.previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)

    def __exit__(self, *exc):
        torch.set_default_dtype(self.previous)


@cache
def _mace_sc(channels: int, out: str, correlation: int, species: int, hidden: str = HIDDEN_IN,
             seed: int = 0) -> MaceSC:
    """MACE's module built in float64 with random (nonzero) weights; cached, copy before changing."""
    with default_dtype(torch.float64):
        torch.manual_seed(seed)
        sc = MaceSC(irreps(channels, hidden), irreps(channels, out), correlation=correlation,
                    num_elements=species)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in sc.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return sc


def mace_sc(channels: int, out: str, correlation: int, species: int, dtype=torch.float64,
            hidden: str = HIDDEN_IN) -> MaceSC:
    return copy.deepcopy(_mace_sc(channels, out, correlation, species, hidden)).to(dtype)


def inputs(sc, n: int, dtype, seed: int = 0, device: str = "cpu"):
    channels, dim = sc.irreps_in[0].mul, o3.Irreps([ir for _, ir in sc.irreps_in]).dim
    num_elements = sc.contractions[0].weights_max.shape[0]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, channels, dim, generator=gen, dtype=torch.float64).to(dtype=dtype, device=device)
    species = torch.randint(0, num_elements, (n,), generator=gen).to(device)
    one_hot = torch.nn.functional.one_hot(species, num_elements).to(dtype)
    return x, species, one_hot


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def trainable(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p for p in module.parameters() if p.requires_grad]


def forward_backward(module, x, species, g):
    x = x.detach().requires_grad_(True)
    out = module(x, species)
    grads = torch.autograd.grad(out, [x] + trainable(module), g)
    return out.detach(), grads[0], torch.cat([t.flatten() for t in grads[1:]])


def definition_forward_backward(module: SymmetricContraction, x, species, g):
    """Output and grads from the dense U tensors and MACE's weights (no basis change), by autograd."""
    x = x.detach().requires_grad_(True)
    weights = [[c.weight(nu) for nu in range(1, c.correlation + 1)] for c in module.contractions]
    out = reference_sc(module.problem, x, species, weights)
    grads = torch.autograd.grad(out, [x] + trainable(module), g)
    return out.detach(), grads[0], torch.cat([t.flatten() for t in grads[1:]])


# ----------------------------------------------------------------------------- against MACE (CPU)

@pytest.mark.parametrize("correlation", [1, 2, 3])
@pytest.mark.parametrize("size", ["small", "medium", "large"])
@pytest.mark.parametrize("species", [1, 89])
def test_mace_mp_shapes_match_mace_fp64(size: str, correlation: int, species: int) -> None:
    ref_module = mace_sc(128, OUT[size], correlation, species)
    ours = SymmetricContraction.from_mace(ref_module)
    x, species_index, one_hot = inputs(ref_module, 5, torch.float64, seed=correlation)
    g = torch.randn(5, ours.problem.out_dim, dtype=torch.float64)
    got = forward_backward(ours, x, one_hot, g)
    if correlation == 1 and size != "small":
        # MACE's own module fails here (out.view on a non-viewable tensor): the dense definition instead
        ref = definition_forward_backward(ours, x, species_index, g)
    else:
        ref = forward_backward(ref_module, x, one_hot, g)
    for what, a, b in zip(("out", "grad x", "grad weights"), got, ref):
        assert b.norm() > 0, what
        assert rel(a, b) < 1e-10, f"{what}: {rel(a, b):.2e}"


@pytest.mark.parametrize("size", ["small", "medium", "large"])
def test_float32_mace_matches(size: str) -> None:
    """A float32 MACE module (U rounded to float32) against its float64 original, and ours on the same."""
    ref_module = mace_sc(128, OUT[size], 3, 89)
    module32 = mace_sc(128, OUT[size], 3, 89, dtype=torch.float32)
    ours = SymmetricContraction.from_mace(module32)
    x, species, one_hot = inputs(ref_module, 6, torch.float64, seed=7)
    g = torch.randn(6, ours.problem.out_dim, dtype=torch.float64)
    ref = forward_backward(ref_module, x, one_hot, g)
    got = forward_backward(ours, x.float(), species, g.float())
    mace32 = forward_backward(module32, x.float(), one_hot.float(), g.float())
    for what, a, b, m in zip(("out", "grad x", "grad weights"), got, ref, mace32):
        assert rel(a, b) < TOL[torch.float32], f"{what}: {rel(a, b):.2e}"
        assert rel(a, b) < 10 * max(rel(m, b), 1e-7), f"{what}: no better than 10x MACE's own float32"


def test_isolated_atoms_and_tiny_batches() -> None:
    """Rows of zeros (an atom without neighbours) and rows with only scalars; N = 0 and 1."""
    ref_module = mace_sc(128, OUT["large"], 3, 89)
    ours = SymmetricContraction.from_mace(ref_module)
    x, species, one_hot = inputs(ref_module, 4, torch.float64, seed=3)
    x[1] = 0.0
    x[2, :, 1:] = 0.0
    out = ours(x, one_hot)
    assert rel(out, ref_module(x, one_hot).detach()) < 1e-10
    assert torch.all(out[1] == 0)
    assert out[2].abs().max() > 0
    for n in (0, 1):
        xs, ss = x[:n].clone().requires_grad_(True), species[:n]
        out = ours(xs, ss)
        assert out.shape == (n, ours.problem.out_dim)
        (gx,) = torch.autograd.grad(out.sum(), xs)
        assert gx.shape == xs.shape
        if n:
            assert rel(out, ref_module(x[:n], one_hot[:n]).detach()) < 1e-10


def test_index_and_one_hot_species_agree() -> None:
    ours = SymmetricContraction.from_mace(mace_sc(8, OUT["medium"], 3, 3))
    x, species, one_hot = inputs(ours, 7, torch.float64, seed=1)
    a = ours(x, one_hot)
    assert torch.equal(a, ours(x, species))
    assert torch.equal(a, ours(x, species.to(torch.int32)))


def test_zero_u_matrices_and_odd_parity_outputs() -> None:
    """1e from natural-parity inputs: U of degree 1 is zero (MACE zeroes weights), degree 2 antisymmetric."""
    ref_module = _mace_sc.__wrapped__(4, "1e+0o+1o", 3, 2)  # MACE's EmptyParam cannot be deep-copied
    ours = SymmetricContraction.from_mace(ref_module)
    x, _, one_hot = inputs(ref_module, 5, torch.float64, seed=2)
    g = torch.randn(5, ours.problem.out_dim, dtype=torch.float64)
    ref = forward_backward(ref_module, x, one_hot, g)
    got = forward_backward(ours, x, one_hot, g)
    for a, b in zip(got, ref):
        # MACE's grads of weights whose polynomial vanishes are round-off (1e-15), ours exact zeros
        assert float((a - b).norm()) < 1e-10 * max(float(b.norm()), 1.0)


def test_correlation_four() -> None:
    ref_module = mace_sc(3, "0e+1o", 4, 2, hidden="0e+1o")  # (MACE needs 80 s to build 0e+1o+2e+3o)
    ours = SymmetricContraction.from_mace(ref_module)
    x, _, one_hot = inputs(ref_module, 4, torch.float64, seed=4)
    g = torch.randn(4, ours.problem.out_dim, dtype=torch.float64)
    for a, b in zip(forward_backward(ours, x, one_hot, g), forward_backward(ref_module, x, one_hot, g)):
        assert rel(a, b) < 1e-10


# ----------------------------------------------------------------------------- module behaviour

@pytest.mark.slow  # > 10 s on a CPU: the full tier (CI) runs it
def test_state_dict_is_maces_and_loads_both_ways() -> None:
    ref_module = mace_sc(8, OUT["large"], 3, 5)
    with default_dtype(torch.float64):
        fresh = SymmetricContraction(irreps(8, HIDDEN_IN), irreps(8, OUT["large"]), 3, 5)
    assert list(fresh.state_dict()) == list(ref_module.state_dict())
    for key, value in fresh.state_dict().items():
        assert value.shape == ref_module.state_dict()[key].shape, key
    fresh.load_state_dict(ref_module.state_dict())
    x, species, one_hot = inputs(ref_module, 4, torch.float64, seed=5)
    assert rel(fresh(x, species), ref_module(x, one_hot).detach()) < 1e-10
    back = mace_sc(8, OUT["large"], 3, 5)
    with torch.no_grad():
        for p in back.parameters():
            p.mul_(-0.5)
    back.load_state_dict(fresh.state_dict())
    assert rel(back(x, one_hot).detach(), ref_module(x, one_hot).detach()) == 0.0


def test_from_mace_shares_the_tensors() -> None:
    ref_module = mace_sc(4, OUT["medium"], 3, 2)
    ours = SymmetricContraction.from_mace(ref_module)
    assert ours.contractions[0].weights_max is ref_module.contractions[0].weights_max
    x, species, one_hot = inputs(ref_module, 3, torch.float64, seed=6)
    before = ours(x, species)
    with torch.no_grad():
        ref_module.contractions[1].weights[0].mul_(2.0)  # an in-place update (an optimiser step) is seen
    after = ours(x, species)
    assert rel(after, ref_module(x, one_hot).detach()) < 1e-10
    assert rel(after, before) > 1e-3


@pytest.mark.slow
def test_standalone_u_matrices_are_maces() -> None:
    from mace.tools.cg import U_matrix_real

    for ir_out in ("0e", "1o", "2e", "1e"):
        for nu in (1, 2, 3):
            ref = U_matrix_real(HIDDEN_IN, ir_out, nu, use_cueq_cg=False, dtype=torch.float64)[-1].numpy()
            ours = mace_u_matrices(HIDDEN_IN, ir_out, nu)
            assert ours.shape == ((1,) + ref.shape if ref.ndim == nu + 1 else ref.shape)
            np.testing.assert_allclose(ours.reshape(ref.shape), ref, atol=1e-14, rtol=0)


def test_loading_other_u_matrices_rebuilds_the_plan() -> None:
    ref_module = mace_sc(4, OUT["small"], 2, 2)
    with default_dtype(torch.float64):
        ours = SymmetricContraction(irreps(4, HIDDEN_IN), irreps(4, OUT["small"]), 2, 2)
    key = ours.key
    state = ref_module.state_dict()
    state["contractions.0.U_matrix_2"] = state["contractions.0.U_matrix_2"] * 3.0
    ours.load_state_dict(state)
    assert ours.key != key
    x, species, one_hot = inputs(ref_module, 3, torch.float64)
    ref_module.load_state_dict(state)
    assert rel(ours(x, species), ref_module(x, one_hot).detach()) < 1e-10


def test_deepcopy_and_pickle() -> None:
    ours = SymmetricContraction.from_mace(mace_sc(4, OUT["medium"], 3, 2))
    x, species, _ = inputs(ours, 3, torch.float64)
    ref = ours(x, species)
    buf = io.BytesIO()
    torch.save(ours, buf)
    buf.seek(0)
    for other in (copy.deepcopy(ours), torch.load(buf, weights_only=False)):
        assert torch.equal(other(x, species), ref)



def test_the_public_name_is_the_mace_patches() -> None:
    """MACE's layout is cgforge.patches.mace.SymmetricContraction; kernels/ names nothing of the patches."""
    import cgforge.kernels
    import cgforge.kernels.symmetric_contraction as sc
    from cgforge.kernels.symmetric_contraction import SymmetricContractionBase

    assert SymmetricContraction is pm.SymmetricContraction
    assert SymmetricContraction.__module__ == "cgforge.patches.mace.symmetric_contraction"
    assert issubclass(SymmetricContraction, SymmetricContractionBase)
    assert issubclass(pm.FusedSymmetricContraction, SymmetricContraction)
    for module in (cgforge.kernels, sc, sc.module):
        with pytest.raises(AttributeError):
            module.SymmetricContraction  # noqa: B018


def test_the_kernel_problem_takes_u_tensors_as_values() -> None:
    """kernels/ knows no model: any U tensors (here a random one) define the problem, checked for shape."""
    from cgforge.kernels.symmetric_contraction import SCProblem

    rng = np.random.default_rng(0)
    u = [[rng.standard_normal((1, 4, 2)), rng.standard_normal((1, 4, 4, 3))]]
    problem = SCProblem.build("2x0e+2x1o", "2x0e", 2, 3, u=u)
    assert problem.num_params(0, 1) == 2 and problem.num_params(0, 2) == 3 and problem.in_dim == 4
    with pytest.raises(ValueError, match=r"u\[0\]\[1\] must have shape \[1, 4, 4\] \+ \[K\]"):
        SCProblem.build("2x0e+2x1o", "2x0e", 2, 3, u=[[u[0][0], u[0][1][0]]])
    with pytest.raises(ValueError, match="one list of U tensors per output irrep"):
        SCProblem.build("2x0e+2x1o", "2x0e", 2, 3, u=None)
    with pytest.raises(ValueError, match=r"u\[0\] must hold 2 tensors"):
        SCProblem.build("2x0e+2x1o", "2x0e", 2, 3, u=[u[0][:1]])


def test_double_backward_through_the_interpreter() -> None:
    ours = SymmetricContraction.from_mace(mace_sc(1, OUT["medium"], 2, 2))
    x, species, _ = inputs(ours, 2, torch.float64, seed=9)
    wp = ours.transformed_weights(torch.float64, x.device).detach().requires_grad_(True)
    x.requires_grad_(True)
    species = species.to(torch.int32)
    f = lambda a, b: sc_ops.sc_forward(a, species, b, ours.key)
    assert torch.autograd.gradcheck(f, (x, wp))
    assert torch.autograd.gradgradcheck(f, (x, wp))


def test_bad_inputs_are_clear_errors() -> None:
    ours = SymmetricContraction.from_mace(mace_sc(4, OUT["medium"], 2, 3))
    x, species, one_hot = inputs(ours, 3, torch.float64)
    with pytest.raises(ValueError, match=r"x must have shape \[N, 4, 16\]"):
        ours(x.reshape(3, -1), species)
    with pytest.raises(TypeError, match="float32 or float64"):
        ours(x.half(), species)
    with pytest.raises(ValueError, match=r"one-hot species must have shape \[3, 3\]"):
        ours(x, one_hot[:, :2])
    with pytest.raises(ValueError, match=r"in \[0, 3\)"):
        ours(x, torch.tensor([0, 3, 1]))
    with pytest.raises(TypeError, match="int32 or int64"):
        ours(x, species.to(torch.int16))
    with pytest.raises(ValueError, match="correlation"):
        SymmetricContraction(irreps(4, HIDDEN_IN), irreps(4, "0e"), 5, 2)
    with pytest.raises(ValueError, match="multiplicity"):
        SymmetricContraction("4x0e+2x1o", "4x0e", 2, 2)
    with pytest.raises(TypeError, match="MACE SymmetricContraction"):
        SymmetricContraction.from_mace(torch.nn.Linear(2, 2))


# ----------------------------------------------------------------------------- schedule, program, source

@pytest.mark.parametrize("size", ["small", "medium", "large"])
@pytest.mark.slow
def test_schedule_interpreter_and_program_match_the_definition(size: str) -> None:
    """Reduced basis + transform (interpreter) and the generated statements (NumPy) vs dense U."""
    ref_module = mace_sc(6, OUT[size], 3, 4)
    ours = SymmetricContraction.from_mace(ref_module)
    problem, schedule = ours.problem, ours.schedule
    assert schedule.num_slots < schedule.num_params, "the basis should be smaller than MACE's"
    x, species, _ = inputs(ref_module, 5, torch.float64, seed=11)
    weights = [[c.weight(nu).detach() for nu in range(1, c.correlation + 1)] for c in ours.contractions]
    ref = reference_sc(problem, x, species, weights)
    wp = ours.transformed_weights(torch.float64, x.device).detach()
    assert rel(interpret_sc(schedule, x, species, wp), ref) < 1e-12

    n, channels = x.shape[0], problem.channels
    env = {f"x{k}": x[:, :, k].reshape(-1).numpy() for k in range(problem.in_dim)}
    rows = wp.index_select(0, species).numpy()  # [N, R, C]
    env.update({f"w{r}": rows[:, r, :].reshape(-1) for r in range(schedule.num_slots)})
    res = run_program(forward_program(schedule), env)
    blocks = [np.stack([res[f"o{o}_{m}"].reshape(n, channels) for m in range(out.dim)], -1).reshape(n, -1)
              for o, out in enumerate(schedule.outputs)]
    assert rel(torch.from_numpy(np.concatenate(blocks, 1)), ref) < 1e-12

    g = torch.randn(ref.shape, dtype=torch.float64)
    xg, wg = x.clone().requires_grad_(True), wp.clone().requires_grad_(True)
    gx_ref, gw_ref = torch.autograd.grad(interpret_sc(schedule, xg, species, wg), (xg, wg), g)
    for o, out in enumerate(schedule.outputs):
        blk = g[:, out.offset:out.offset + channels * out.dim].reshape(n, channels, out.dim)
        env.update({f"g{o}_{m}": blk[:, :, m].reshape(-1).numpy() for m in range(out.dim)})
    res = run_program(backward_program(schedule, grad_weights=True), env)
    gx = np.stack([res[f"gx{k}"].reshape(n, channels) for k in range(problem.in_dim)], -1)
    assert rel(torch.from_numpy(gx), gx_ref) < 1e-12
    per_row = np.stack([res[f"gw{r}"].reshape(n, channels) for r in range(schedule.num_slots)], 1)
    gw = np.zeros(wp.shape)
    np.add.at(gw, species.numpy(), per_row)
    assert rel(torch.from_numpy(gw), gw_ref) < 1e-12
    gx_only = run_program(backward_program(schedule, grad_weights=False), env)
    assert all(np.array_equal(gx_only[f"gx{k}"], res[f"gx{k}"]) for k in range(problem.in_dim))


def test_basis_is_much_smaller_for_mace_mp_large() -> None:
    problem = mace_problem(irreps(128, HIDDEN_IN), irreps(128, OUT["large"]), 3, 89)
    schedule = build_sc_schedule(problem)
    assert schedule.num_params == 159
    assert schedule.num_slots == 49  # ranks of MACE's columns: 1+4+8, 1+3+12, 1+5+14
    cost = schedule.forward_cost()
    assert forward_program(schedule).multiply_adds() <= cost["total"] < 1000


@pytest.mark.skipif(not nvrtc_available(), reason="needs the NVRTC library")
@pytest.mark.parametrize("scalar", ["float", "double"])
def test_generated_source_compiles_with_nvrtc(scalar: str) -> None:
    ours = SymmetricContraction.from_mace(mace_sc(128, OUT["medium"], 3, 89))
    source, name = render(ours.schedule, scalar)
    result = compile_cubin(source, arch="sm_90", name=f"{name}.cu")
    for which in ("forward", "backward", "backward_w"):
        res = result.resources(f"{name}_{which}")
        assert res.registers > 0
        if scalar == "float" or which == "forward":
            assert not res.spills, f"{which} spills: {res}"


# ----------------------------------------------------------------------------- MACE models

@pytest.mark.slow
def test_patched_mace_model_swaps_products_and_matches_fp64() -> None:
    model = build_model(hidden=MP_SHAPES["medium"].replace("128", "16"), max_ell=3, correlation=3)
    ref = evaluate(model, water_dimer())
    patched = pm.patch(copy.deepcopy(model))
    assert all(isinstance(b.symmetric_contractions, pm.FusedSymmetricContraction) for b in patched.products)
    assert list(patched.state_dict()) == list(model.state_dict())
    assert_same_outputs(evaluate(patched, water_dimer()), ref, tol=1e-10)
    plain = pm.unpatch(patched)
    assert all(type(b.symmetric_contractions) is MaceSC for b in plain.products)
    assert_same_outputs(evaluate(plain, water_dimer()), ref, tol=1e-12)


def test_unpatch_after_dtype_change_keeps_the_converted_tensors() -> None:
    model = pm.patch(build_model())
    model.float()
    plain = pm.unpatch(model)
    for block in plain.products:
        for c in block.symmetric_contractions.contractions:
            assert c.weights_max.dtype == torch.float32 and c.U_matrix_1.dtype == torch.float32


# ----------------------------------------------------------------------------- CUDA

@cuda
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("size", ["small", "medium", "large"])
def test_gpu_matches_mace(size: str, dtype: torch.dtype) -> None:
    ref_module = mace_sc(128, OUT[size], 3, 89)
    ours = SymmetricContraction.from_mace(mace_sc(128, OUT[size], 3, 89, dtype=dtype)).cuda()
    for n in (0, 1, 37, 300):
        x, species, one_hot = inputs(ref_module, n, torch.float64, seed=n)
        g = torch.randn(n, ours.problem.out_dim, dtype=torch.float64)
        got = forward_backward(ours, x.to("cuda", dtype), one_hot.to("cuda", dtype), g.to("cuda", dtype))
        if n == 0:
            assert got[0].shape == (0, ours.problem.out_dim) and got[1].shape == (0, 128, 16)
            continue
        ref = forward_backward(ref_module, x, one_hot, g)
        for what, a, b in zip(("out", "grad x", "grad weights"), got, ref):
            assert rel(a, b) < TOL[dtype], f"n={n} {what}: {rel(a, b):.2e}"


@cuda
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_gpu_kernels_match_the_interpreter_and_write_everything(dtype: torch.dtype) -> None:
    ours = SymmetricContraction.from_mace(mace_sc(128, OUT["large"], 3, 89)).cuda().to(dtype)
    x, species, _ = inputs(ours, 501, dtype, seed=5, device="cuda")
    species = species.to(torch.int32)
    wp = ours.transformed_weights(dtype, x.device)
    g = torch.randn(501, ours.problem.out_dim, dtype=dtype, device="cuda")
    out = sc_ops.sc_forward(x, species, wp, ours.key)
    gx, empty = sc_ops.sc_backward(x, species, wp, g, ours.key, True, False)
    gx2, gw = sc_ops.sc_backward(x, species, wp, g, ours.key, True, True)
    cpu = [t.cpu() for t in (x, species, wp, g)]
    ref_out = sc_ops.sc_forward(cpu[0], cpu[1], cpu[2], ours.key)
    ref_gx, ref_gw = sc_ops.sc_backward(*cpu, ours.key, True, True)
    assert empty.numel() == 0
    assert torch.isfinite(out).all() and torch.isfinite(gx).all() and torch.isfinite(gw).all()
    for a, b in ((out, ref_out), (gx, ref_gx), (gx2, ref_gx), (gw, ref_gw)):
        assert rel(a, b) < TOL[dtype] / 10


@cuda
@needs_gpu
def test_gpu_bad_species_give_nan_not_a_crash() -> None:
    ours = SymmetricContraction.from_mace(mace_sc(8, OUT["medium"], 3, 3)).cuda()
    x, species, _ = inputs(ours, 4, torch.float64, device="cuda")
    species = species.to(torch.int32)
    species[2] = 7
    wp = ours.transformed_weights(torch.float64, x.device)
    out = sc_ops.sc_forward(x, species, wp, ours.key)
    assert torch.isnan(out[2]).all() and torch.isfinite(out[[0, 1, 3]]).all()
    gx, gw = sc_ops.sc_backward(x, species, wp, torch.ones_like(out), ours.key, True, True)
    assert torch.isnan(gx[2]).all() and torch.isfinite(gx[[0, 1, 3]]).all() and torch.isfinite(gw).all()


@cuda
@needs_gpu
def test_gpu_cuda_graph_capture() -> None:
    ours = SymmetricContraction.from_mace(mace_sc(128, OUT["medium"], 3, 89)).cuda().float()
    for p in ours.parameters():
        p.requires_grad_(False)
    x, species, _ = inputs(ours, 64, torch.float32, device="cuda")
    ref = ours(x, species)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ours(x, species)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert rel(out, ours(x, species)) < 1e-6 and rel(out, ref) > 1e-2
