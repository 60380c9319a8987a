"""Radial-MLP precision modes. CPUs have no TF32: the TF32 product is emulated here by rounding both operands
to TF32 (what tensor cores read) and multiplying in FP32, which is what the GPU computes up to summation order."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from cgforge.patches import radial_precision
from cgforge.patches.radial_precision import (
    MODES,
    RadialLinear,
    radial_layers,
    radial_matmul,
    set_radial_precision,
    tf32_round,
)
from cgforge.plugin import Calculator
from cgforge.plugin.runtime.potential import Potential
from cgforge.plugin.water import water_box


def emulated_tf32_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return tf32_round(a) @ tf32_round(b)


@pytest.fixture
def emulate_tf32(monkeypatch):
    monkeypatch.setattr(radial_precision, "_tf32_mm", emulated_tf32_mm)


def test_tf32_round() -> None:
    x = torch.randn(10000, generator=torch.Generator().manual_seed(0)) * 1e3
    r = tf32_round(x)
    assert (r.view(torch.int32) & 0x1FFF).eq(0).all()  # 10 explicit mantissa bits left
    assert ((r - x).abs() <= x.abs() * 2.0**-11).all()  # round to nearest: half a TF32 ulp at most
    assert torch.equal(tf32_round(r), r)
    one_ulp = 2.0**-10
    assert tf32_round(torch.tensor([1 + 0.49 * one_ulp, 1 + 0.51 * one_ulp, -(1 + 0.51 * one_ulp)])).tolist() == [
        1.0, 1 + one_ulp, -(1 + one_ulp)]


def test_3xtf32_is_fp32_accurate_and_tf32_is_not(emulate_tf32) -> None:
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(2000, 64, generator=g), torch.randn(64, 256, generator=g)
    exact = x.double() @ w.double()

    def error(mode: str) -> float:
        return float((radial_matmul(x, w, mode).double() - exact).norm() / exact.norm())

    fp32, split, tf32 = error("fp32"), error("3xtf32"), error("tf32")
    assert fp32 < 1e-6
    assert split < 4 * fp32 + 1e-7  # FP32-level
    assert tf32 > 30 * split  # the 10-bit operands show
    # FP64 tensors ignore the mode; 3xtf32 leaves narrow (memory-bound) products in FP32
    assert torch.equal(radial_matmul(x.double(), w.double(), "tf32"), x.double() @ w.double())
    assert torch.equal(radial_matmul(x, w[:, :100], "3xtf32"), x @ w[:, :100])  # N < 2K
    assert torch.equal(radial_matmul(x[:, :16], w[:16], "3xtf32"), x[:, :16] @ w[:16])  # K < 32
    assert not torch.equal(radial_matmul(x, w[:, :128], "3xtf32"), x @ w[:, :128])


@pytest.mark.parametrize("mode", ["tf32", "3xtf32"])
def test_modes_differentiate_to_second_order(mode: str, emulate_tf32) -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(30, 32, generator=g, requires_grad=True)
    w = torch.randn(32, 64, generator=g, requires_grad=True)  # wide enough for 3xtf32
    out = torch.tanh(radial_matmul(x, w, mode)).sum()
    gx, = torch.autograd.grad(out, x, create_graph=True)
    ggw, = torch.autograd.grad(gx.square().sum(), w)
    ref_out = torch.tanh(x @ w).sum()
    ref_gx, = torch.autograd.grad(ref_out, x, create_graph=True)
    ref_ggw, = torch.autograd.grad(ref_gx.square().sum(), w)
    tol = 5e-3 if mode == "tf32" else 1e-5  # relative, in norm
    assert (gx - ref_gx).norm() <= tol * ref_gx.norm()
    assert (ggw - ref_ggw).norm() <= tol * ref_ggw.norm()


def test_patched_models_expose_their_radial_layers(nequip_state) -> None:
    from mace_helpers import build_model
    from nequip_helpers import nequip_model

    from cgforge.patches import mace as mace_patch
    from cgforge.patches import nequip as nequip_patch

    mace = mace_patch.patch(build_model())
    assert set_radial_precision(mace, "3xtf32") == 2  # each interaction block's radial MLP
    assert {m.precision for m in radial_layers(mace)} == {"3xtf32"}
    with pytest.raises(ValueError, match="expected one of fp32, tf32, 3xtf32"):
        set_radial_precision(mace, "bf16")
    nequip = nequip_model("float32")
    keys = list(nequip.state_dict())
    nequip_patch.patch(nequip)
    layers = radial_layers(nequip)
    assert len(layers) == 4 and all(isinstance(m, RadialLinear) for m in layers)  # 2 layers x 2 MLP layers
    assert list(nequip.state_dict()) == keys
    nequip_patch.unpatch(nequip)
    assert radial_layers(nequip) == []
    assert list(nequip.state_dict()) == keys


def _calculator(model: str, mode: str, monkeypatch) -> Calculator:
    # the CUDA requirement bypassed: on CPU the TF32 product is the emulation
    monkeypatch.setattr(Potential, "_radial_precision", lambda self, m: m)
    return Calculator(model, device="cpu", patch=True, warmup=False, radial_precision=mode)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["mace", "nequip"])
def test_the_calculator_measures_the_mode_before_keeping_it(model: str, emulate_tf32, monkeypatch) -> None:
    atoms = water_box(27, seed=0)
    atoms.calc = Calculator(model, device="cpu", patch=True, warmup=False)
    fp32 = atoms.get_forces()
    for mode in ("3xtf32", "tf32"):
        calc = _calculator(model, mode, monkeypatch)
        atoms.calc = calc
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            forces = atoms.get_forces()
        error = calc.radial_precision_error
        assert error is not None and error > 0
        kept = error <= 1e-4
        assert calc.radial_precision == (mode if kept else "fp32")
        assert {m.precision for m in radial_layers(calc.model)} == {calc.radial_precision}
        assert any("kept in FP32" in str(w.message) for w in caught) == (not kept)
        change = np.linalg.norm(forces - fp32) / np.linalg.norm(fp32)
        assert change == pytest.approx(error, rel=1e-6) if kept else change < 1e-6
        if mode == "3xtf32":
            assert kept and error < 1e-5  # FP32-level


def test_a_mode_that_moves_the_forces_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(radial_precision, "_tf32_mm", lambda a, b: (a @ b) * 1.001)
    atoms = water_box(8, seed=1)
    calc = _calculator("mace", "tf32", monkeypatch)
    atoms.calc = calc
    with pytest.warns(RuntimeWarning, match="radial MLPs kept in FP32: tf32 changed the forces by"):
        forces = atoms.get_forces()
    assert calc.radial_precision == "fp32" and calc.radial_precision_error > 1e-4
    reference = Calculator("mace", device="cpu", patch=True, warmup=False)
    atoms.calc = reference
    assert np.abs(atoms.get_forces() - forces).max() < 1e-6 * np.abs(forces).max()


def test_bad_radial_precision_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="radial_precision: expected one of fp32, tf32, 3xtf32, got 'bf16'"):
        Calculator("mace", device="cpu", warmup=False, radial_precision="bf16")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        Calculator("mace", device="cpu", warmup=False, radial_precision="tf32")
    with pytest.raises(ValueError, match="radial_precision='3xtf32' is for FP32 models; this one is torch.float64"):
        Calculator("mace", device="cpu", dtype="float64", warmup=False, radial_precision="3xtf32")
    assert MODES == ("fp32", "tf32", "3xtf32")


# ---------------------------------------------------------------------------------------------
# CUDA: the real tensor cores


@pytest.mark.cuda
def test_cuda_tf32_is_engaged_and_3xtf32_is_fp32_accurate() -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(20000, 64, generator=g, device="cuda")
    w = torch.randn(64, 1280, generator=g, device="cuda")
    exact = x.double() @ w.double()

    def error(mode: str) -> float:
        return float((radial_matmul(x, w, mode).double() - exact).norm() / exact.norm())

    fp32, split, tf32 = error("fp32"), error("3xtf32"), error("tf32")
    assert tf32 > 10 * fp32  # TF32 really ran (the flag took effect)
    # The bound from the arithmetic, not from one run. TF32 keeps 10 fraction bits (unit roundoff u = 2^-11): with
    # a = hi + lo (both TF32), |a - hi - lo| <= u^2 |a|, likewise b, and the dropped lo*lo term is <= u^2 |a b|; so
    # each product carries at most 3 u^2 relative error, and the K-term FP32 sum adds at most K * 2^-23 (Higham's
    # gamma_K, doubled because tensor cores need not round to nearest). Elementwise |error| <= that times
    # (|x| @ |w|), so in norm the error is at most that times || |x| @ |w| || / || x @ w ||.
    k = x.shape[1]
    conditioning = float((x.double().abs() @ w.double().abs()).norm() / exact.norm())
    bound = conditioning * (3 * 2.0**-22 + k * 2.0**-23)
    assert split <= bound
    assert split < tf32 / 100  # and it is far from plain TF32: the split really recovered the low bits
    assert not torch.backends.cuda.matmul.allow_tf32  # restored


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["3xtf32", "tf32"])
def test_cuda_calculator_keeps_a_mode_only_within_tolerance(mode: str) -> None:
    atoms = water_box(216, seed=0)
    atoms.calc = Calculator("mace", device="cuda")
    fp32 = atoms.get_forces()
    calc = Calculator("mace", device="cuda", radial_precision=mode)
    atoms.calc = calc
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        forces = atoms.get_forces()
    assert calc.cuda_graph
    kept = calc.radial_precision_error <= 1e-4
    assert calc.radial_precision == (mode if kept else "fp32")
    change = np.linalg.norm(forces - fp32) / np.linalg.norm(fp32)
    assert change <= 1e-4 if kept else change < 1e-5
    if mode == "3xtf32":
        assert kept and calc.radial_precision_error < 1e-5
    atoms.rattle(0.01, seed=1)  # later (replayed) steps stay in the mode
    moved = atoms.get_forces()
    atoms.calc = Calculator("mace", device="cuda")
    bound = max(2 * calc.radial_precision_error, 1e-5)
    assert np.linalg.norm(moved - atoms.get_forces()) <= bound * np.linalg.norm(moved)
