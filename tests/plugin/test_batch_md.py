"""Batched MD (``plugin.batch_md.run_md_batch``): each structure of a batch moves as the device engine moves it
alone (NVE, NVT Langevin with its own temperature, friction and seed), its noise is its own whatever the batch,
bad input is refused early with the argument named, and the padded force call (``runtime.batch_capture``,
captured on CUDA) gives what the eager batch step gives."""

from __future__ import annotations

import numpy as np
import pytest
import test_batch
import torch
from ase import Atoms, units
from ase.build import molecule

from cgforge.plugin import BatchStructureError, EngineOptions, run_md_batch
from cgforge.plugin.md.engine import Engine
from cgforge.plugin.md.integrators import (
    CSVR,
    Langevin,
    NoiseSource,
    StochasticCellRescaling,
    SystemNoise,
    VelocityVerlet,
)
from cgforge.plugin.water import water_box

mace_calc = test_batch.mace_calc  # the fixture: the bundled MACE in FP64 on the CPU


def structures() -> list:
    """A bent water molecule, H2 and a small periodic water box, with thermal-sized momenta (~300 K)."""
    bent = molecule("H2O")
    bent.rattle(0.1, seed=5)
    box = water_box(2, seed=3)
    box.rattle(0.05, seed=4)
    inputs = [bent, molecule("H2"), box]
    for seed, atoms in enumerate(inputs):
        noise = np.random.default_rng(seed).normal(size=(len(atoms), 3))
        atoms.set_momenta(noise * np.sqrt(atoms.get_masses() * units.kB * 300)[:, None])
    return inputs


def alone(calc, atoms, integrator, seed: int, steps: int):
    """The single-system run: the device engine on this structure alone, eager."""
    mine = atoms.copy()
    engine = Engine(calc, mine, integrator, seed=seed, cuda_graph=False, pipelined_rebuild=False)
    engine.run(steps)
    return engine.sync_atoms()


def assert_same_run(got, want) -> None:
    # to rounding: the batch's forces equal each structure's alone to ~1e-15 relative; 4 steps keep it there
    np.testing.assert_allclose(got.positions, want.positions, rtol=0, atol=1e-12)
    np.testing.assert_allclose(got.get_momenta(), want.get_momenta(), rtol=0, atol=1e-12)
    np.testing.assert_allclose(got.get_forces(), want.get_forces(), rtol=0, atol=1e-10)
    assert got.get_potential_energy() == pytest.approx(want.get_potential_energy(), abs=1e-10)


def test_batched_nve_equals_the_engine_on_each_structure(mace_calc) -> None:
    inputs = structures()
    final = run_md_batch(mace_calc, inputs, timestep_fs=0.5, steps=4)
    for atoms, got in zip(inputs, final, strict=True):
        assert_same_run(got, alone(mace_calc, atoms, VelocityVerlet(0.5), 0, 4))
    assert not np.allclose(final[2].positions, inputs[2].positions)  # they moved


def test_batched_langevin_equals_the_engine_with_each_structures_own_settings(mace_calc) -> None:
    inputs = structures()
    temperatures, frictions = [300.0, 150.0, 500.0], [0.05, 0.2, 0.01]
    before = [a.positions.copy() for a in inputs]
    final = run_md_batch(mace_calc, inputs, ensemble="nvt", timestep_fs=0.5, steps=4, temperature_K=temperatures,
                         friction=frictions, seed=7)
    for b, (atoms, got) in enumerate(zip(inputs, final, strict=True)):
        np.testing.assert_array_equal(atoms.positions, before[b])  # inputs untouched
        want = alone(mace_calc, atoms, Langevin(0.5, temperatures[b], frictions[b]), 7 + b, 4)
        assert_same_run(got, want)
    # the thermostat acted: NVE from the same start ends elsewhere
    nve = run_md_batch(mace_calc, inputs, timestep_fs=0.5, steps=4)
    assert not np.allclose(nve[2].get_momenta(), final[2].get_momenta(), atol=1e-6)


def test_batched_csvr_equals_the_engine_with_each_structures_own_settings(mace_calc) -> None:
    inputs = structures()
    temperatures, taus = [300.0, 150.0, 500.0], [20.0, 5.0, 50.0]
    final = run_md_batch(mace_calc, inputs, ensemble="nvt", thermostat="csvr", timestep_fs=0.5, steps=4,
                         temperature_K=temperatures, taut_fs=taus, seed=[3, 8, 1])
    for b, (atoms, got) in enumerate(zip(inputs, final, strict=True)):
        want = alone(mace_calc, atoms, CSVR(0.5, temperatures[b], tau_fs=taus[b]), [3, 8, 1][b], 4)
        assert_same_run(got, want)
    nve = run_md_batch(mace_calc, inputs, timestep_fs=0.5, steps=4)
    assert not np.allclose(nve[1].get_momenta(), final[1].get_momenta(), atol=1e-6)  # rescaled


def periodic_structures() -> list:
    """Two small periodic water cells with thermal-sized momenta."""
    box = structures()[2]
    other = water_box(3, seed=6)
    other.rattle(0.05, seed=1)
    other.set_momenta(np.random.default_rng(9).normal(size=(len(other), 3))
                      * np.sqrt(other.get_masses() * units.kB * 300)[:, None])
    return [box, other]


def npt_matches_the_engine(calc, atol: float) -> None:
    inputs, temperatures = periodic_structures(), [300.0, 350.0]
    final = run_md_batch(calc, inputs, ensemble="npt", timestep_fs=0.5, steps=4, temperature_K=temperatures,
                         taut_fs=20.0, pressure_bar=1.0, seed=4)
    for b, (atoms, got) in enumerate(zip(inputs, final, strict=True)):
        # cgforge md's units: 1 bar = 1e-4 GPa, the default compressibility 4.57e-5 / bar = 0.457 / GPa
        integrator = StochasticCellRescaling(0.5, temperatures[b], 1e-4, tau_fs=20.0, compressibility_per_GPa=0.457)
        want = alone(calc, atoms, integrator, 4 + b, 4)
        np.testing.assert_allclose(got.positions, want.positions, rtol=0, atol=atol)
        np.testing.assert_allclose(got.get_momenta(), want.get_momenta(), rtol=0, atol=atol)
        np.testing.assert_allclose(got.cell[:], want.cell[:], rtol=0, atol=atol)
        assert got.get_potential_energy() == pytest.approx(want.get_potential_energy(), abs=100 * atol)
        assert not np.allclose(got.cell[:], atoms.cell[:], atol=1e-6)  # the barostat moved each cell


def test_batched_npt_equals_the_engine_with_each_structures_own_cell(mace_calc) -> None:
    npt_matches_the_engine(mace_calc, 1e-12)


def test_a_structures_trajectory_does_not_depend_on_its_batch(mace_calc) -> None:
    inputs = structures()
    kwargs = {"ensemble": "nvt", "timestep_fs": 0.5, "steps": 3, "temperature_K": 300.0}
    together = run_md_batch(mace_calc, inputs, seed=[4, 9, 2], **kwargs)
    box_alone = run_md_batch(mace_calc, inputs[2:], seed=[2], **kwargs)[0]
    assert_same_run(together[2], box_alone)
    other_seeds = run_md_batch(mace_calc, inputs, seed=[5, 1, 2], **kwargs)  # the others' seeds changed
    assert_same_run(other_seeds[2], together[2])
    assert not np.allclose(other_seeds[0].get_momenta(), together[0].get_momenta(), atol=1e-6)


def test_each_systems_noise_is_what_it_draws_alone() -> None:
    step = torch.tensor(11)
    ptr, seeds = [0, 3, 4, 9], [5, 2**40 + 3, 0]
    batch = SystemNoise(seeds, ptr, step)
    for shape in ((2, 9, 3), (9, 3)):
        draws = batch(1, shape)
        for b, seed in enumerate(seeds):
            own = NoiseSource(seed, step)(1, (*shape[:-2], ptr[b + 1] - ptr[b], 3))
            assert torch.equal(draws[..., ptr[b]:ptr[b + 1], :], own)
    counts = [4, 2, 7]  # per system (CSVR's degrees of freedom)
    flat = batch.per_system(2, counts)
    for b, (seed, start) in enumerate(zip(seeds, np.cumsum([0, *counts]))):
        assert torch.equal(flat[start:start + counts[b]], NoiseSource(seed, step)(2, (counts[b],)))
    changed = SystemNoise([6, 2**40 + 3, 1], ptr, step)(1, (9, 3))
    assert torch.equal(changed[3:4], batch(1, (9, 3))[3:4])  # system 1 keeps its draws
    assert not torch.equal(changed[:3], batch(1, (9, 3))[:3])
    with pytest.raises(ValueError, match="shape"):
        batch(0, (8, 3))


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"ensemble": "nvx"}, "ensemble: expected one of nvt, nve, npt"),
    ({"ensemble": "npt", "temperature_K": 300.0}, "structure 0: NPT changes the cell and needs a periodic 3-D cell"),
    ({"ensemble": "npt", "temperature_K": 300.0, "friction": 0.1}, "friction: not for NPT"),
    ({"ensemble": "npt", "temperature_K": 300.0, "taup_fs": -5.0}, "taup_fs: expected a finite number > 0"),
    ({"ensemble": "nvt", "temperature_K": 300.0, "pressure_bar": 1.0}, r"pressure_bar: not for NVT \(langevin\)"),
    ({"ensemble": "nvt"}, "temperature_K: ensemble='nvt' needs"),
    ({"ensemble": "nvt", "temperature_K": -1.0}, "temperature_K: expected a finite number >= 0"),
    ({"ensemble": "nvt", "temperature_K": [300.0, float("nan")]}, r"temperature_K\[1\]"),
    ({"ensemble": "nvt", "temperature_K": [300.0]}, "temperature_K: expected a number or one per structure"),
    ({"ensemble": "nvt", "temperature_K": 300.0, "friction": -0.1}, "friction: expected a finite number >= 0"),
    ({"temperature_K": 300.0}, "temperature_K: not for NVE"),
    ({"ensemble": "nvt", "temperature_K": 300.0, "thermostat": "nose"}, "thermostat: expected one of langevin, csvr"),
    ({"ensemble": "nvt", "temperature_K": 300.0, "thermostat": "csvr", "friction": 0.1},
     r"friction: not for NVT \(csvr\)"),
    ({"ensemble": "nvt", "temperature_K": 300.0, "taut_fs": 50.0}, r"taut_fs: not for NVT \(langevin\)"),
    ({"ensemble": "nvt", "temperature_K": 300.0, "thermostat": "csvr", "taut_fs": 0.0},
     "taut_fs: expected a finite number > 0"),
    ({"seed": -1}, "seed: expected an int >= 0"),
    ({"seed": [1, 2, 3]}, "seed: expected an int or one per structure"),
    ({"timestep_fs": 0.0}, "timestep_fs: expected a finite number > 0"),
    ({"steps": -2}, "steps: expected an int >= 0"),
    ({"engine_options": {"cuda_graph": True}}, "cuda_graph=True needs a CUDA device, got cpu"),
    ({"engine_options": {"cuda_graph": "on"}}, "cuda_graph: expected None, True or False"),
    ({"ensemble": "npt", "temperature_K": 300.0, "engine_options": {"padded": True}},
     "padded=True: NPT changes every cell"),
    ({"engine_options": {"block": 5}}, "engine_options: block=5 has no effect on run_md_batch, which reads cuda_graph"),
    ({"engine_options": {"graph": True}}, "engine_options: unknown key 'graph'"),
])
def test_bad_arguments_are_named(mace_calc, kwargs, match) -> None:
    options = {"timestep_fs": 0.5, "steps": 1, **kwargs}
    with pytest.raises((TypeError, ValueError), match=match):
        run_md_batch(mace_calc, [molecule("H2O"), molecule("H2")], **options)


def test_the_renamed_keywords_warn_and_still_work(mace_calc) -> None:
    inputs = [molecule("H2O"), molecule("H2")]
    with pytest.warns(FutureWarning, match=r"run_md_batch\(padded=\) is now run_md_batch\(engine_options="):
        old = run_md_batch(mace_calc, inputs, timestep_fs=0.5, steps=3, padded=True)
    assert mace_calc.potential.batch_step().padded is not None  # the padded step ran
    new = run_md_batch(mace_calc, inputs, timestep_fs=0.5, steps=3, engine_options={"padded": True})
    for a, b in zip(old, new, strict=True):
        assert np.array_equal(a.positions, b.positions)
    with pytest.raises(TypeError, match="give cuda_graph inside engine_options, not beside it"):
        run_md_batch(mace_calc, inputs, timestep_fs=0.5, steps=1, cuda_graph=False, engine_options={})
    with pytest.raises(TypeError, match="unexpected keyword argument 'graph'"):
        run_md_batch(mace_calc, inputs, timestep_fs=0.5, steps=1, graph=False)


@pytest.mark.parametrize("padded", [False, True])
def test_a_structure_that_blows_up_is_named(mace_calc, padded: bool) -> None:
    inputs = structures()
    inputs[1].set_momenta([[0, 0, -1.5], [0, 0, 1.5]])  # H2's atoms (0 above 1) thrown at each other
    with pytest.raises(BatchStructureError, match="structure 1: atoms 0 and 1 are") as err:
        run_md_batch(mace_calc, inputs, timestep_fs=1.0, steps=5, engine_options={"padded": padded})
    assert err.value.index == 1


@pytest.mark.parametrize("padded", [False, True])
def test_nan_from_the_model_or_in_the_momenta_is_named(mace_calc, padded: bool) -> None:
    inputs = structures()
    inputs[1].positions[1] = inputs[1].positions[0]  # a zero-length edge: NaN (min_distance off lets it through)
    with pytest.raises(BatchStructureError, match="structure 1: the model returned NaN or inf at step 0") as err:
        run_md_batch(mace_calc, inputs, timestep_fs=0.5, steps=2, min_distance=None,
                     engine_options={"padded": padded})
    assert err.value.index == 1
    inputs = structures()
    momenta = inputs[2].get_momenta()
    momenta[3, 1] = np.nan
    inputs[2].set_momenta(momenta)
    with pytest.raises(BatchStructureError, match="structure 2: momenta contain NaN"):
        run_md_batch(mace_calc, inputs, timestep_fs=0.5, steps=2, engine_options={"padded": padded})


@pytest.mark.cuda
@pytest.mark.parametrize("thermostat", ["langevin", "csvr"])
def test_batched_nvt_on_cuda_equals_the_engine_on_each_structure(thermostat: str) -> None:
    """On CUDA the engine draws through the noise kernel (and Langevin steps through md_step's kernels); the
    batch through the torch expressions of both: equal to rounding."""
    from cgforge.plugin import Calculator

    calc = Calculator("mace", device="cuda", dtype="float64", skin=0.5)
    inputs = structures()
    final = run_md_batch(calc, inputs, ensemble="nvt", thermostat=thermostat, timestep_fs=0.5, steps=4,
                         temperature_K=300.0, seed=3)
    for b, (atoms, got) in enumerate(zip(inputs, final, strict=True)):
        integrator = Langevin(0.5, 300.0, 0.01) if thermostat == "langevin" else CSVR(0.5, 300.0)
        want = alone(calc, atoms, integrator, 3 + b, 4)
        np.testing.assert_allclose(got.positions, want.positions, rtol=0, atol=1e-10)
        np.testing.assert_allclose(got.get_momenta(), want.get_momenta(), rtol=0, atol=1e-10)
        assert got.get_potential_energy() == pytest.approx(want.get_potential_energy(), abs=1e-8)


@pytest.mark.cuda
def test_batched_npt_on_cuda_equals_the_engine_on_each_structure() -> None:
    from cgforge.plugin import Calculator

    npt_matches_the_engine(Calculator("mace", device="cuda", dtype="float64", skin=0.5), 1e-10)


# --- the padded (captured on CUDA) force call ----------------------------------------------------------------------

def water_cluster(spread: float) -> Atoms:
    """Six water molecules without a cell, their centres ``spread`` times their places in a small box apart."""
    box = water_box(6, seed=2)
    positions = box.positions.reshape(6, 3, 3)
    centres = positions[:, :1]
    cluster = Atoms(box.numbers, positions=(positions + (spread - 1) * centres).reshape(-1, 3))
    cluster.rattle(0.02, seed=1)
    return cluster


def test_the_padded_step_equals_the_batch_step_through_rebuilds_and_growths(mace_calc) -> None:
    from cgforge.plugin.batch import as_structure
    from cgforge.plugin.runtime.batch import BatchStep
    from cgforge.plugin.runtime.batch_capture import PaddedBatchStep

    potential = mace_calc.potential
    box = structures()[2]
    batch = [water_cluster(3.0), box]  # molecules 9 Å apart (no edge between them), a small periodic cell
    parts = [as_structure(a) for a in batch]
    ptr = np.cumsum([0, *(len(a) for a in batch)]).tolist()
    cells, pbcs = np.stack([p.cell for p in parts]), [p.pbc for p in parts]
    numbers = np.concatenate([p.numbers for p in parts])
    eager = BatchStep(potential.adapter, 0.5)  # its own lists: the reference
    padded = PaddedBatchStep(BatchStep(potential.adapter, 0.5), cells, pbcs, ptr, eager.species(numbers, ptr),
                             cuda_graph=False, inert_edges_reason=None)

    def check(positions: np.ndarray) -> None:
        x = torch.as_tensor(positions)
        got = padded.run(x)
        want = eager.run(x, cells, pbcs, ptr, eager.species(numbers, ptr))
        assert padded.finite
        np.testing.assert_allclose(got.energy.numpy(), want.energy.numpy(), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(got.forces.numpy(), want.forces.numpy(), rtol=0,
                                   atol=1e-12 * float(want.forces.abs().max()))
        assert padded.capacity >= eager.n_edges  # the padded layout holds every edge, and more slots

    x0 = np.concatenate([a.positions for a in batch])
    check(x0)
    assert (padded.n_rebuilds, padded.n_growths, padded.n_reruns) == (1, 0, 0)
    x1 = x0 + np.random.default_rng(0).normal(scale=0.01, size=x0.shape)  # far within skin / 2: the list stands
    check(x1)
    assert padded.n_rebuilds == 1
    x2 = x1.copy()
    x2[ptr[1] + 2] += [0.3, 0.0, 0.0]  # an atom of the box 0.3 Å away, unforeseen: searched again, step run again
    check(x2)
    assert (padded.n_rebuilds, padded.n_growths, padded.n_reruns) == (2, 0, 1)
    x3 = x2.copy()
    x3[:ptr[1]] = water_cluster(1.0).positions  # the molecules together: the list and the edges outgrow their room
    check(x3)  # searched before the step (after a jump of 0.3 Å every list was due), not run again
    assert padded.n_rebuilds == 3 and padded.n_growths >= 1 and padded.n_reruns == 1
    check(x3)  # searched again: the cluster jumped; nothing moved since
    rebuilds, growths = padded.n_rebuilds, padded.n_growths
    padded.capacity = 64  # as if edges had come within the cutoff since the search
    check(x3)  # the layout overflowed: grown, and the step run again
    assert padded.n_growths == growths + 1 and padded.capacity > 64 and padded.n_rebuilds == rebuilds


def test_padded_nve_equals_the_eager_batch_step(mace_calc) -> None:
    inputs = structures()
    eager = run_md_batch(mace_calc, inputs, timestep_fs=0.5, steps=20)
    assert mace_calc.potential.batch_step().padded is None  # on a CPU: eager unless asked for
    padded = run_md_batch(mace_calc, inputs, timestep_fs=0.5, steps=20, engine_options=EngineOptions(padded=True))
    step = mace_calc.potential.batch_step().padded
    assert step.n_rebuilds > 2 and step.n_captures == 0  # the lists moved on; nothing captured on a CPU
    assert step.n_reruns <= step.n_rebuilds // 3  # most searches foreseen: before their step, not after it
    for got, want in zip(padded, eager, strict=True):
        assert_same_run(got, want)


@pytest.mark.cuda
@pytest.mark.parametrize("ensemble", ["nve", "nvt"])
def test_the_captured_batch_md_equals_the_eager_one_on_cuda(ensemble: str) -> None:
    """FP32, the bundled MACE: the captured force call (the default on CUDA) and the eager one agree to FP32
    rounding over a run whose lists are searched again several times (a dozen on a CPU), with one capture."""
    from cgforge.plugin import Calculator

    calc = Calculator("mace", device="cuda", dtype="float32", skin=0.5)
    inputs = structures() + periodic_structures()[1:]
    kwargs = {"ensemble": ensemble, "timestep_fs": 1.0, "steps": 20, "seed": 2,
              "temperature_K": 300.0 if ensemble == "nvt" else None}
    captured = run_md_batch(calc, inputs, **kwargs)
    step = calc.potential.batch_step().padded
    assert step.cuda_graph and step.capture_error is None
    assert step.n_captures == 1 and step.n_rebuilds > 3
    eager = run_md_batch(calc, inputs, engine_options={"cuda_graph": False}, **kwargs)
    assert calc.potential.batch_step().padded is None
    # FP32 on a CPU, padded against eager: ~3e-7 Å, ~5e-6 of the largest force, ~3e-6 eV after these 20 steps
    scale = max(np.abs(a.get_forces()).max() for a in eager)
    for got, want in zip(captured, eager, strict=True):
        np.testing.assert_allclose(got.positions, want.positions, rtol=0, atol=1e-4)
        np.testing.assert_allclose(got.get_forces(), want.get_forces(), rtol=0, atol=1e-3 * scale)
        assert got.get_potential_energy() == pytest.approx(want.get_potential_energy(), abs=1e-4)
