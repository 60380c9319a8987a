"""cgforge's TorchSim model (``plugin.torchsim``): a SimState's systems give what ``evaluate_batch`` gives, in
TorchSim's shapes and units, and TorchSim's integrator and FIRE run over it.

torch-sim-atomistic needs Python >= 3.12: its tests run where it imports (the GPU machine) and skip elsewhere;
the forward pass itself is tested everywhere over a stand-in for TorchSim's base class and state."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from ase import Atoms
from ase.build import molecule

from cgforge.plugin import BatchStructureError, FireParameters, evaluate_batch, relax_batch
from cgforge.plugin.torchsim import _class_over, torchsim_model, torchsim_model_class
from cgforge.plugin.water import water_box

NO_TORCHSIM = "torch-sim-atomistic (Python >= 3.12) is not installed here"


def periodic() -> list[Atoms]:
    box = water_box(8, seed=1)
    box.rattle(0.05, seed=2)
    skewed = water_box(2, seed=3)
    skewed.set_cell(np.asarray(skewed.cell) + [[0, 0, 0], [1.0, 0, 0], [0.5, 0.7, 0]], scale_atoms=True)
    return [box, skewed, water_box(4, seed=4)]


def molecules() -> list[Atoms]:
    free = molecule("H2O")
    free.positions += 30.0
    return [free, molecule("H2"), molecule("H2O")]


def stand_in_state(atoms_list: list[Atoms]) -> SimpleNamespace:
    """What the model reads of a TorchSim SimState, as ``ts.io.atoms_to_state`` builds it (cell as columns)."""
    cell = torch.tensor(np.stack([a.cell.array.T for a in atoms_list]))
    return SimpleNamespace(
        positions=torch.tensor(np.concatenate([a.positions for a in atoms_list])), row_vector_cell=cell.mT,
        pbc=torch.tensor(atoms_list[0].pbc),
        atomic_numbers=torch.tensor(np.concatenate([a.numbers for a in atoms_list])),
        system_idx=torch.repeat_interleave(torch.arange(len(atoms_list)), torch.tensor([len(a) for a in atoms_list])))


@pytest.fixture(scope="module")
def potential():
    from cgforge.plugin.runtime.potential import load

    return load("mace", "cpu", "float64", warmup=False, skin=0.5)


def assert_matches_evaluate_batch(out: dict, potential, atoms_list: list[Atoms], system_idx: torch.Tensor) -> None:
    """Energies, forces and stresses (virial / volume, zero without a volume) equal evaluate_batch's to 1e-10."""
    n = sum(len(a) for a in atoms_list)
    assert out["energy"].shape == (len(atoms_list),) and out["forces"].shape == (n, 3)
    assert out["stress"].shape == (len(atoms_list), 3, 3)
    assert not any(t.requires_grad for t in out.values())
    want = evaluate_batch(potential, atoms_list, stress=True)
    for b, (atoms, ref) in enumerate(zip(atoms_list, want, strict=True)):
        scale = max(abs(ref.energy), 1.0)
        assert float(out["energy"][b]) == pytest.approx(ref.energy, rel=1e-10, abs=1e-10 * scale)
        forces = out["forces"][system_idx == b].cpu().double().numpy()
        np.testing.assert_allclose(forces, ref.forces, rtol=1e-10, atol=1e-10 * np.abs(ref.forces).max())
        volume = abs(atoms.cell.volume)
        stress = out["stress"][b].cpu().double().numpy()
        if volume > 0:
            want_stress = ref.virial / volume
            np.testing.assert_allclose(stress, want_stress, rtol=1e-10, atol=1e-10 * np.abs(want_stress).max())
            assert np.abs(stress).max() > 0
        else:
            assert not stress.any()


def test_without_torch_sim_the_error_names_the_package(monkeypatch) -> None:
    for name in ("torch_sim", "torch_sim.models", "torch_sim.models.interface"):
        monkeypatch.setitem(sys.modules, name, None)  # import of these names fails, as when not installed
    with pytest.raises(ImportError, match=r"torch-sim-atomistic \(Python >= 3\.12"):
        torchsim_model("mace", device="cpu")
    with pytest.raises(ImportError, match="torch-sim-atomistic"):
        torchsim_model_class()


class _StandIn(torch.nn.Module):
    """In place of TorchSim's ModelInterface where it does not import."""


@pytest.mark.parametrize("group", [periodic, molecules])
def test_forward_gives_evaluate_batch_results(potential, group) -> None:
    model = _class_over(_StandIn)(potential)
    atoms_list = group()
    state = stand_in_state(atoms_list)
    positions = state.positions.clone()
    out = model(state)
    assert torch.equal(state.positions, positions)
    assert_matches_evaluate_batch(out, potential, atoms_list, state.system_idx)
    model.compute_stress = False
    model.compute_forces = False
    assert set(model(state)) == {"energy"}


def test_a_bad_state_or_option_is_named(potential) -> None:
    model = _class_over(_StandIn)(potential)
    state = stand_in_state(periodic())
    state.system_idx = state.system_idx.flip(0)
    with pytest.raises(ValueError, match="non-decreasing"):
        model(state)
    crowded = water_box(2, seed=5)
    crowded.positions[1] = crowded.positions[0] + 0.1
    with pytest.raises(BatchStructureError, match="structure 1: atoms 0 and 1"):
        model(stand_in_state([water_box(2, seed=6), crowded]))
    with pytest.raises(ValueError, match="dtype: float32 given"):
        _class_over(_StandIn)(potential, dtype="float32")
    with pytest.raises(ValueError, match="skin: loading options"):
        _class_over(_StandIn)(potential, skin=0.3)


@pytest.fixture(scope="module")
def ts():
    return pytest.importorskip("torch_sim", reason=NO_TORCHSIM)


def test_a_torchsim_state_gives_evaluate_batch_results(ts, potential) -> None:
    model = torchsim_model(potential)
    assert isinstance(model, ts.models.interface.ModelInterface)
    assert model.device == torch.device("cpu") and model.dtype == torch.float64
    for atoms_list in (periodic(), molecules()):  # a TorchSim state has one pbc for all its systems
        state = ts.io.atoms_to_state(atoms_list, device=model.device, dtype=model.dtype)
        assert_matches_evaluate_batch(model(state), potential, atoms_list, state.system_idx)


@pytest.mark.filterwarnings("ignore:All systems have reached the maximum number of steps")  # 10 FIRE steps
def test_torchsim_nvt_langevin_and_fire_run(ts, potential) -> None:
    model = torchsim_model(potential)
    start = periodic()
    final = ts.integrate(system=start, model=model, integrator=ts.Integrator.nvt_langevin, n_steps=3,
                         temperature=300.0, timestep=0.0005)
    assert final.n_systems == len(start)
    moved = final.positions - ts.io.atoms_to_state(start, model.device, model.dtype).positions
    assert float(moved.abs().max()) > 1e-4
    assert_matches_evaluate_batch(model(final), potential, ts.io.state_to_atoms(final), final.system_idx)

    before = torch.tensor([r.energy for r in evaluate_batch(potential, start)])
    relaxed = ts.optimize(system=start, model=model, optimizer=ts.Optimizer.fire, max_steps=10,
                          convergence_fn=ts.generate_force_convergence_fn(force_tol=0.05), autobatcher=False)
    after = model(relaxed)["energy"]
    assert (after < before).all(), (after, before)


def test_the_torchsim_fire_variant_is_torchsims_fire(ts, potential) -> None:
    """``relax_batch(fire=FireParameters(variant="torchsim"))`` moves the atoms as TorchSim's FIRE (``ase_fire``, its
    defaults) moves them over cgforge's model, step for step (FP64, 1e-8 Å after 30 steps, periodic images
    allowed); ASE's order, the default, does not."""
    start, steps = periodic(), 30
    model = torchsim_model(potential)
    state = ts.optimizers.fire_init(ts.io.atoms_to_state(start, model.device, model.dtype), model)
    for _ in range(steps):
        state = ts.optimizers.fire_step(state, model)
    theirs = ts.io.state_to_atoms(state)

    def apart(runs: dict) -> float:
        worst = 0.0
        for i, atoms in enumerate(theirs):
            delta = runs[i].atoms.positions - atoms.positions
            frac = delta @ np.linalg.inv(atoms.cell.array)
            worst = max(worst, float(np.abs((frac - np.round(frac)) @ atoms.cell.array).max()))
        return worst

    variant = FireParameters(variant="torchsim")
    ours = {d.index: d for d in relax_batch(potential, start, fmax=1e-9, steps=steps, batch_size=3, fire=variant)}
    assert all(d.steps == steps for d in ours.values())
    assert apart(ours) < 1e-8, apart(ours)
    default = {d.index: d for d in relax_batch(potential, start, fmax=1e-9, steps=steps, batch_size=3)}
    assert apart(default) > 1e-6, apart(default)


@pytest.mark.cuda
def test_torchsim_nvt_on_the_gpu_with_cgforge_kernels(ts) -> None:
    model = torchsim_model("mace", device="cuda", dtype="float32")
    start = periodic()
    final = ts.integrate(system=start, model=model, integrator=ts.Integrator.nvt_langevin, n_steps=20,
                         temperature=300.0, timestep=0.0005)
    out = model(final)
    want = evaluate_batch(model.potential, ts.io.state_to_atoms(final))
    np.testing.assert_allclose(out["energy"].cpu().numpy(), [r.energy for r in want], rtol=1e-5, atol=1e-4)
