"""run_md under bad input and long runs: blow-up detection, argument checks, file safety, restarts, Ctrl-C,
NPT, a single atom. Cheap calculators (EMT, q-SPC/Fw) on tiny systems: the driver is under test here."""

from __future__ import annotations

import math
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from ase import Atoms
from ase.build import bulk
from ase.calculators.calculator import Calculator, all_changes
from ase.calculators.emt import EMT
from ase.io import read

from cgforge.plugin.md.run import (
    COMPILE_AUTO_MIN_STEPS,
    MDInstabilityError,
    MDInterrupted,
    check_new_path,
    model_banner,
    plan_md,
    read_restart,
    run_md,
)
from cgforge.plugin.water import QSPCFwCalculator, water_box


def _copper(seed: int = 0) -> Atoms:
    atoms = bulk("Cu", cubic=True).repeat((2, 2, 2))  # 32 atoms, EMT: a few ms per step
    atoms.rattle(0.02, seed=seed)
    return atoms


class Wrapped(Calculator):
    """EMT with hooks: non-finite forces or energy from call ``bad_from`` on, or a function run at a call.

    A new EMT per call: EMT's sums follow its neighbour list, whose order depends on where it was last
    rebuilt, so a long-lived EMT gives last-bit different forces after a restart (the driver is under test)."""

    implemented_properties = ["energy", "free_energy", "forces", "stress"]

    def __init__(self, bad_from: int | None = None, what: str = "forces",
                 at_call: dict[int, object] | None = None) -> None:
        super().__init__()
        self.bad_from, self.what, self.at_call = bad_from, what, at_call or {}
        self.calls = 0
        self.stress_with_forces = False
        self.stress_flag_seen: set[bool] = set()

    def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes) -> None:
        super().calculate(atoms, properties, system_changes)
        self.calls += 1  # call 1: the state at step 0; call k + 1: after step k
        self.stress_flag_seen.add(self.stress_with_forces)
        if self.calls in self.at_call:
            self.at_call[self.calls]()
        copy = self.atoms.copy()
        copy.calc = EMT()
        energy, forces = copy.get_potential_energy(), copy.get_forces()
        if self.bad_from is not None and self.calls >= self.bad_from:
            if self.what == "forces":
                forces[3, 1] = np.nan
            else:
                energy = math.inf
        self.results = {"energy": energy, "free_energy": energy, "forces": forces}
        if "stress" in properties:
            self.results["stress"] = copy.get_stress()


# --- blow-up detection ------------------------------------------------------------------------------------


def test_a_run_that_blows_up_stops_naming_the_step_and_keeps_its_trajectory(tmp_path):
    """q-SPC/Fw water at an 8 fs timestep (the O-H vibration is ~9 fs): 1e5 K within two steps."""
    atoms = water_box(8, seed=1)
    lines: list[str] = []
    out = tmp_path / "boom.traj"
    with pytest.raises(MDInstabilityError, match=r"unstable at step \d+: the temperature reached") as info:
        run_md(atoms, QSPCFwCalculator(), ensemble="nve", timestep_fs=8.0, steps=50, trajectory=out,
               trajectory_interval=1, log=lines.append)
    err = info.value
    assert err.quantity == "temperature" and err.value > 5000 and 1 <= err.step < 50
    assert "max_temperature_K" in str(err) and "--max-temperature" in str(err)
    frames = read(out, ":")  # closed properly: every frame before the bad step is there
    assert [f.info["md_step"] for f in frames] == list(range(err.step))
    assert lines[-1].startswith("stopped: MD became unstable at step")
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_max_temperature_is_the_users_limit():
    atoms = _copper()
    with pytest.raises(MDInstabilityError, match="above the limit of 400 K") as info:
        run_md(atoms, EMT(), ensemble="nvt", temperature_K=300, max_temperature_K=400, steps=200, timestep_fs=2.0,
               init_velocities=True, log=None, seed=1, friction=0.5)
    assert info.value.quantity == "temperature" and info.value.value > 400
    # inf turns the temperature check off; the default is max(5000, 10 x T)
    summary = run_md(_copper(), EMT(), ensemble="nvt", temperature_K=300, max_temperature_K=math.inf, steps=5,
                     timestep_fs=2.0, log=None)
    assert summary.steps == 5
    lines: list[str] = []
    run_md(_copper(), EMT(), temperature_K=800, steps=0, log=lines.append)
    assert "stop above 8000 K" in lines[0]


@pytest.mark.parametrize("what, match", [("forces", r"step 4: the forces are not finite on 1 of 32 atoms \(first: "
                                                    r"atom 3, Cu"),
                                         ("energy", r"step 4: the potential energy is inf")])
def test_non_finite_forces_or_energy_stop_the_run(tmp_path, what, match):
    out = tmp_path / "nan.traj"
    with pytest.raises(MDInstabilityError, match=match) as info:
        run_md(_copper(), Wrapped(bad_from=5, what=what), ensemble="nve", steps=20, timestep_fs=2.0,
               trajectory=out, trajectory_interval=2, log=None)
    assert info.value.step == 4 and info.value.quantity == what
    assert [f.info["md_step"] for f in read(out, ":")] == [0, 2]


def test_a_run_that_fails_at_step_0_leaves_no_file_and_keeps_an_old_one(tmp_path):
    out = tmp_path / "t.traj"
    with pytest.raises(MDInstabilityError, match="step 0"):
        run_md(_copper(), Wrapped(bad_from=1), steps=5, trajectory=out, log=None)
    assert os.listdir(tmp_path) == []  # no 56-byte header-only file, no temporary file
    out.write_bytes(b"the user's file")
    with pytest.raises(MDInstabilityError, match="step 0"):
        run_md(_copper(), Wrapped(bad_from=1), steps=5, trajectory=out, force=True, log=None)
    assert out.read_bytes() == b"the user's file"  # --force replaces it only with a complete first frame
    assert os.listdir(tmp_path) == ["t.traj"]
    run_md(_copper(), EMT(), steps=2, trajectory=out, force=True, log=None)
    assert len(read(out, ":")) == 2  # steps 0 and 2 (the last step is always written)


def test_xyz_trajectory_created_at_the_first_frame(tmp_path):
    out = tmp_path / "t.extxyz"
    run_md(_copper(), EMT(), steps=3, trajectory=out, trajectory_interval=2, log=None)
    assert [int(f.info["md_step"]) for f in read(out, ":")] == [0, 2, 3]


# --- arguments --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, error, match", [
    ({"temperature_K": -10}, ValueError, "temperature_K: expected a finite number >= 0, got -10"),
    ({"temperature_K": "300"}, TypeError, "temperature_K: expected a number, got str"),
    ({"timestep_fs": 0}, ValueError, "timestep_fs"),
    ({"timestep_fs": math.nan}, ValueError, "timestep_fs"),
    ({"steps": -1}, ValueError, "steps"),
    ({"steps": 2.5}, TypeError, "steps"),
    ({"trajectory_interval": 0}, ValueError, "trajectory_interval"),
    ({"log_interval": True}, TypeError, "log_interval"),
    ({"seed": -1}, ValueError, "seed"),
    ({"ensemble": "npt-ish"}, ValueError, "ensemble: expected one of nvt, nve, npt"),
    ({"ensemble": 3}, TypeError, "ensemble"),
    ({"ensemble": "nve", "friction": 0.1}, ValueError, r"friction: the Langevin friction is for NVT "
                                                       r"\(langevin\); this run is NVE"),
    ({"ensemble": "nvt", "pressure_bar": 10}, ValueError, "pressure_bar: the barostat's pressure is for NPT; "
                                                          "this run is NVT"),
    ({"ensemble": "npt", "taup_fs": 0}, ValueError, "taup_fs"),
    ({"ensemble": "npt", "compressibility_per_bar": -1e-5}, ValueError, "compressibility_per_bar"),
    ({"max_temperature_K": 200}, ValueError, "max_temperature_K: the blow-up limit 200 K must be above"),
    ({"max_temperature_K": -1}, ValueError, "max_temperature_K"),
    ({"force": "yes"}, TypeError, "force: expected True or False"),
    ({"init_velocities": 1}, TypeError, "init_velocities"),
    ({"log": 42}, TypeError, "log: expected print"),
    ({"trajectory": 42}, TypeError, "trajectory: expected a file name"),
    ({"calculator": "mace"}, TypeError, r"calculator: expected an ASE calculator, got the str 'mace'; load the "
                                        r"model first: Calculator\('mace'\)"),
    ({"calculator": 3.0}, TypeError, "calculator: expected an ASE calculator"),
    ({"temperature": 300}, TypeError, r"run_md: unknown argument 'temperature' \(did you mean 'temperature_K'\?\)"),
    ({"logfile": "x.log"}, TypeError, "run_md: unknown argument 'logfile'"),
    ({"restart": 3}, TypeError, "restart: expected a trajectory file name"),
    ({"restart": "x.traj", "init_velocities": True}, ValueError, "init_velocities: a restart continues"),
    ({"restart": "x.traj", "relax": 2}, ValueError, "relax: a restart continues the saved state"),
    ({"relax": -1}, ValueError, "relax: expected an int >= 0"),
    ({"compile": "fast"}, ValueError, "compile: expected True, False or one of auto, off, default"),
    ({"compile": "default", "relax": 5}, ValueError, "compile: Wrapped cannot be compiled"),  # before relaxing
])
def test_every_argument_is_checked_first_and_named(tmp_path, kwargs, error, match):
    calc = Wrapped()
    kwargs = {"calculator": calc, **kwargs}
    with pytest.raises(error, match=match):
        run_md(_copper(), steps=kwargs.pop("steps", 3), trajectory=kwargs.pop("trajectory", tmp_path / "t.traj"),
               **kwargs)
    assert calc.calls == 0 and os.listdir(tmp_path) == []  # nothing computed, nothing written


def test_atoms_and_calculator_are_checked(tmp_path):
    with pytest.raises(TypeError, match="atoms: expected an ase.Atoms, got list"):
        run_md([1, 2], EMT())
    with pytest.raises(TypeError, match="atoms: expected an ase.Atoms .None only with restart"):
        run_md(None, EMT())
    with pytest.raises(ValueError, match="atoms: expected a structure with at least one atom"):
        run_md(Atoms(), EMT())
    with pytest.raises(ValueError, match="calculator: atoms has no calculator"):
        run_md(_copper())
    with pytest.raises(ValueError, match="ensemble: NPT changes the cell and needs a periodic 3-D cell"):
        run_md(Atoms("Cu2", positions=[[0, 0, 0], [2.5, 0, 0]]), EMT(), ensemble="npt")


class Compilable(Wrapped):
    """Records what run_md asks of a compilable calculator (a cgforge Calculator's set_compile)."""

    compile = None

    def set_compile(self, mode) -> None:
        self.compile = mode


def test_run_md_relaxes_and_compiles_as_cgforge_md_does():
    """run_md's relax and compile: the FIRE steps and their line before the run's, a mode handed to the
    calculator; auto compiles nothing off CUDA (as `cgforge md --compile auto`)."""
    atoms, lines = _copper(), []
    calc = Compilable()
    before = atoms.get_positions()
    run_md(atoms, calc, relax=3, compile=True, steps=1, log=lines.append)
    assert lines[0].startswith("relaxed 3 FIRE steps: energy ") and lines[1].startswith("cgforge md: 32 atoms")
    assert calc.compile == "default" and not np.allclose(atoms.get_positions(), before)
    auto, lines = Compilable(), []
    run_md(_copper(), auto, steps=1, log=lines.append)  # compile auto, relax 0: neither says anything here
    assert auto.compile is None and lines[0].startswith("cgforge md: 32 atoms")
    gpu = Compilable()  # what auto reads of a cgforge Calculator on CUDA (no step runs here)
    gpu.device, gpu.patched, gpu.compiled_fits = torch.device("cuda"), True, lambda atoms: True
    plan = plan_md(_copper(), gpu, steps=COMPILE_AUTO_MIN_STEPS, log=lines.append, engine="ase")
    plan.start()
    plan.close()
    # ASE's dynamics: auto's trial times the device engine, so this run stays plain and says why
    assert gpu.compile is None and lines[-1].startswith("torch.compile: off (auto decides by a trial of the device")


# --- files ------------------------------------------------------------------------------------------------


def test_log_path_gets_the_lines_instead_of_stdout(tmp_path, capsys):
    log = tmp_path / "md.log"
    summary = run_md(_copper(), EMT(), steps=4, log_interval=2, log=str(log))
    assert capsys.readouterr().out == ""
    lines = log.read_text().splitlines()
    assert lines[0].startswith("cgforge md: 32 atoms, NVT") and "ns/day" in lines[1]
    assert [int(x.split()[0]) for x in lines[2:5]] == [0, 2, 4] and lines[-1].startswith("done: 4 steps")
    assert summary.log == str(log)
    with pytest.raises(FileExistsError, match="log: .*md.log exists"):
        run_md(_copper(), EMT(), steps=1, log=log)
    run_md(_copper(), EMT(), steps=1, log=log, force=True)
    assert log.read_text().count("done:") == 1  # replaced, not appended
    with pytest.raises(ValueError, match="trajectory and log name the same file"):
        run_md(_copper(), EMT(), steps=1, log=tmp_path / "x.traj", trajectory=tmp_path / "x.traj")
    both: list[str] = []
    run_md(_copper(), EMT(), steps=2, log=[both.append, tmp_path / "both.log"])  # to a callable and a file
    assert both == (tmp_path / "both.log").read_text().splitlines() and both[-1].startswith("done: 2 steps")
    with pytest.raises(ValueError, match="log: at most one file name"):
        run_md(_copper(), EMT(), steps=1, log=[tmp_path / "a.log", tmp_path / "b.log"])


def test_outputs_never_overwrite_the_restart_file(tmp_path):
    first = tmp_path / "a.traj"
    run_md(_copper(), EMT(), steps=2, trajectory=first, log=None)
    size = first.stat().st_size
    for kwargs in ({"trajectory": first}, {"log": first}, {"trajectory": tmp_path / "b.traj", "log": first}):
        with pytest.raises(ValueError, match="is the restart file; cgforge never writes over its input"):
            run_md(None, EMT(), restart=first, steps=1, force=True, **kwargs)
    link = tmp_path / "hard.traj"
    os.link(first, link)
    with pytest.raises(ValueError, match="restart file"):
        run_md(None, EMT(), restart=first, steps=1, force=True, trajectory=link)
    assert first.stat().st_size == size


def test_check_new_path_names_what(tmp_path):
    with pytest.raises(ValueError, match=r"--trajectory: .*x.pdb must end with .traj, .xyz or .extxyz"):
        check_new_path(tmp_path / "x.pdb", what="--trajectory")
    assert check_new_path(tmp_path / "x.log", what="log", suffixes=None) == tmp_path / "x.log"


# --- restarts ---------------------------------------------------------------------------------------------


def _final(path: Path) -> Atoms:
    return read(path, -1)


@pytest.mark.parametrize("ensemble", ["nve", "nvt", "npt"])
def test_restart_repeats_the_uninterrupted_run_exactly(tmp_path, ensemble):
    extra = {"friction": 0.05} if ensemble == "nvt" else {"pressure_bar": 5000.0} if ensemble == "npt" else {}
    common = dict(ensemble=ensemble, temperature_K=500, timestep_fs=2.0, trajectory_interval=5, log=None, seed=7,
                  **extra)
    run_md(_copper(), Wrapped(), steps=20, trajectory=tmp_path / "whole.traj", **common)
    run_md(_copper(), Wrapped(), steps=10, trajectory=tmp_path / "half.traj", **common)
    summary = run_md(None, Wrapped(), restart=tmp_path / "half.traj", steps=10, trajectory=tmp_path / "rest.traj",
                     **common)
    assert (summary.first_step, summary.last_step, summary.steps) == (10, 20, 10)
    rest = read(tmp_path / "rest.traj", ":")
    assert [f.info["md_step"] for f in rest] == [15, 20]  # the step counter goes on; step 10 is in half.traj
    assert rest[-1].info["md_time_fs"] == 40.0
    whole, again = _final(tmp_path / "whole.traj"), rest[-1]
    assert np.array_equal(whole.positions, again.positions)
    assert np.array_equal(whole.get_momenta(), again.get_momenta())
    assert np.array_equal(whole.cell, again.cell)
    assert whole.info["md_etot0"] == again.info["md_etot0"]  # the drift still counts from step 0
    assert ("md_rng" in again.info) == (ensemble == "nvt")
    if ensemble == "npt":
        assert not np.allclose(whole.cell, _copper().cell)  # the barostat did move the cell


def test_nvt_restart_needs_the_saved_random_state(tmp_path):
    """Without md_rng the thermostat draws other numbers: the saved state is what made the restart exact."""
    common = dict(ensemble="nvt", temperature_K=500, timestep_fs=2.0, friction=0.05, log=None, seed=7)
    run_md(_copper(), Wrapped(), steps=20, trajectory=tmp_path / "whole.traj", **common)
    run_md(_copper(), Wrapped(), steps=10, trajectory=tmp_path / "half.traj", **common)
    state = read_restart(tmp_path / "half.traj")
    assert state.step == 10 and state.rng_state["bit_generator"] == "PCG64"
    state.rng_state = None
    run_md(None, Wrapped(), restart=state, steps=10, trajectory=tmp_path / "rest.traj", **common)
    assert not np.allclose(_final(tmp_path / "whole.traj").positions, _final(tmp_path / "rest.traj").positions)


def test_restart_into_given_atoms_and_refusals(tmp_path):
    run_md(_copper(), Wrapped(), steps=4, trajectory=tmp_path / "a.traj", log=None)
    atoms = _copper(seed=5)
    summary = run_md(atoms, Wrapped(), restart=tmp_path / "a.traj", steps=2, log=None, relax=0)  # 0: nothing
    assert summary.atoms is atoms and summary.first_step == 4
    with pytest.raises(ValueError, match="restart: .*holds Cu32 .32 atoms., atoms is Cu4"):
        run_md(bulk("Cu", cubic=True), Wrapped(), restart=tmp_path / "a.traj", steps=1, log=None)
    plain = tmp_path / "plain.xyz"
    _copper().write(plain)
    with pytest.raises(ValueError, match="restart: .*plain.xyz has no MD step counter"):
        run_md(None, Wrapped(), restart=plain, steps=1, log=None)
    with pytest.raises(FileNotFoundError, match="restart: .*nope.traj not found"):
        run_md(None, Wrapped(), restart=tmp_path / "nope.traj", steps=1, log=None)


def test_restart_from_extxyz_continues_closely(tmp_path):
    common = dict(ensemble="nve", timestep_fs=2.0, log=None, seed=3)
    run_md(_copper(), Wrapped(), steps=10, trajectory=tmp_path / "whole.traj", **common)
    run_md(_copper(), Wrapped(), steps=5, trajectory=tmp_path / "half.xyz", **common)
    summary = run_md(None, Wrapped(), restart=tmp_path / "half.xyz", steps=5, **common)
    assert summary.last_step == 10
    assert np.abs(summary.atoms.positions - _final(tmp_path / "whole.traj").positions).max() < 1e-6


# --- Ctrl-C -----------------------------------------------------------------------------------------------


def test_ctrl_c_stops_after_the_step_and_the_run_can_continue(tmp_path):
    common = dict(ensemble="nvt", temperature_K=500, timestep_fs=2.0, friction=0.05, seed=2, trajectory_interval=5)
    run_md(_copper(), Wrapped(), steps=20, trajectory=tmp_path / "whole.traj", log=None, **common)
    calc = Wrapped(at_call={8: lambda: signal.raise_signal(signal.SIGINT)})  # during step 7's forces
    lines: list[str] = []
    with pytest.raises(MDInterrupted) as info:
        run_md(_copper(), calc, steps=20, trajectory=tmp_path / "cut.traj", log=lines.append, **common)
    assert info.value.step == 7 and info.value.summary.last_step == 7
    assert "interrupted (Ctrl-C) at step 7" in lines[-1] and "ends at step 7" in lines[-1]
    assert [f.info["md_step"] for f in read(tmp_path / "cut.traj", ":")] == [0, 5, 7]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Python's handler is back
    run_md(None, Wrapped(), restart=tmp_path / "cut.traj", steps=13, trajectory=tmp_path / "rest.traj", log=None,
           **common)
    assert np.array_equal(_final(tmp_path / "whole.traj").positions, _final(tmp_path / "rest.traj").positions)


def test_second_ctrl_c_interrupts_at_once_without_a_half_updated_frame(tmp_path):
    def twice() -> None:
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)

    calc = Wrapped(at_call={8: twice})
    with pytest.raises(MDInterrupted, match="at step 6"):  # step 7 never completed
        run_md(_copper(), calc, steps=20, trajectory=tmp_path / "cut.traj", trajectory_interval=5, log=None)
    assert [f.info["md_step"] for f in read(tmp_path / "cut.traj", ":")] == [0, 5]


# --- ensembles and odd systems ----------------------------------------------------------------------------


def test_npt_changes_the_volume_towards_the_pressure_and_asks_for_stress_with_forces():
    calc = Wrapped()
    atoms, free = _copper(), _copper()
    npt = dict(ensemble="npt", temperature_K=300, taup_fs=100, compressibility_per_bar=7e-7, timestep_fs=2.0,
               steps=20, log=None)  # copper's compressibility, 0.7 / Mbar
    run_md(atoms, calc, pressure_bar=1e5, **npt)
    run_md(free, Wrapped(), pressure_bar=1.0, **npt)
    assert atoms.get_volume() < free.get_volume() - 5  # 10 GPa compresses copper by a few percent (measured 9 Å^3)
    cell = atoms.cell.cellpar()
    assert np.allclose(cell[:3], cell[0]) and np.allclose(cell[3:], 90)  # isotropic: the shape is kept
    assert calc.stress_flag_seen == {True} and calc.stress_with_forces is False  # set for the run, then restored


@pytest.mark.parametrize("ensemble", ["nvt", "nve"])
def test_md_of_a_single_atom(ensemble):
    atoms = Atoms("Cu", positions=[[1.0, 1.0, 1.0]], cell=[6, 6, 6], pbc=True)
    summary = run_md(atoms, EMT(), ensemble=ensemble, temperature_K=300, timestep_fs=2.0, steps=5, log=None)
    assert summary.steps == 5 and math.isfinite(summary.temperature_K) and summary.temperature_K > 0
    assert not np.allclose(atoms.positions, [[1.0, 1.0, 1.0]])  # it kept its thermal velocity and moved


# --- banner -----------------------------------------------------------------------------------------------


def test_banner_shows_the_parameters_dtype_and_compiles_only_on_cuda():
    model = torch.nn.Linear(2, 2).to(torch.float32)
    calc = SimpleNamespace(model=model, dtype=torch.float64, adapter=SimpleNamespace(kind="nequip"), cutoff=4.0,
                           device=torch.device("cpu"))  # NequIP: positions in float64, parameters float32
    line = model_banner("nequip", calc, 1.25)
    assert "in float32," in line and "float64" not in line and "kernels compiled" not in line
    assert "the model's own code" in line and "cgforge's kernels," not in line  # a CPU runs the model's code
    calc.device, calc.patched = torch.device("cuda", 0), True
    line = model_banner("nequip", calc, 1.25)
    assert "in float32, cgforge's kernels, ready in" in line and line.endswith("ready in 1.2 s (kernels compiled)")


@pytest.mark.slow
def test_banner_of_the_bundled_nequip_model(nequip_state):
    from cgforge.plugin import Calculator

    calc = Calculator("nequip", device="cpu")
    assert {p.dtype for p in calc.model.parameters()} == {torch.float32}
    assert " in float32, " in model_banner("nequip", calc, 0.0)


@pytest.mark.slow
@pytest.mark.parametrize("ensemble", ["nve", "nvt"])
def test_restart_with_the_bundled_model_repeats_the_run_bitwise(tmp_path, ensemble):
    """cgforge's Calculator: forces do not depend on where the Verlet list was last built, so a restart from a
    .traj frame repeats the uninterrupted run bit for bit (one calculator for all three runs: its list and
    caches carry over from other positions, as they would not in a fresh process)."""
    from cgforge.plugin import Calculator

    torch.set_default_dtype(torch.float32)
    # cgforge's kernels (the default on CUDA): fixed-order edge sums. The model's own code (the CPU default)
    # sums edges in the Verlet list's order, which a restart rebuilds: equal only to rounding there.
    calc = Calculator("mace", device="cpu", patch=True)
    common = dict(ensemble=ensemble, temperature_K=300, timestep_fs=0.5, log=None, seed=11, trajectory_interval=2)
    run_md(water_box(4, seed=3), calc, steps=4, trajectory=tmp_path / "whole.traj", **common)
    run_md(water_box(4, seed=3), calc, steps=2, trajectory=tmp_path / "half.traj", **common)
    run_md(None, calc, restart=tmp_path / "half.traj", steps=2, trajectory=tmp_path / "rest.traj", **common)
    whole, again = _final(tmp_path / "whole.traj"), _final(tmp_path / "rest.traj")
    assert whole.info["md_step"] == again.info["md_step"] == 4
    assert np.array_equal(whole.positions, again.positions)
    assert np.array_equal(whole.get_momenta(), again.get_momenta())
