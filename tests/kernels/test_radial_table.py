"""Radial tables: the fit's measured error, the evaluation op (values, derivatives of every order, clamping),
its CUDA kernels, and MACE models whose blocks read tables (same energies and forces, conservation)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from host_cuda import assert_compiles_without_spills

from cgforge.kernels.radial_table import fit_radial_table, radial_table, radial_table_reference
from cgforge.kernels.radial_table.ops import RADIAL_TABLE_SOURCE, radial_table_dot, radial_table_eval

R_MAX = 5.0


def _smooth(r: torch.Tensor) -> torch.Tensor:
    """Three smooth radial functions like a model's: sinc-type Bessel terms times a polynomial cutoff (0/0 at r = 0)."""
    x = r / R_MAX
    envelope = (1 - x ** 2) ** 3
    return torch.stack([torch.sin(k * math.pi * x) / r * envelope for k in (1, 3, 6)], dim=1)


@pytest.fixture
def float64():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


@pytest.mark.parametrize("tol", [1e-6, 1e-9])
def test_fit_meets_its_tolerance_between_the_knots(tol: float) -> None:
    table = fit_radial_table(_smooth, R_MAX, tol=tol)
    assert max(table.value_error, table.slope_error) <= tol
    assert table.coeffs.shape == (table.intervals, 3, 4) and table.coeffs.dtype == torch.float64
    # fresh points (not the fit's check points), the values and the derivative
    r = torch.rand(4000, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * R_MAX + 1e-3
    exact, slope = torch.func.jvp(_smooth, (r,), (torch.ones_like(r),))
    assert float((table.evaluate(r) - exact).abs().max() / exact.abs().max()) <= 2 * tol
    assert float((table.evaluate(r, 1) - slope).abs().max() / slope.abs().max()) <= 2 * tol


def test_fit_error_falls_as_h_to_the_fourth() -> None:
    coarse = fit_radial_table(_smooth, R_MAX, tol=1.0, min_intervals=128)
    fine = fit_radial_table(_smooth, R_MAX, tol=1.0, min_intervals=256)
    assert fine.intervals == 2 * coarse.intervals
    assert 10 < coarse.value_error / fine.value_error < 22  # 2^4 = 16 for a smooth function
    assert 5 < coarse.slope_error / fine.slope_error < 11  # 2^3 for its derivative


def test_fit_refuses_what_it_cannot_tabulate() -> None:
    with pytest.raises(ValueError, match="differs from fn"):  # a kink: more knots never reach the tolerance
        fit_radial_table(lambda r: (r - 1.2345).abs().unsqueeze(1), R_MAX, tol=1e-7, max_intervals=1024)
    with pytest.raises(ValueError, match="not finite"):
        fit_radial_table(lambda r: torch.log(r - 2.0).unsqueeze(1), R_MAX)
    with pytest.raises(ValueError, match=r"\[n, C\]"):
        fit_radial_table(lambda r: r, R_MAX)
    for bad in (0.0, -1.0, "5"):
        with pytest.raises(ValueError, match="r_max"):
            fit_radial_table(_smooth, bad)
    with pytest.raises(ValueError, match="tol"):
        fit_radial_table(_smooth, R_MAX, tol=0.0)


def _table():
    return fit_radial_table(_smooth, R_MAX, tol=1e-8)


def test_op_is_differentiable_to_third_order(float64) -> None:
    table = _table()
    r = (torch.rand(25, generator=torch.Generator().manual_seed(2)) * R_MAX).requires_grad_()

    def f(x):
        return radial_table(x, table.coeffs, R_MAX)

    assert torch.autograd.gradcheck(f, (r,))
    assert torch.autograd.gradgradcheck(f, (r,))
    # third derivative: d/dr of the second derivative's op equals the analytic third derivative of the cubics
    (g,) = torch.autograd.grad(f(r).sum(), r, create_graph=True)
    (gg,) = torch.autograd.grad(g.sum(), r, create_graph=True)
    (ggg,) = torch.autograd.grad(gg.sum(), r)
    torch.testing.assert_close(ggg, radial_table_reference(r.detach(), table.coeffs, R_MAX, 3).sum(1))


def test_op_clamps_to_the_table_and_keeps_nan(float64) -> None:
    table = _table()
    r = torch.tensor([-0.5, 0.0, 2.0, R_MAX, R_MAX + 1.0, float("nan")], requires_grad=True)
    w = radial_table(r, table.coeffs, R_MAX)
    torch.testing.assert_close(w[0], w[1])  # below 0: the value at 0
    torch.testing.assert_close(w[4], w[3])  # beyond r_max: the value at r_max
    assert w[5].isnan().all() and w[:5].isfinite().all()
    (g,) = torch.autograd.grad(w[:5].sum(), r)
    assert g[0] == 0 and g[4] == 0 and g[2] != 0  # the clamp's derivative outside


def test_dot_op_is_the_rowwise_product_with_the_derivative_table(float64) -> None:
    table = _table()
    gen = torch.Generator().manual_seed(3)
    r = torch.rand(40, generator=gen) * R_MAX
    g = torch.randn(40, 3, generator=gen)
    for order in range(5):
        want = (g * radial_table_reference(r, table.coeffs, R_MAX, order)).sum(1)
        torch.testing.assert_close(radial_table_dot(r, table.coeffs, g, R_MAX, order), want)
    torch.testing.assert_close(radial_table_eval(r, table.coeffs, R_MAX, 4), torch.zeros(40, 3))


def test_op_rejects_bad_inputs(float64) -> None:
    table = _table()
    r = torch.rand(5)
    with pytest.raises(ValueError, match="edge lengths"):
        radial_table(torch.rand(5, 2), table.coeffs, R_MAX)
    with pytest.raises(ValueError, match=r"\[N, C, 4\]"):
        radial_table(r, table.coeffs[:, :, :3], R_MAX)
    with pytest.raises(ValueError, match="float32 or both float64"):
        radial_table(r.float(), table.coeffs, R_MAX)
    with pytest.raises(ValueError, match="constants"):
        radial_table(r, table.coeffs.clone().requires_grad_(), R_MAX)
    with pytest.raises(ValueError, match="r_max"):
        radial_table(r, table.coeffs, -1.0)
    with pytest.raises(TypeError, match="tensors"):
        radial_table(r.tolist(), table.coeffs, R_MAX)


def test_kernels_compile_without_spills() -> None:
    names = ("radial_table_eval_f32", "radial_table_eval_f64", "radial_table_dot_f32", "radial_table_dot_f64")
    assert_compiles_without_spills(RADIAL_TABLE_SOURCE, "radial_table.cu", names)


def test_edge_order_rule() -> None:
    from cgforge.kernels.radial_table.ops import SORT_MIN_COLUMNS, SORT_MIN_EDGES, sorts_by_length

    assert sorts_by_length(SORT_MIN_EDGES, SORT_MIN_COLUMNS) and not sorts_by_length(SORT_MIN_EDGES - 1, 10**6)
    assert sorts_by_length(1, 1, 1) and not sorts_by_length(10**9, 10**9, 0)
    with pytest.raises(ValueError, match="by_length"):
        sorts_by_length(1, 1, 2)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("edges", [1000, 100003])
@pytest.mark.parametrize("by_length", [False, True])  # the edges taken in their own order, or in order of length
def test_cuda_kernels_equal_the_torch_path(dtype: torch.dtype, edges: int, by_length: bool) -> None:
    sort = int(by_length)  # the ops' by_length argument: 1 always, 0 never (-1, the default: the size rule)
    table = _table()
    coeffs = table.coeffs.to("cuda", dtype)
    gen = torch.Generator().manual_seed(4)
    r = torch.cat([torch.rand(edges, generator=gen, dtype=torch.float64) * (R_MAX + 1) - 0.5,
                   torch.tensor([0.0, R_MAX, float("nan")], dtype=torch.float64)]).to("cuda", dtype)
    g = torch.randn(r.shape[0], 3, generator=gen, dtype=torch.float64).to("cuda", dtype)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-12}
    for order in range(4):
        torch.testing.assert_close(radial_table_eval(r, coeffs, R_MAX, order, sort),
                                   radial_table_reference(r, coeffs, R_MAX, order), equal_nan=True, **tol)
        dot = radial_table_dot(r, coeffs, g, R_MAX, order, sort)
        torch.testing.assert_close(dot, (g * radial_table_reference(r, coeffs, R_MAX, order)).sum(1), equal_nan=True,
                                   **tol)
        again = radial_table_dot(r, coeffs, g, R_MAX, order, sort)
        torch.testing.assert_close(dot, again, rtol=0, atol=0, equal_nan=True)


@pytest.mark.cuda
def test_cuda_op_second_derivative() -> None:
    table = _table()
    coeffs = table.coeffs.cuda()
    r = (torch.rand(30, dtype=torch.float64, device="cuda") * R_MAX).requires_grad_()
    assert torch.autograd.gradgradcheck(lambda x: radial_table(x, coeffs, R_MAX), (r,))


# ---------------------------------------------------------------- MACE models reading tables

def _mace_calculator(dtype: str, **kw):
    from cgforge.plugin.calculator import Calculator

    return Calculator("mace", device=kw.pop("device", "cpu"), dtype=dtype, patch=True, **kw)


def _energy_forces(calc, atoms):
    calc.reset()  # computed now: ASE would hand back the last results for the same structure
    atoms = atoms.copy()
    atoms.calc = calc
    return atoms.get_potential_energy(), atoms.get_forces()


@pytest.mark.slow
def test_mace_with_tables_matches_the_mlp(float64) -> None:
    from cgforge.plugin.water import water_box

    atoms = water_box(24, seed=5)
    reference = _mace_calculator("float64", radial_table=False)
    tabulated = _mace_calculator("float64", radial_table=True)
    assert not reference.radial_table and tabulated.radial_table
    assert len(tabulated.radial_table_errors) == 2 and all(e <= 1e-7 for _, e in tabulated.radial_table_errors)
    e0, f0 = _energy_forces(reference, atoms)
    e1, f1 = _energy_forces(tabulated, atoms)
    assert abs(e1 - e0) <= 1e-9 * abs(e0)
    assert np.abs(f1 - f0).max() <= 1e-6 * np.abs(f0).max()
    assert abs(e1 - e0) > 0  # the table is not the MLP: the comparison is not vacuous
    # the model's state_dict is the same (tables are not saved)
    sd0, sd1 = reference.model.state_dict(), tabulated.model.state_dict()
    assert sd0.keys() == sd1.keys() and all(torch.equal(sd0[k], sd1[k]) for k in sd0)


def _fused_and_unfused(device: str, dtype: str, atoms):
    """Energy and forces of one tabulated calculator with the convolutions reading the tables, then without."""
    from cgforge.patches.mace.radial_table import radial_tables, set_table_fusion

    calc = _mace_calculator(dtype, device=device, radial_table=True)
    assert [t.fused for t in radial_tables(calc.model)] == [True, True]  # the default of a patched model
    fused = _energy_forces(calc, atoms)
    set_table_fusion(calc.model, False)
    calc.step.invalidate()
    assert "fused=False" in repr(calc.model.interactions[0].conv_tp_weights)
    return fused, _energy_forces(calc, atoms), calc


@pytest.mark.slow
def test_mace_convolutions_read_the_tables(float64) -> None:
    from cgforge.patches.mace.radial_table import set_table_fusion
    from cgforge.plugin.water import water_box

    (e0, f0), (e1, f1), calc = _fused_and_unfused("cpu", "float64", water_box(16, seed=3))
    assert abs(e1 - e0) <= 1e-12 * abs(e0) and np.abs(f1 - f0).max() <= 1e-10 * np.abs(f0).max()
    calc.model.interactions[1].conv_tp.reads_tables = False  # as if the block's convolution were another one
    with pytest.raises(ValueError, match="interactions.1: its convolution .* cannot read a radial table"):
        set_table_fusion(calc.model, True)


@pytest.mark.slow
def test_mace_tables_off_and_unpatch_restore_the_model(float64) -> None:
    from cgforge.patches import mace as pm
    from cgforge.patches.mace.radial_table import TabulatedRadial, radial_tables
    from cgforge.plugin.water import water_box

    atoms = water_box(8, seed=6)
    calc = _mace_calculator("float64", radial_table=False)
    e0, _ = _energy_forces(calc, atoms)
    assert pm.set_radial_table(calc.model, True) == 2 and len(radial_tables(calc.model)) == 2
    pm.set_radial_table(calc.model, False)
    calc.step.invalidate()
    assert not radial_tables(calc.model) and type(calc.model.radial_embedding).__name__ == "RadialEmbeddingBlock"
    assert _energy_forces(calc, atoms)[0] == e0
    pm.set_radial_table(calc.model, True)
    pm.unpatch(calc.model)
    assert not any(isinstance(m, TabulatedRadial) for m in calc.model.modules())


@pytest.mark.slow
def test_mace_tables_stream(float64) -> None:
    """Streaming edges over a tabulated model (and back) gives the tabulated model's numbers."""
    from cgforge.plugin.water import water_box

    atoms = water_box(16, seed=8)
    calc = _mace_calculator("float64", radial_table=True)
    e0, f0 = _energy_forces(calc, atoms)
    assert calc.adapter.set_streaming(1 << 20) == 2
    calc.step.invalidate()
    e1, f1 = _energy_forces(calc, atoms)
    calc.adapter.set_streaming(None)
    calc.step.invalidate()
    e2, f2 = _energy_forces(calc, atoms)
    assert calc.radial_table and type(calc.model.radial_embedding).__name__ == "LengthsAsEdgeFeatures"
    for e, f in ((e1, f1), (e2, f2)):
        assert abs(e - e0) <= 1e-10 * abs(e0) and np.abs(f - f0).max() <= 1e-10


def test_stored_edge_bytes_follow_the_table_fusion() -> None:
    """The calculator streams when its estimate of the stored path's peak would not fit: with every block's table
    read inside the convolution there are no per-edge weights, and the estimate is the measured FUSED_EDGE_ITEMS
    (not 2.3 x the weights, which sent 50k-500k-atom boxes that fit to the slower streaming path)."""
    from cgforge.patches.mace.radial_table import set_table_fusion
    from cgforge.patches.radial_table import FUSED_EDGE_ITEMS

    calc = _mace_calculator("float32", radial_table=True, warmup=False)
    weights = sum(b.conv_tp.weight_numel for b in calc.model.interactions)
    assert calc.adapter.stored_edge_bytes() == FUSED_EDGE_ITEMS * 4
    set_table_fusion(calc.model, False)
    assert calc.adapter.stored_edge_bytes() == int(2.3 * 4 * weights)
    mlp = _mace_calculator("float32", radial_table=False, warmup=False)
    assert mlp.adapter.stored_edge_bytes() == int(2.3 * 4 * weights)


def test_calculator_radial_table_choices(float64) -> None:
    from cgforge.plugin.calculator import Calculator

    assert not _mace_calculator("float32").radial_table  # auto: CUDA only
    with pytest.raises(TypeError, match="radial_table"):
        _mace_calculator("float32", radial_table="yes")
    # checked before the model loads: a missing file is not what the error is about
    with pytest.raises(TypeError, match="radial_table"):
        Calculator("no-such-model.model", device="cpu", radial_table=1)
    with pytest.raises(ValueError, match="radial_table=True and radial_precision='tf32'"):
        Calculator("no-such-model.model", device="cpu", radial_table=True, radial_precision="tf32")
    with pytest.raises(ValueError, match="radial_table=True"):
        Calculator("mace", device="cpu", dtype="float64", patch=False, radial_table=True)
    with pytest.raises(ValueError, match="radial_table=True, patch=False: the radial tables are read by cgforge's"):
        Calculator("nequip", device="cpu", patch=False, radial_table=True)


@pytest.mark.cuda
def test_cuda_calculator_uses_tables_by_default_in_fp32() -> None:
    from cgforge.plugin.water import water_box

    atoms = water_box(64, seed=9)
    auto = _mace_calculator("float32", device="cuda")
    mlp = _mace_calculator("float32", device="cuda", radial_table=False)
    assert auto.radial_table and not mlp.radial_table
    e0, f0 = _energy_forces(mlp, atoms)
    e1, f1 = _energy_forces(auto, atoms)
    assert abs(e1 - e0) <= 1e-5 * abs(e0)
    assert np.abs(f1 - f0).max() <= 1e-4 * np.abs(f0).max()


@pytest.mark.cuda
def test_cuda_convolutions_read_the_tables() -> None:
    """The table read inside the convolution kernels gives the numbers of the table evaluated first (FP64)."""
    from cgforge.plugin.water import water_box

    (e0, f0), (e1, f1), _ = _fused_and_unfused("cuda", "float64", water_box(64, seed=4))
    assert abs(e1 - e0) <= 1e-12 * abs(e0) and np.abs(f1 - f0).max() <= 1e-10 * np.abs(f0).max()
