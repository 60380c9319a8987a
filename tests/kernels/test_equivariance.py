"""O(3) equivariance, FP64: rotating (and inverting) the inputs rotates the outputs by the matching Wigner D
matrices (e3nn's `Irreps.D_from_matrix`).

- TensorProduct: f(x D1^T, y D2^T, w) = f(x, y, w) Dout^T on random problems (tests/problem_strategies.py).
- Convolution: node and edge features rotated, graph and weights unchanged.
- Patched MACE and NequIP models: the energy is invariant, forces rotate (F R^T), stress rotates (R S R^T),
  for the cell and positions rotated together (inversion: positions inverted, the lattice is the same).
The CPU tests run the torch path; the CUDA-marked ones the generated kernels on the same cases.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ase import Atoms
from e3nn import o3
from hypothesis import given
from hypothesis import strategies as st
from oracles import random_rotation, rotate, rotated, wigner_d
from potentials import mace_potential, mace_system, nequip_potential, nequip_system
from problem_strategies import hypothesis_settings, problems, random_inputs, rel, seed_decorator

from cgforge.kernels import ConvGraph, Convolution

TOL = 1e-10  # FP64; e3nn's D matrices for l = 6 are exact to ~1e-13


@pytest.mark.smoke
def test_rotations_are_what_they_claim():
    for seed in range(3):
        for inversion in (False, True):
            rot = random_rotation(seed, inversion)
            assert torch.allclose(rot @ rot.T, torch.eye(3, dtype=torch.float64), atol=1e-14)
            assert torch.det(rot).item() == pytest.approx(-1.0 if inversion else 1.0)
            assert torch.allclose(wigner_d(o3.Irreps("1o"), rot), rot, atol=1e-13)  # e3nn 0.5+: (x, y, z)
            assert torch.allclose(wigner_d(o3.Irreps("0e+0o"), rot), torch.diag(torch.tensor(
                [1.0, -1.0 if inversion else 1.0], dtype=torch.float64)), atol=1e-13)


# ------------------------------------------------------------------------ tensor product, convolution


def _check_tp_equivariance(problem, batch, seed, inversion, device):
    ours = problem.cgforge()
    x, y, w = (t.detach() for t in random_inputs(problem, batch, seed, device=device))
    rot = random_rotation(seed, inversion)
    out = ours(x, y, w)
    turned = ours(rotate(x, problem.irreps_in1, rot), rotate(y, problem.irreps_in2, rot), w)
    assert out.abs().max() > 0
    err = rel(turned, rotate(out, problem.irreps_out, rot))
    assert err < TOL, f"relative error {err:.3g} (inversion={inversion})"


@seed_decorator()
@hypothesis_settings(40)
@given(problem=problems(max_mul=40), batch=st.integers(1, 3), seed=st.integers(0, 2**31 - 1),
       inversion=st.booleans())
def test_tensor_product_is_equivariant(problem, batch, seed, inversion):
    _check_tp_equivariance(problem, batch, seed, inversion, "cpu")


def _check_conv_equivariance(problem, n, e, seed, inversion, deterministic, device):
    gen = torch.Generator().manual_seed(seed)
    s, r = torch.randint(0, n, (e,), generator=gen), torch.randint(0, n, (e,), generator=gen)
    graph = ConvGraph(s.to(device), r.to(device), n, deterministic=deterministic)
    conv = Convolution(*problem.args())
    x = random_inputs(problem, n, seed, device=device)[0].detach()
    _, y, w = (t.detach() for t in random_inputs(problem, e, seed + 1, device=device))
    rot = random_rotation(seed, inversion)
    out = conv(x, y, w, graph)
    turned = conv(rotate(x, problem.irreps_in1, rot), rotate(y, problem.irreps_in2, rot), w, graph)
    assert out.abs().max() > 0
    err = rel(turned, rotate(out, problem.irreps_out, rot))
    assert err < TOL, f"relative error {err:.3g} (inversion={inversion})"


@seed_decorator()
@hypothesis_settings(20)
@given(problem=problems(max_mul=40, max_paths=3), n=st.integers(1, 6), e=st.integers(1, 16),
       seed=st.integers(0, 2**31 - 1), inversion=st.booleans(), deterministic=st.booleans())
def test_convolution_is_equivariant(problem, n, e, seed, inversion, deterministic):
    _check_conv_equivariance(problem, n, e, seed, inversion, deterministic, "cpu")


@pytest.mark.cuda
@seed_decorator()
@hypothesis_settings(25)
@given(problem=problems(), batch=st.sampled_from([1, 7, 64]), seed=st.integers(0, 2**31 - 1),
       inversion=st.booleans())
def test_tensor_product_kernels_are_equivariant(problem, batch, seed, inversion):
    _check_tp_equivariance(problem, batch, seed, inversion, "cuda")


@pytest.mark.cuda
@seed_decorator()
@hypothesis_settings(15)
@given(problem=problems(max_paths=3), n=st.integers(1, 30), e=st.integers(1, 150), seed=st.integers(0, 2**31 - 1),
       inversion=st.booleans(), deterministic=st.booleans())
def test_convolution_kernels_are_equivariant(problem, n, e, seed, inversion, deterministic):
    _check_conv_equivariance(problem, n, e, seed, inversion, deterministic, "cuda")


# ---------------------------------------------------------------------------------- whole models

MODELS = {
    "mace-l2": lambda: mace_potential(hidden="8x0e+8x1o+8x2e", max_ell=2),
    "mace-l3-corr3": lambda: mace_potential(interaction="RealAgnosticResidualInteractionBlock",
                                            first="RealAgnosticInteractionBlock", hidden="8x0e+8x1o+8x2e+8x3o",
                                            max_ell=3, correlation=3),
    "nequip-l1-noparity": lambda: nequip_potential(1, parity=False),
    "nequip-l3": lambda: nequip_potential(3),
}


@pytest.fixture(scope="module")
def patched_models():
    cache = {}

    def get(name: str, device: str):
        if (name, device) not in cache:
            plain = MODELS[name]()
            cache[name, device] = (plain if device == "cpu" else plain.to(device)).patched()
        return cache[name, device]

    return get


def _check_model(pot, atoms: Atoms, seed: int, inversion: bool) -> None:
    rot = random_rotation(seed, inversion).numpy()
    e0, f0, _, s0 = (t.detach().cpu().double().numpy() for t in pot.evaluate(atoms))
    e1, f1, _, s1 = (t.detach().cpu().double().numpy() for t in pot.evaluate(rotated(atoms, rot)))
    assert np.abs(f0).max() > 1e-3, "forces are ~0: the check would be empty"
    assert abs(e1.sum() - e0.sum()) <= TOL * max(1.0, abs(e0.sum())), (e0, e1)
    ferr = np.linalg.norm(f1 - f0 @ rot.T) / np.linalg.norm(f0)
    assert ferr < TOL, f"forces: relative error {ferr:.3g}"
    s0, s1 = s0.reshape(3, 3), s1.reshape(3, 3)
    serr = np.linalg.norm(s1 - rot @ s0 @ rot.T) / np.linalg.norm(s0)
    assert serr < TOL, f"stress: relative error {serr:.3g}"


def _system(name: str) -> Atoms:
    return mace_system() if name.startswith("mace") else nequip_system()


@pytest.mark.parametrize("inversion", [False, True], ids=["rotation", "rotoinversion"])
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.slow
def test_patched_model_energy_invariant_forces_and_stress_rotate(patched_models, name, inversion):
    _check_model(patched_models(name, "cpu"), _system(name), seed=11, inversion=inversion)


@pytest.mark.cuda
@pytest.mark.parametrize("inversion", [False, True], ids=["rotation", "rotoinversion"])
@pytest.mark.parametrize("name", list(MODELS))
def test_patched_model_on_gpu_energy_invariant_forces_and_stress_rotate(patched_models, name, inversion):
    _check_model(patched_models(name, "cuda"), _system(name), seed=11, inversion=inversion)
