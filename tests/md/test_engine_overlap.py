"""Overlapped blocks (``Engine(overlap_blocks=True)``: the next block queued before the last one's report is read)
against the engine waiting for each report: the same trajectory bit for bit, the same callbacks at the same steps,
the same blow-ups and the same restart state. On a CPU the same logic runs in sequence (blocks taken back, reports
read one block late); (CUDA) with captured steps, a side-stream search and buffers that overflow."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ase.md.velocitydistribution import MaxwellBoltzmannDistribution, Stationary
from engine_potentials import argon_box, harmonic_tethers, lennard_jones, oscillators

from cgforge.plugin import Calculator
from cgforge.plugin.md.engine import Engine, MDBlowUp, energy_function_engine
from cgforge.plugin.md.integrators import CSVR, Langevin, StochasticCellRescaling, VelocityVerlet
from cgforge.plugin.water import water_box

pytestmark = pytest.mark.usefixtures("fp64_one_thread")
cuda = pytest.mark.cuda
STATE = ("positions", "momenta", "forces", "energy", "virial", "cell", "step")


def assert_same_run(a: Engine, b: Engine) -> None:
    """Bit for bit: the state on the device, the host's step and what a restart saves."""
    assert a.step == b.step == int(a.state.step) == int(b.state.step)
    for name in STATE:
        assert torch.equal(getattr(a.state, name), getattr(b.state, name)), name
    for name, value in a.state.extra.items():
        assert torch.equal(b.state.extra[name], value), name
    da, db = a.state_dict(), b.state_dict()
    assert da.keys() == db.keys()
    for key, value in da.items():
        assert np.array_equal(value, db[key]) if isinstance(value, np.ndarray) else value == db[key], key


def observed(engine: Engine, steps: int, every: int) -> list[tuple]:
    seen: list[tuple] = []
    engine.run(steps, every=every, callback=lambda e: seen.append(
        (e.step, e.atoms.positions.copy(), e.atoms.get_momenta().copy(), e.atoms.get_potential_energy())))
    return seen


def assert_same_callbacks(a: list[tuple], b: list[tuple]) -> None:
    assert [s[0] for s in a] == [s[0] for s in b] and a
    for x, y in zip(a, b, strict=True):
        assert np.array_equal(x[1], y[1]) and np.array_equal(x[2], y[2]) and x[3] == y[3]


def test_option_is_checked_and_off_by_default_on_a_cpu():
    atoms = argon_box()
    assert not energy_function_engine(lennard_jones(), atoms, VelocityVerlet(1.0)).overlap_blocks
    with pytest.raises(TypeError, match="overlap_blocks: expected None, True or False, got 1"):
        energy_function_engine(lennard_jones(), atoms, VelocityVerlet(1.0), overlap_blocks=1)


@pytest.mark.parametrize("integrator", [lambda: CSVR(4.0, 120.0, 50.0),
                                        lambda: StochasticCellRescaling(4.0, 120.0, 0.05, tau_p_fs=200.0)])
def test_overlapped_blocks_give_the_same_run_callbacks_and_restart(integrator):
    lj, atoms = lennard_jones(), argon_box(seed=3)
    runs, seen = [], []
    for overlap in (False, True):
        engine = energy_function_engine(lj, atoms.copy(), integrator(), seed=9, block=4, overlap_blocks=overlap)
        seen.append(observed(engine, 23, every=7))
        engine.run(6)  # no callbacks: the last report is read before run returns
        runs.append(engine)
    plain, overlapped = runs
    assert overlapped.stats["overlapped_blocks"] >= 3 and plain.stats["overlapped_blocks"] == 0, overlapped.stats
    assert [s[0] for s in seen[1]] == [7, 14, 21]
    assert_same_callbacks(*seen)
    assert_same_run(plain, overlapped)
    assert overlapped.stats["steps"] == 29 and overlapped.stats["discarded"] == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_a_blow_up_in_an_overlapped_block_stops_where_it_did(overlap):
    lj, atoms = lennard_jones(), argon_box()
    atoms.positions[1] = atoms.positions[0] + [2.6, 0.0, 0.0]  # on the repulsive wall: hot after ~10 steps
    errors, engines = [], []
    for flag in (False, overlap):
        engine = energy_function_engine(lj, atoms.copy(), VelocityVerlet(4.0), max_temperature_K=300.0, block=3,
                                        overlap_blocks=flag)
        with pytest.raises(MDBlowUp) as info:
            engine.run(50)
        errors.append(info.value)
        engines.append(engine)
    (a, b), (plain, other) = errors, engines
    assert (a.step, a.quantity, a.value) == (b.step, b.quantity, b.value) and a.step > 4  # not in the first block
    assert other.step == a.step - 1
    if overlap:
        assert other.stats["taken_back"] == 1, other.stats  # the block queued after the failing one
    assert_same_run(plain, other)


def test_a_non_finite_energy_in_an_overlapped_run_names_the_same_step():
    atoms = oscillators(4)
    tethers = harmonic_tethers(atoms.positions.copy())

    def energy(positions, cell):
        e = tethers(positions, cell)
        return e * float("nan") if bool(positions[0, 0] > atoms.positions[0, 0] + 1e-3) else e

    atoms.set_momenta(np.full((4, 3), 0.05))
    steps = []
    for overlap in (False, True):
        engine = energy_function_engine(energy, atoms.copy(), VelocityVerlet(1.0), block=2, overlap_blocks=overlap)
        with pytest.raises(MDBlowUp, match="energy nan") as info:
            engine.run(40)
        steps.append((info.value.step, engine.step))
    assert steps[0] == steps[1] and steps[0][0] > 2


@pytest.fixture(scope="module")
def calc64() -> Calculator:
    return Calculator("mace", device="cpu", dtype="float64", skin=0.25)


@pytest.mark.slow
def test_overlapped_blocks_with_the_model_and_stale_lists_change_no_bit(calc64):
    """24 atoms at 600 K, a 0.25 Å skin: lists go stale inside blocks and are rebuilt (pipelined: searched during a
    block). Overlapped, the next block is planned one report late: its stale steps are discarded and redone, and a
    block after a failing one is taken back; every committed step is the same, to the bit."""
    atoms = water_box(8, seed=0)
    MaxwellBoltzmannDistribution(atoms, temperature_K=600.0, rng=np.random.default_rng(0))
    Stationary(atoms)
    runs = []
    for overlap in (False, True):
        a = atoms.copy()
        a.calc = calc64
        engine = Engine(calc64, a, Langevin(1.0, 600.0, 0.02), seed=3, block=5, pipelined_rebuild=True,
                        overlap_blocks=overlap)
        engine.run(16)
        runs.append(engine)
    plain, overlapped = runs
    assert plain.stats["rebuilds"] >= 3 and overlapped.stats["taken_back"] >= 1, overlapped.stats
    assert_same_run(plain, overlapped)


# ---------------------------------------------------------------------------------------------
# CUDA (the lead runs these on the GPU machine)


def _water(molecules: int, temperature_K: float, seed: int):
    atoms = water_box(molecules, seed=seed)
    MaxwellBoltzmannDistribution(atoms, temperature_K=temperature_K, rng=np.random.default_rng(seed))
    Stationary(atoms)
    return atoms


@pytest.fixture
def cuda_calc():
    """A fresh FP32 calculator per run: the step's buffers and their growth history start alike."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return lambda: Calculator("mace", device="cuda", dtype="float32")


def _pair(make_calc, atoms, integrator, steps, every=0, shrink_at=None, **kw) -> tuple[Engine, Engine, list]:
    runs, seen = [], []
    for overlap in (False, True):
        calc = make_calc()
        a = atoms.copy()
        a.calc = calc
        engine = Engine(calc, a, integrator(), seed=7, max_temperature_K=float("inf"), overlap_blocks=overlap, **kw)
        if shrink_at is not None:  # the edge buffers too small from this step on: an overflow inside a block
            engine.run(shrink_at)
            calc.step.grow(0)
            calc.step._capacity = calc.step._capacity // 2
            calc.step.invalidate()
        seen.append(observed(engine, steps, every) if every else engine.run(steps))
        runs.append(engine)
    return runs[0], runs[1], seen


def assert_close_run(a: Engine, b: Engine, atol: float) -> None:
    """The same committed steps and, on the GPU, the same state to FP32 rounding: the two engines may rebuild their
    lists at other steps, and another padded layout sums the same terms in another order."""
    assert a.step == b.step == int(a.state.step) == int(b.state.step)
    for name in ("positions", "momenta", "cell"):
        assert torch.allclose(getattr(a.state, name), getattr(b.state, name), rtol=0.0, atol=atol), name
    assert torch.allclose(a.state.energy, b.state.energy, rtol=1e-5, atol=0.0)


@cuda
@pytest.mark.parametrize("integrator", [lambda: Langevin(0.5, 300.0, 0.01),
                                        lambda: StochasticCellRescaling(0.5, 300.0, 1e-4, tau_p_fs=500.0)])
def test_cuda_overlapped_blocks_repeat_bit_for_bit_and_track_the_waiting_engine(cuda_calc, integrator):
    """The 1,536-atom box, FP32, captured steps, pipelined rebuilds: two overlapped runs are equal bit for bit (a
    restart's promise), and they stay within FP32 rounding of the engine that waits for every report."""
    plain, overlapped, _ = _pair(cuda_calc, _water(512, 300.0, 1), integrator, 120)
    assert overlapped.overlap_blocks and overlapped.cuda_graph, overlapped.capture_error
    assert overlapped.stats["overlapped_blocks"] >= 5 and overlapped.stats["rebuilds"] >= 3, overlapped.stats
    _, again, _ = _pair(cuda_calc, _water(512, 300.0, 1), integrator, 120)
    assert_same_run(overlapped, again)
    assert_close_run(plain, overlapped, atol=1e-3)


@cuda
def test_cuda_overlapped_blocks_with_callbacks_stale_lists_and_an_overflow(cuda_calc):
    """A hot box with rebuild_margin 0 (lists go stale inside blocks), observers every 9 steps, the edge buffers
    halved after 5 steps (overflow, growth, recapture): callbacks at the same steps, the state within FP32 rounding
    of the engine without overlap."""
    plain, overlapped, seen = _pair(cuda_calc, _water(512, 900.0, 2), lambda: CSVR(1.0, 900.0, 50.0), 60, every=9,
                                    shrink_at=5, rebuild_margin=0.0, block=6)
    assert [s[0] for s in seen[0]] == [s[0] for s in seen[1]] and seen[0]
    assert overlapped.stats["grows"] >= 1 and overlapped.stats["discarded"] >= 1, overlapped.stats
    assert overlapped.stats["overlapped_blocks"] >= 1, overlapped.stats
    assert_close_run(plain, overlapped, atol=1e-3)
