"""cgforge's ASE calculator: same numbers as MACE's and NequIP's own calculators, forces and stress equal to
finite differences of the energy, properties computed only when asked, Verlet reuse exact, clear errors."""

from __future__ import annotations

import copy
import sys

import numpy as np
import pytest
import torch
from ase import Atoms
from ase.calculators.calculator import PropertyNotImplementedError
from mace_helpers import build_model, rel_err  # noqa: E402
from nequip_helpers import nequip_model
from oracles import central_difference, displaced, unit
from oracles import stress_by_finite_differences as stress_by_strain

from cgforge.plugin import Calculator  # noqa: E402
from cgforge.plugin.runtime.adapters import UnknownElementError  # noqa: E402
from cgforge.plugin.water import water_box  # noqa: E402

cuda = pytest.mark.cuda
MACE_TOL = 1e-10  # FP64, relative (norm of difference over norm of reference)


# ---------------------------------------------------------------------------------------------
# Structures


def periodic_box() -> Atoms:
    """8 waters in a 6.2 Å cube: smaller than twice the 4 Å cutoff, so atoms see their own images."""
    atoms = water_box(8, seed=1)
    atoms.rattle(0.05, seed=2)
    return atoms


def triclinic_box() -> Atoms:
    atoms = water_box(8, seed=3)
    cell = np.array(atoms.cell)
    cell[1] += 0.3 * cell[0]
    cell[2] += 0.2 * cell[0] - 0.25 * cell[1]
    atoms.set_cell(cell, scale_atoms=True)
    atoms.rattle(0.05, seed=4)
    atoms.positions[0] += cell[2] * 1.1  # one atom outside the cell: no wrapping needed
    return atoms


def molecule() -> Atoms:
    """Four waters, no cell, no periodicity."""
    atoms = water_box(4, seed=5)
    atoms.rattle(0.05, seed=6)
    atoms.set_cell(np.zeros((3, 3)))
    atoms.pbc = False
    return atoms


def slab() -> Atoms:
    atoms = water_box(8, seed=7)
    atoms.pbc = (True, True, False)
    return atoms


STRUCTURES = {"periodic": periodic_box, "triclinic": triclinic_box, "molecule": molecule, "slab": slab}


def properties(atoms: Atoms, calc, stress: bool) -> dict[str, np.ndarray]:
    a = atoms.copy()
    a.calc = calc
    out = {"energy": np.array(a.get_potential_energy()), "forces": a.get_forces(),
           "energies": a.get_potential_energies()}
    if stress:
        out["stress"] = a.get_stress()
    return out


def assert_close(got: dict, ref: dict, tol: float) -> None:
    for key, value in ref.items():
        assert np.linalg.norm(value) > 0, f"reference {key} is zero: the comparison would be empty"
        err = rel_err(got[key], value)
        assert err < tol, f"{key}: relative error {err:.3g} >= {tol:g}"


# ---------------------------------------------------------------------------------------------
# MACE


@pytest.fixture(scope="module")
def mace_model() -> torch.nn.Module:
    return build_model(r_max=4.0)


@pytest.fixture(scope="module")
def mace_calc(mace_model) -> Calculator:
    return Calculator(copy.deepcopy(mace_model), device="cpu", patch=True)


@pytest.mark.parametrize("name", list(STRUCTURES))
@pytest.mark.smoke
def test_mace_matches_mace_calculator(mace_model, mace_calc, name):
    from mace.calculators import MACECalculator

    atoms = STRUCTURES[name]()
    with_stress = name in ("periodic", "triclinic")
    ref = properties(atoms, MACECalculator(models=copy.deepcopy(mace_model), device="cpu", default_dtype="float64"),
                     with_stress)
    got = properties(atoms, mace_calc, with_stress)
    assert_close(got, ref, MACE_TOL)


@pytest.mark.slow
def test_mace_model_file_and_dtype(mace_model, tmp_path):
    path = tmp_path / "water.model"
    torch.save(copy.deepcopy(mace_model), path)
    atoms = periodic_box()
    ref = properties(atoms, Calculator(copy.deepcopy(mace_model), device="cpu", patch=True), True)
    assert_close(properties(atoms, Calculator(path, device="cpu", patch=True), True), ref, 1e-12)
    fp32 = Calculator(path, device="cpu", patch=True, dtype="float32")
    assert fp32.dtype == torch.float32
    assert_close(properties(atoms, fp32, True), ref, 1e-4)


def test_unpatched_model_gives_the_same_numbers(mace_model):
    atoms = triclinic_box()
    plain = properties(atoms, Calculator(copy.deepcopy(mace_model), device="cpu", patch=False), True)
    patched = properties(atoms, Calculator(copy.deepcopy(mace_model), device="cpu", patch=True), True)
    assert_close(patched, plain, 1e-11)


def _energy(calc, atoms: Atoms) -> float:
    a = atoms.copy()
    a.calc = calc
    return a.get_potential_energy()


@pytest.mark.parametrize("name", ["periodic", "triclinic"])
def test_forces_are_minus_the_energy_gradient(mace_calc, name):
    atoms = STRUCTURES[name]()
    forces = properties(atoms, mace_calc, False)["forces"]
    h = 1e-4
    rng = np.random.default_rng(0)
    for atom, axis in zip(rng.choice(len(atoms), 6, replace=False), rng.integers(0, 3, 6)):
        direction = unit(atoms.positions.shape, atom, axis)
        fd = -central_difference(lambda t: _energy(mace_calc, displaced(atoms, direction, t)), h)  # noqa: B023
        # FD error here is ~1e-7 of the largest force (h^2 truncation and round-off): 10x margin
        assert abs(fd - forces[atom, axis]) < 1e-6 * np.abs(forces).max(), (atom, axis, fd, forces[atom, axis])


def stress_by_finite_differences(calc, atoms: Atoms, h: float = 1e-5) -> np.ndarray:
    """sigma_ij = (1/V) dE/d eps_ij for a symmetric strain, in ASE's Voigt order (xx yy zz yz xz xy)."""
    return stress_by_strain(lambda a: _energy(calc, a), atoms, h)


@pytest.mark.parametrize("name", ["periodic", "triclinic"])
def test_stress_is_the_cell_derivative(mace_calc, name):
    atoms = STRUCTURES[name]()
    stress = properties(atoms, mace_calc, True)["stress"]
    fd = stress_by_finite_differences(mace_calc, atoms)
    assert np.abs(stress).max() > 1e-6
    assert np.abs(stress - fd).max() < 1e-5 * np.abs(stress).max(), (stress, fd)


class EnergySpy:
    """Wraps an adapter's energy(): records whether autograd was on and whether the geometry carried a strain
    (strained positions are ``pos @ (I + strain)``, not the leaf the forces are taken of)."""

    def __init__(self, calc: Calculator) -> None:
        self.calls: list[dict] = []
        self.inner = calc.adapter.energy
        calc.adapter.energy = self

    def __call__(self, positions, vectors, *args, **kwargs):
        self.calls.append({"grad": torch.is_grad_enabled(), "cell_grad": positions.grad_fn is not None,
                           "positions_grad": positions.requires_grad})
        return self.inner(positions, vectors, *args, **kwargs)


def test_only_asked_properties_are_computed(mace_model):
    # forces_with_energy=False: an energy call runs without autograd (the default computes forces with it,
    # tests/test_calculator_hardening.py)
    calc = Calculator(copy.deepcopy(mace_model), device="cpu", patch=True, forces_with_energy=False)
    spy = EnergySpy(calc)
    atoms = periodic_box()
    atoms.calc = calc
    atoms.get_potential_energy()
    assert spy.calls[-1] == {"grad": False, "cell_grad": False, "positions_grad": False}
    assert set(calc.results) == {"energy", "free_energy"}
    atoms.get_forces()  # forces: positions differentiated, no strain on the cell
    assert spy.calls[-1] == {"grad": True, "cell_grad": False, "positions_grad": True}
    assert "stress" not in calc.results and "energies" not in calc.results
    atoms.get_stress()  # stress: the strain enters through the cell
    assert spy.calls[-1]["cell_grad"] is True
    assert {"energy", "forces", "stress"} <= set(calc.results)
    n_calls = len(spy.calls)
    atoms.get_forces()
    atoms.get_potential_energy()
    assert len(spy.calls) == n_calls, "cached results must not call the model again"


def test_stress_with_forces_for_npt_integrators(mace_model, mace_calc):
    calc = Calculator(copy.deepcopy(mace_model), device="cpu", patch=True, stress_with_forces=True)
    spy = EnergySpy(calc)
    atoms = triclinic_box()
    atoms.calc = calc
    atoms.get_forces()
    assert "stress" in calc.results and spy.calls[-1]["cell_grad"] is True
    n_calls = len(spy.calls)
    stress = atoms.get_stress()
    assert len(spy.calls) == n_calls  # served from the forces call
    assert rel_err(stress, properties(atoms, mace_calc, True)["stress"]) < 1e-12
    cluster = molecule()  # no volume: forces only, no error
    cluster.calc = calc
    assert np.isfinite(cluster.get_forces()).all() and "stress" not in calc.results


@pytest.mark.slow
def test_verlet_reuse_is_exact_and_rebuilds_only_past_half_the_skin(mace_model):
    skin = 0.4
    calc = Calculator(copy.deepcopy(mace_model), device="cpu", patch=True, skin=skin)
    fresh = Calculator(copy.deepcopy(mace_model), device="cpu", patch=True, skin=0.0, warmup=False)
    atoms = periodic_box()
    atoms.calc = calc
    rng = np.random.default_rng(7)
    reference = atoms.positions.copy()
    builds = 0
    for step in range(25):
        atoms.positions = atoms.positions + rng.normal(scale=0.03, size=atoms.positions.shape)
        forces = atoms.get_forces()
        moved = np.linalg.norm(atoms.positions - reference, axis=1).max()
        if step == 0 or moved > skin / 2:
            builds += 1
            reference = atoms.positions.copy()
        assert calc.neighbours.n_builds == builds, f"step {step}: moved {moved:.3f} Å"
        if step % 6 == 0 or step == 24:
            ref = properties(atoms, fresh, False)
            assert rel_err(forces, ref["forces"]) < 1e-12
            assert abs(atoms.get_potential_energy() - ref["energy"]) < 1e-12 * abs(ref["energy"])
    assert 2 <= builds < 20, builds


@pytest.mark.slow
def test_changing_atoms_and_species(mace_model, mace_calc):
    structures = [periodic_box(), molecule(), water_box(27, seed=8)]
    hydrogen_only = periodic_box()
    hydrogen_only.numbers[:] = 1
    structures.append(hydrogen_only)
    for atoms in structures:
        got = properties(atoms, mace_calc, False)
        ref = properties(atoms, Calculator(copy.deepcopy(mace_model), device="cpu", patch=True, warmup=False), False)
        assert_close(got, ref, 1e-12)
    # the same Atoms object changing species in place
    atoms = periodic_box()
    atoms.calc = mace_calc
    e1 = atoms.get_potential_energy()
    atoms.numbers[3] = 1 if atoms.numbers[3] == 8 else 8
    e2 = atoms.get_potential_energy()
    assert e1 != e2
    fresh = Calculator(copy.deepcopy(mace_model), device="cpu", patch=True)
    assert abs(e2 - properties(atoms, fresh, False)["energy"]) < 1e-10


def test_step_options_defaults_and_errors(mace_model):
    calc = Calculator(copy.deepcopy(mace_model), device="cpu", patch=True, warmup=False)
    assert calc.inert_edges_reason is None, "the test model's edges beyond the cutoff contribute zero"
    assert calc.cuda_graph is False and calc.step.filter_edges and not calc.step.padded  # CPU: eager, exact
    whole = Calculator(copy.deepcopy(mace_model), device="cpu", patch=True, warmup=False, filter_edges=False)
    atoms = periodic_box()
    got, ref = properties(atoms, whole, True), properties(atoms, calc, True)
    assert whole.n_edges > calc.n_edges, "the whole Verlet list (skin edges too) went to the model"
    assert_close(got, ref, 1e-12)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cuda_graph=True needs a CUDA device"):
            Calculator(copy.deepcopy(mace_model), device="cpu", cuda_graph=True, warmup=False)
    with pytest.raises(ValueError, match="margin"):
        type(calc.step)(calc.adapter, calc.neighbours, margin=-1.0)


# ---------------------------------------------------------------------------------------------
# Bad input


def test_unknown_element_is_named(mace_calc):
    atoms = periodic_box()
    atoms.numbers[[0, 5]] = [11, 17]  # Na, Cl
    atoms.calc = mace_calc
    with pytest.raises(UnknownElementError, match=r"Na, Cl.*knows H, O"):
        atoms.get_potential_energy()


def test_bad_inputs_give_clear_errors(mace_calc, tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        Calculator(tmp_path / "missing.model", device="cpu")
    corrupt = tmp_path / "corrupt.model"
    corrupt.write_bytes(b"PK\x03\x04 this is not a torch file" * 10)
    with pytest.raises(ValueError, match="corrupt.model"):
        Calculator(corrupt, device="cpu")
    with pytest.raises(TypeError, match="model"):
        Calculator(torch.nn.Linear(3, 3), device="cpu")
    with pytest.raises(TypeError, match="model"):
        Calculator(42, device="cpu")
    with pytest.raises(ValueError, match="device"):
        Calculator("whatever.model", device="tpu")
    with pytest.raises(ValueError, match="skin"):
        Calculator(mace_calc.model, device="cpu", skin=-1.0)
    empty = Atoms(cell=np.eye(3) * 5, pbc=True)
    empty.calc = mace_calc
    with pytest.raises(ValueError, match="empty"):
        empty.get_potential_energy()
    nan = periodic_box()
    nan.positions[2, 1] = np.nan
    nan.calc = mace_calc
    with pytest.raises(ValueError, match="NaN"):
        nan.get_forces()
    cluster = molecule()
    cluster.calc = mace_calc
    with pytest.raises(PropertyNotImplementedError, match="stress"):
        cluster.get_stress()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_without_gpu_is_a_clear_error(mace_model):
    with pytest.raises(ValueError, match="CUDA is not available"):
        Calculator(copy.deepcopy(mace_model), device="cuda")


def test_missing_bundled_model_fails_only_when_asked(monkeypatch, mace_model, tmp_path):
    from cgforge.plugin.runtime import bundled

    monkeypatch.setattr(bundled, "MODELS_DIR", tmp_path)  # as in an installation that lost its models
    Calculator(copy.deepcopy(mace_model), device="cpu", warmup=False)  # unaffected
    with pytest.raises(FileNotFoundError, match="bundled mace model not found at .*reinstall cgforge"):
        Calculator("mace", device="cpu")


# ---------------------------------------------------------------------------------------------
# NequIP


def nequip_reference(model: torch.nn.Module):
    from nequip.data.transforms import ChemicalSpeciesToAtomTypeMapper, NeighborListTransform
    from nequip.integrations.ase import NequIPCalculator

    return NequIPCalculator(copy.deepcopy(model), device="cpu", transforms=[
        ChemicalSpeciesToAtomTypeMapper(model_type_names=["H", "O"],
                                        chemical_species_to_atom_type_map={"H": "H", "O": "O"}),
        NeighborListTransform(r_max=3.0)])


@pytest.mark.parametrize("dtype", ["float64", pytest.param("float32", marks=pytest.mark.slow)])
def test_nequip_matches_nequip_calculator(nequip_state, dtype):
    model = nequip_model(dtype)
    ref_calc = nequip_reference(model)
    ours = Calculator(copy.deepcopy(model), device="cpu", patch=True)
    tol = 1e-10 if dtype == "float64" else 1e-5
    for name in ("periodic", "triclinic", "molecule"):
        atoms = STRUCTURES[name]()
        with_stress = name != "molecule"
        assert_close(properties(atoms, ours, with_stress), properties(atoms, ref_calc, with_stress), tol)


@pytest.mark.slow
def test_nequip_package_file_forces_and_stress(nequip_state, tmp_path):
    from cgforge.patches.nequip import save_patched_nequip

    model = nequip_model("float64", l_max=1)
    path = save_patched_nequip(copy.deepcopy(model), tmp_path / "water.nequip.zip")
    calc = Calculator(path, device="cpu", patch=True)
    atoms = triclinic_box()
    got = properties(atoms, calc, True)
    assert_close(got, properties(atoms, nequip_reference(model), True), 1e-10)
    assert np.abs(got["stress"] - stress_by_finite_differences(calc, atoms)).max() < 1e-5 * np.abs(got["stress"]).max()
    spy = EnergySpy(calc)
    a = periodic_box()
    a.calc = calc
    a.get_forces()
    assert spy.calls[-1]["cell_grad"] is False and "stress" not in calc.results
    a.numbers[0] = 6
    with pytest.raises(UnknownElementError, match=r"\bC\b.*knows H, O"):
        a.get_forces()


# ---------------------------------------------------------------------------------------------
# CUDA


@cuda
@pytest.mark.parametrize("name", ["periodic", "triclinic", "molecule"])
def test_cuda_matches_mace_calculator_fp64(mace_model, name):
    from mace.calculators import MACECalculator

    atoms = STRUCTURES[name]()
    with_stress = name != "molecule"
    ref = properties(atoms, MACECalculator(models=copy.deepcopy(mace_model), device="cpu", default_dtype="float64"),
                     with_stress)
    calc = Calculator(copy.deepcopy(mace_model), device="cuda")
    assert calc.device.type == "cuda"
    assert_close(properties(atoms, calc, with_stress), ref, 1e-9)
    if with_stress:
        fd = stress_by_finite_differences(calc, atoms)
        assert np.abs(ref["stress"] - fd).max() < 1e-5 * np.abs(ref["stress"]).max()


@cuda
def test_cuda_default_device_and_verlet_reuse(mace_model):
    calc = Calculator(copy.deepcopy(mace_model), skin=0.4)
    assert calc.device.type == "cuda"
    fresh = Calculator(copy.deepcopy(mace_model), device="cpu", patch=True, skin=0.0)
    atoms = periodic_box()
    atoms.calc = calc
    rng = np.random.default_rng(3)
    for _ in range(12):
        atoms.positions = atoms.positions + rng.normal(scale=0.04, size=atoms.positions.shape)
        forces = atoms.get_forces()
    assert 1 < calc.neighbours.n_builds < 12
    assert rel_err(forces, properties(atoms, fresh, False)["forces"]) < 1e-9


def forbid_compiling(monkeypatch) -> None:
    """From now on NVRTC is out of reach: `compiler.compile_cubin` raises, and so does every other name in
    cgforge's modules bound to it at import (``from .compiler import compile_cubin``, which a patch of the
    compiler's attribute alone would miss), and the compiler's own NVRTC call."""
    from cgforge.kernels.core import compiler

    def no_compiling(*args, **kwargs):
        raise AssertionError("a kernel was compiled after the calculator was built")

    original = compiler.compile_cubin
    bound = {id(m): m for name, m in list(sys.modules.items())
             if name.startswith("cgforge") and getattr(m, "compile_cubin", None) is original}
    for module in bound.values():
        monkeypatch.setattr(module, "compile_cubin", no_compiling)
    monkeypatch.setattr(compiler, "_compile_with_nvrtc", no_compiling)


@cuda
def test_cuda_kernels_compile_at_construction(mace_model, monkeypatch):
    from cgforge.kernels.core import registry, runtime

    calc = Calculator(copy.deepcopy(mace_model), device="cuda", dtype="float32")
    forbid_compiling(monkeypatch)
    load_source = getattr(registry, "load_source", None) or runtime.load_source
    for compile_through in (lambda: load_source("__global__ void k() {}", ["k"]),
                            lambda: registry.compile_source("__global__ void k() {}", "k", runtime.device_arch())):
        with pytest.raises(AssertionError, match="compiled after"):  # every path to NVRTC is closed
            compile_through()
    atoms = water_box(64, seed=9)
    atoms.calc = calc
    atoms.get_forces()
    atoms.get_stress()


@cuda
def test_cuda_steps_are_captured_by_default(mace_model):
    calc = Calculator(copy.deepcopy(mace_model), device="cuda", skin=0.5)
    assert calc.cuda_graph and calc.step.padded
    cpu = Calculator(copy.deepcopy(mace_model), device="cpu", patch=True, skin=0.0, warmup=False)
    atoms = triclinic_box()
    rng = np.random.default_rng(5)
    for _ in range(4):
        atoms.positions = atoms.positions + rng.normal(scale=0.03, size=atoms.positions.shape)
        assert_close(properties(atoms, calc, True), properties(atoms, cpu, True), 1e-9)
    assert calc.step.capture_error is None
    # one graph per property set asked for: energy with forces, per-atom energies, stress (and any recaptures)
    assert (True, True, False) in calc.step._graphs and calc.step.n_captures >= 3
    assert calc.step.capacity >= calc.n_edges


@cuda
def test_cuda_nequip_matches_nequip_calculator(nequip_state):
    model = nequip_model("float64")
    atoms = triclinic_box()
    ref = properties(atoms, nequip_reference(model), True)
    assert_close(properties(atoms, Calculator(copy.deepcopy(model), device="cuda"), True), ref, 1e-9)
