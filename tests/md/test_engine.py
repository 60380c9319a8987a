"""The MD engine with cgforge's Calculator (the bundled MACE water model): equal to ASE's VelocityVerlet with the
same calculator, Verlet-list rebuilds inside blocks change nothing, the Atoms and the calculator's results are
written back; (CUDA) the captured engine equals the eager one, rebuild timing and edge-buffer growth change
nothing."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from ase import units
from ase.md.velocitydistribution import MaxwellBoltzmannDistribution, Stationary
from ase.md.verlet import VelocityVerlet as AseVelocityVerlet

from cgforge.plugin import Calculator
from cgforge.plugin.md.engine import ENGINE_INFO_KEY, Engine
from cgforge.plugin.md.integrators import CSVR, Langevin, StochasticCellRescaling, VelocityVerlet
from cgforge.plugin.water import water_box

cuda = pytest.mark.cuda


pytestmark = pytest.mark.usefixtures("fp64_one_thread")


def thermal_water(molecules: int, temperature_K: float = 300.0, seed: int = 0):
    atoms = water_box(molecules, seed=seed)
    MaxwellBoltzmannDistribution(atoms, temperature_K=temperature_K, rng=np.random.default_rng(seed))
    Stationary(atoms)
    return atoms


@pytest.fixture(scope="module")
def calc64() -> Calculator:
    return Calculator("mace", device="cpu", dtype="float64", skin=0.25)


@pytest.mark.parametrize("pipelined", [False, True])
@pytest.mark.slow
def test_engine_equals_ase_velocity_verlet_with_the_bundled_model(calc64, pipelined):
    """24 atoms, FP64, a 0.25 Å skin so that the list goes stale inside blocks: the engine discards those steps,
    rebuilds and redoes them; the trajectory is ASE's to rounding. Pipelined: the next list is searched at a
    block's start state during the block and installed after it (on a CPU in sequence; the same logic)."""
    atoms = thermal_water(8, 600.0)
    ref = atoms.copy()
    ref.calc = calc64
    AseVelocityVerlet(ref, 1.0 * units.fs).run(24)
    mine = atoms.copy()
    mine.calc = calc64
    engine = Engine(calc64, mine, VelocityVerlet(1.0), block=6, pipelined_rebuild=pipelined)
    engine.run(24)
    engine.sync_atoms()
    assert np.abs(mine.positions - ref.positions).max() <= 1e-10
    assert np.abs(mine.get_momenta() - ref.get_momenta()).max() <= 1e-10
    assert abs(mine.get_potential_energy() - ref.get_potential_energy()) <= 1e-10
    assert engine.stats["rebuilds"] >= 2, engine.stats
    assert (engine.stats["overlapped_rebuilds"] >= 2) == pipelined, engine.stats


@pytest.mark.slow
def test_pipelined_rebuild_under_a_changing_cell_equals_synchronous_rebuilds(calc64):
    """NPT (the cell moves between the snapshot a list is searched for and its installation): the same
    trajectory as rebuilding synchronously."""
    atoms = thermal_water(8)
    runs = []
    for pipelined in (False, True):
        a = atoms.copy()
        a.calc = calc64
        engine = Engine(calc64, a, StochasticCellRescaling(0.5, 300.0, 0.1, tau_p_fs=2000.0),
                        seed=3, block=5, pipelined_rebuild=pipelined)
        engine.run(20)
        runs.append(engine)
    plain, pipelined = runs
    assert pipelined.stats["overlapped_rebuilds"] >= 1, pipelined.stats
    assert (plain.state.cell - pipelined.state.cell).abs().max() <= 1e-10
    assert (plain.state.positions - pipelined.state.positions).abs().max() <= 1e-10


@pytest.mark.slow
@pytest.mark.parametrize("integrator", ["nvt", "npt"])
def test_the_next_list_searched_inside_the_lists_last_block_changes_nothing(monkeypatch, integrator):
    """Pipelined (issue 62): the next list is searched from a snapshot queued between the steps of the list's last
    block (one block boundary a list). The trajectory equals synchronous rebuilds', with the cell moving under NPT;
    snapshots are taken inside blocks, and no block is a hiding block alone."""
    atoms = thermal_water(8, 300.0)
    calc = Calculator("mace", device="cpu", dtype="float64", skin=1.0)  # lists of ~10 steps
    runs, mid_block = {}, []
    for pipelined in (False, True):
        a = atoms.copy()
        a.calc = calc
        dynamics = (Langevin(0.5, 300.0, 0.05) if integrator == "nvt"
                    else StochasticCellRescaling(0.5, 300.0, 0.1, tau_p_fs=500.0))
        engine = Engine(calc, a, dynamics, seed=4, block=10, pipelined_rebuild=pipelined)
        snapshot = engine.provider.snapshot

        def recorded(positions, cell, snapshot=snapshot, engine=engine):
            mid_block.append(engine._search_after)
            return snapshot(positions, cell)

        monkeypatch.setattr(engine.provider, "snapshot", recorded)
        engine.run(60)
        runs[pipelined] = engine
    sync, merged = runs[False], runs[True]
    assert merged.stats["overlapped_rebuilds"] >= 3 and any(k > 0 for k in mid_block), (merged.stats, mid_block)
    # each list's search rides in a block that also runs the list's own steps: blocks <= lists + the first block
    assert merged.stats["blocks"] <= merged.stats["rebuilds"] + 1, merged.stats
    for field in ("positions", "momenta", "cell"):
        assert (getattr(merged.state, field) - getattr(sync.state, field)).abs().max() <= 1e-10, field


@pytest.mark.slow
def test_installing_the_searched_list_behind_its_block_changes_nothing(monkeypatch):
    """The searched list installed before the hiding block's report is read (issue 62) gives the trajectory of
    installing it after (the engine's order when the list's buffers must grow), on a padded step (whose list buffers
    keep their capacity, so installing ahead applies), with edge overflows in hiding blocks (their growth then
    follows the install). On a CPU the block has run when the install is queued: this checks the engine's logic."""
    from cgforge.plugin.runtime import step_graph

    atoms = thermal_water(8, 600.0)
    runs = []
    for ahead in (False, True):
        calc = Calculator("mace", device="cpu", dtype="float64", skin=0.5)
        potential = calc.potential
        potential.step = step_graph.ModelStep(potential.adapter, potential.neighbours, padded=True, margin=0.0)
        a = atoms.copy()
        a.calc = calc
        engine = Engine(calc, a, Langevin(1.0, 600.0, 0.05), block=6, seed=2, pipelined_rebuild=True)
        provider, counts = engine.provider, {"ahead": 0, "snapshots": 0}
        can, snapshot = provider.can_install_ahead, provider.snapshot

        def counted(pending, can=can, counts=counts, ahead=ahead):
            ok = ahead and can(pending)
            counts["ahead"] += ok
            return ok

        def squeezed(positions, cell, snapshot=snapshot, counts=counts, step=potential.step):
            counts["snapshots"] += 1
            if counts["snapshots"] % 2:  # this hiding block overflows its model edges
                step._capacity = max(1, step.n_edges - 5)
            return snapshot(positions, cell)

        references = []  # the list's reference positions after each block: which list is in use

        def block(size, observe, run_block=engine._run_block, references=references, provider=provider):
            committed = run_block(size, observe)
            references.append(provider._ref_positions.clone())
            return committed

        monkeypatch.setattr(provider, "can_install_ahead", counted)
        monkeypatch.setattr(provider, "snapshot", squeezed)
        monkeypatch.setattr(engine, "_run_block", block)
        engine.run(30)
        runs.append((engine, counts, references))
    (waiting, _, theirs), (ahead, counts, mine) = runs
    assert counts["ahead"] >= 5 and ahead.stats["grows"] >= 2, (counts, ahead.stats)
    assert {k: v for k, v in ahead.stats.items() if k != "wall_s"} == {
        k: v for k, v in waiting.stats.items() if k != "wall_s"}
    assert (ahead.state.positions - waiting.state.positions).abs().max() <= 1e-10
    assert (ahead.state.momenta - waiting.state.momenta).abs().max() <= 1e-10
    # after every block the same list is in use (a list left uninstalled would still give the same trajectory: the
    # engine's staleness check would rebuild it), to rounding: the two orders may refit the model-edge capacity
    # differently, and the padding changes sums
    assert len(mine) == len(theirs)
    assert max(float((m - t).abs().max()) for m, t in zip(mine, theirs, strict=True)) <= 1e-10


@pytest.mark.parametrize("asked", [None, True])
def test_a_box_near_a_full_device_runs_without_graph_or_side_search_unless_asked(monkeypatch, calc64, asked):
    """The calculator's memory plan at the engine's start says no CUDA graph (steps of seconds, memory short): the
    engine's defaults follow it (a side-stream search would hold a second list); what the user asked for stays.
    On a CPU the plan is faked and the defaults forced on, as they are on CUDA."""
    from cgforge.plugin.runtime.memory_plan import MemoryPlan

    atoms = thermal_water(4)
    near_full = MemoryPlan(edges=10, estimate_bytes=95, free_bytes=100, stream=False, expandable=True, capture=False,
                           atoms=len(atoms))

    def plan(n_atoms, count_edges, streaming=True):
        count_edges()
        calc64.potential.memory_plan = near_full
        return near_full

    monkeypatch.setattr(calc64.potential, "plan_memory", plan)
    monkeypatch.setattr(calc64.potential, "memory_plan", None)
    atoms.calc = calc64
    engine = Engine(calc64, atoms, VelocityVerlet(0.5), block=2, pipelined_rebuild=asked)
    engine.pipelined_rebuild = True  # the CUDA default
    engine.run(4)
    assert engine.provider.near_full_device(len(atoms)) and not engine.provider.near_full_device(len(atoms) + 3)
    assert engine.pipelined_rebuild is (asked is True)
    assert not engine.cuda_graph  # a CPU never captures
    # planned before the engine is built (run_md plans first): the engine says so from its construction on
    monkeypatch.setattr(Engine, "_want_pipelined", lambda self, p: True if p is None else p)
    planned = Engine(calc64, atoms, VelocityVerlet(0.5), block=2, pipelined_rebuild=asked)
    assert planned.pipelined_rebuild is (asked is True)


def test_pipelined_rebuild_needs_a_calculator():
    from cgforge.plugin.md.engine import energy_function_engine

    atoms = thermal_water(2)
    with pytest.raises(ValueError, match="pipelined_rebuild=True needs a provider"):
        energy_function_engine(lambda p, c: p.square().sum(), atoms, VelocityVerlet(1.0), pipelined_rebuild=True)
    with pytest.raises(TypeError, match="pipelined_rebuild"):
        energy_function_engine(lambda p, c: p.square().sum(), atoms, VelocityVerlet(1.0), pipelined_rebuild="yes")
    with pytest.raises(ValueError, match="engine_options: padded=False has no effect on Engine"):
        energy_function_engine(lambda p, c: p.square().sum(), atoms, VelocityVerlet(1.0), padded=False)


def test_atoms_carry_the_state_and_the_calculators_results(calc64, monkeypatch):
    atoms = thermal_water(8)
    atoms.calc = calc64
    engine = Engine(calc64, atoms, Langevin(0.5, 300.0, 0.01), seed=4, block=3)
    seen = []

    def observe(e: Engine) -> None:
        # served from the results the engine wrote: the calculator is not run again
        monkeypatch.setattr(calc64, "calculate", lambda *a, **k: pytest.fail("the calculator ran again"))
        seen.append((e.step, e.atoms.get_potential_energy(), e.atoms.get_forces().copy(), e.atoms.info.copy()))
        monkeypatch.undo()

    engine.run(4, every=2, callback=observe)
    assert [s[0] for s in seen] == [2, 4]
    step, energy, forces, info = seen[-1]
    assert info[ENGINE_INFO_KEY]["step"] == 4 and info[ENGINE_INFO_KEY]["integrator"] == "langevin"
    assert energy == pytest.approx(float(engine.state.energy), abs=1e-12)
    np.testing.assert_allclose(forces, engine.state.forces.numpy(), atol=1e-12)
    fresh = atoms.copy()
    fresh.calc = Calculator("mace", device="cpu", dtype="float64")
    np.testing.assert_allclose(fresh.get_forces(), forces, atol=1e-9)  # they are this structure's forces


def test_npt_with_the_model_writes_this_cells_stress(calc64):
    """NPT changes the cell; the stress the engine writes (virial / V) is the calculator's for that structure."""
    atoms = thermal_water(8, seed=5)
    atoms.calc = calc64
    cell0 = atoms.cell.array.copy()
    engine = Engine(calc64, atoms, StochasticCellRescaling(1.0, 300.0, 0.1, tau_p_fs=2000.0), seed=2, block=2)
    engine.run(4, every=4)
    assert not np.allclose(atoms.cell.array, cell0), "the cell moved"
    stress = atoms.calc.results["stress"].copy()
    fresh = atoms.copy()
    fresh.calc = Calculator("mace", device="cpu", dtype="float64")
    np.testing.assert_allclose(fresh.get_stress(), stress, atol=1e-10)


@pytest.mark.slow
def test_nve_energy_drift_of_the_bundled_model(calc64):
    """60 fs of NVE at 0.5 fs in FP64 (24 atoms from a 300 K start): the total energy stays within 1 meV/atom of
    its start (the integration error; a force that is not the energy's gradient drifts far more)."""
    atoms = thermal_water(8, 300.0, seed=2)
    atoms.calc = calc64
    engine = Engine(calc64, atoms, VelocityVerlet(0.5), block=10)
    e0 = engine.conserved_energy()
    totals = []
    engine.run(120, every=10, callback=lambda e: totals.append(e.conserved_energy()))
    drift = np.abs(np.array(totals) - e0).max() / len(atoms)
    assert drift < 1e-3, drift


# ---------------------------------------------------------------------------------------------
# CUDA (the lead runs these on the GPU machine)


def _run(calc, atoms, integrator, steps=40, **kw) -> Engine:
    a = atoms.copy()
    a.calc = calc
    engine = Engine(calc, a, integrator, seed=7, **kw)
    engine.run(steps)
    return engine


@pytest.fixture(scope="module")
def cuda_calc() -> Calculator:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return Calculator("mace", device="cuda", dtype="float64", skin=0.5)


@cuda
def test_captured_engine_equals_eager_engine(cuda_calc):
    atoms = thermal_water(343, seed=1)  # 1029 atoms
    eager = _run(cuda_calc, atoms, Langevin(1.0, 300.0, 0.02), cuda_graph=False, block=8)
    captured = _run(cuda_calc, atoms, Langevin(1.0, 300.0, 0.02), cuda_graph=True, block=8)
    assert captured.cuda_graph and captured.stats["captures"] >= 1, captured.capture_error
    unrolled = _run(cuda_calc, atoms, Langevin(1.0, 300.0, 0.02), cuda_graph=True, block=8, steps_per_graph=4)
    for other in (captured, unrolled):
        assert (other.state.positions - eager.state.positions).abs().max() <= 1e-10
        assert (other.state.momenta - eager.state.momenta).abs().max() <= 1e-10


@cuda
@pytest.mark.parametrize("integrator", [lambda: Langevin(1.0, 300.0, 0.02),
                                        lambda: StochasticCellRescaling(1.0, 300.0, 1e-4, tau_p_fs=100.0)])
def test_fused_integrator_in_the_captured_step_equals_the_plain_one(cuda_calc, integrator):
    """The integrator's arithmetic and the step's bookkeeping compiled by Inductor (Triton) inside the engine's CUDA
    graph: the same trajectory as the plain torch operations, and one capture."""
    atoms = thermal_water(343, seed=1)
    plain = _run(cuda_calc, atoms, integrator(), cuda_graph=True, block=8, fuse_integrator=False)
    fused = _run(cuda_calc, atoms, integrator(), cuda_graph=True, block=8, fuse_integrator=True)
    assert fused.fuse_integrator and fused.cuda_graph and fused.stats["captures"] >= 1, fused.capture_error
    for name in ("positions", "momenta", "cell"):
        diff = (getattr(fused.state, name) - getattr(plain.state, name)).abs().max()
        assert diff <= 1e-9, (name, float(diff))
    assert fused.step == plain.step == 40


@cuda
def test_rebuilds_inside_a_run_change_nothing(cuda_calc):
    """A run that rebuilds the list when the device says so (steps discarded and redone inside blocks) equals one
    that rebuilds before every step."""
    atoms = thermal_water(343, 600.0, seed=2)
    normal = _run(cuda_calc, atoms, CSVR(1.0, 600.0, 50.0), steps=60, block=10, rebuild_margin=0.0)
    assert normal.stats["rebuilds"] >= 2, normal.stats

    a = atoms.copy()
    a.calc = cuda_calc
    always = Engine(cuda_calc, a, CSVR(1.0, 600.0, 50.0), seed=7, block=1)
    always._plan_block = lambda size: (always._rebuild(), 1)[1]
    always.run(60)
    assert always.stats["rebuilds"] >= 60
    assert (normal.state.positions - always.state.positions).abs().max() <= 1e-8
    assert (normal.state.momenta - always.state.momenta).abs().max() <= 1e-7


@cuda
def test_pipelined_rebuilds_on_a_side_stream_change_nothing(cuda_calc):
    """Lists searched on a side stream during a block (captured steps running) give the trajectory of
    synchronous rebuilds."""
    atoms = thermal_water(343, 600.0, seed=2)
    plain = _run(cuda_calc, atoms, CSVR(1.0, 600.0, 50.0), steps=60, block=10, pipelined_rebuild=False)
    piped = _run(cuda_calc, atoms, CSVR(1.0, 600.0, 50.0), steps=60, block=10)
    assert piped.pipelined_rebuild and piped.cuda_graph
    assert piped.stats["overlapped_rebuilds"] >= 2 and plain.stats["overlapped_rebuilds"] == 0, piped.stats
    assert (plain.state.positions - piped.state.positions).abs().max() <= 1e-8
    assert (plain.state.momenta - piped.state.momenta).abs().max() <= 1e-7


@cuda
def test_edge_overflow_grows_the_buffers_and_changes_nothing(cuda_calc):
    atoms = thermal_water(343, seed=3)
    reference = _run(cuda_calc, atoms, VelocityVerlet(1.0), steps=20, block=5)
    a = atoms.copy()
    a.calc = cuda_calc
    engine = Engine(cuda_calc, a, VelocityVerlet(1.0), seed=7, block=5)
    engine.run(1)
    cuda_calc.step.grow(0)
    cuda_calc.step._capacity = cuda_calc.step._capacity // 2  # too small: the next step overflows
    cuda_calc.step.invalidate()
    engine.run(19)
    assert engine.stats["grows"] >= 1 and engine.stats["discarded"] >= 1, engine.stats
    assert (engine.state.positions - reference.state.positions).abs().max() <= 1e-10


@cuda
def test_fp32_npt_expands_an_overpressured_box():
    """The generated grid box starts far from equilibrium (the bundled model gives ~+86 kbar at 1 g/cm^3, unrelaxed):
    under the barostat it must expand, and the pressure fall, captured and without a blow-up."""
    torch.set_default_dtype(torch.float32)
    calc = Calculator("mace", device="cuda", dtype="float32")
    atoms = thermal_water(1728, seed=4)
    atoms.calc = calc

    def pressure_bar() -> float:
        return -float(np.trace(atoms.get_stress(voigt=False))) / 3 / units.bar

    engine = Engine(calc, atoms, StochasticCellRescaling(0.5, 300.0, 1e-4, tau_p_fs=500.0), seed=1)
    v0, p0 = atoms.get_volume(), pressure_bar()
    engine.run(200, every=50)
    assert engine.cuda_graph, engine.capture_error
    assert p0 > 1e4 and atoms.get_volume() > v0, (p0, v0, atoms.get_volume())
    assert abs(pressure_bar()) < p0
    assert "stress" in atoms.calc.results


def test_the_cell_inverse_is_linalg_inv() -> None:
    """The staleness reference's cell inverse (``forces.inverse_3x3``, cross products) equals torch's for a skewed
    cell, in float64 and float32."""
    from cgforge.plugin.md.forces import inverse_3x3

    cell = torch.tensor([[12.0, 0.7, -0.3], [1.1, 10.5, 0.4], [-0.6, 2.0, 14.2]], dtype=torch.float64)
    torch.testing.assert_close(inverse_3x3(cell), torch.linalg.inv(cell), rtol=1e-14, atol=1e-16)
    torch.testing.assert_close(inverse_3x3(cell.float()), torch.linalg.inv(cell.float()), rtol=1e-6, atol=1e-8)


@cuda
def test_cuda_installing_a_list_under_npt_waits_for_nothing(cuda_calc):
    """Under NPT the staleness reference keeps the cell's inverse: installing a searched list queues it without a
    host sync, so the install may sit behind the running block (the engine's order on CUDA)."""
    atoms = thermal_water(64)
    atoms.calc = cuda_calc
    engine = Engine(cuda_calc, atoms, StochasticCellRescaling(0.5, 300.0, 1e-4, tau_p_fs=100.0), seed=1, block=5)
    engine.run(5)
    provider, s = engine.provider, engine.state
    pending = provider.snapshot(s.positions, s.cell)
    provider.search(pending)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            provider.install(pending)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
    assert not syncs, syncs
    engine.run(5)  # and the engine goes on from the installed list
    assert engine.stats["steps"] >= 10
