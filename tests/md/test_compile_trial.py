"""compile auto's engine trial on a CPU (the bundled MACE): it times the run's own engine on a copy of the structure
and leaves the structure, and the run that follows, as they were."""

from __future__ import annotations

import numpy as np
import pytest

from cgforge.plugin import Calculator
from cgforge.plugin.md.compile_trial import engine_trial
from cgforge.plugin.md.run import plan_md
from cgforge.plugin.water import water_box

pytestmark = pytest.mark.usefixtures("fp64_one_thread")


@pytest.mark.slow
def test_the_trial_times_a_copy_and_leaves_the_run_as_it_was(tmp_path):
    atoms = water_box(8, seed=3)
    atoms.calc = calc = Calculator("mace", device="cpu", dtype="float64", skin=0.5)
    positions, cell = atoms.get_positions(), np.array(atoms.cell)
    assert not np.any(atoms.get_momenta())  # at rest: the trial draws its own momenta
    plan = plan_md(atoms, calc, steps=6, engine="device", ensemble="npt", log=None,
                   trajectory=tmp_path / "run.traj")
    ms, warm = engine_trial(calc, atoms, plan.o, plan.engine_options, warmup=2, steps=3)
    assert ms > 0 and warm > 0
    # the structure given is untouched: positions, cell, momenta at rest, its calculator
    np.testing.assert_array_equal(atoms.get_positions(), positions)
    np.testing.assert_array_equal(np.array(atoms.cell), cell)
    assert not np.any(atoms.get_momenta()) and atoms.calc is calc
    # the run after the trial is the run without it (same seed, same start): bitwise the same end
    after = plan.run()
    again = water_box(8, seed=3)
    again.calc = Calculator("mace", device="cpu", dtype="float64", skin=0.5)
    alone = plan_md(again, again.calc, steps=6, engine="device", ensemble="npt", log=None,
                    trajectory=tmp_path / "alone.traj").run()
    np.testing.assert_array_equal(atoms.get_positions(), again.get_positions())
    np.testing.assert_array_equal(np.array(atoms.cell), np.array(again.cell))
    assert after.steps == alone.steps == 6


def test_trial_steps_fit_a_large_systems_trial_into_its_seconds():
    from cgforge.plugin.md.compile_trial import trial_steps

    # a small system's step: the whole warm-up (less the two probes) and all the timed steps
    assert trial_steps(1.35, warmup=100, steps=100, seconds=5.0, probe=10) == (80, 100)
    # 0.4 s a step: 12 steps fit 5 s; the probes are the whole warm-up
    assert trial_steps(400.0, warmup=100, steps=100, seconds=5.0, probe=10) == (0, 12)
    # 2 s a step: fewer than the probe's steps would fit, the probe's count is kept
    assert trial_steps(2000.0, warmup=100, steps=100, seconds=5.0, probe=10) == (0, 10)
    # a probe that measured nothing (a clock too coarse): no cut
    assert trial_steps(0.0, warmup=100, steps=100, seconds=5.0, probe=10) == (80, 100)
