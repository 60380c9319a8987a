"""run_md as the new user met it (issue 41): a restart continues the run it names (its saved options are the
defaults, a contradicting value and another model are refused), structure problems are found before any
step, Ctrl-C says at once what happens and a second one never cuts a frame, the log ends where the
trajectory does, a plot that fails is a warning, and the small wording fixes. EMT on 32 copper atoms."""

from __future__ import annotations

import signal
from pathlib import Path

import numpy as np
import pytest
from ase import Atoms
from ase.build import bulk
from ase.calculators.emt import EMT
from ase.calculators.lj import LennardJones
from ase.io import read

from cgforge.plugin.md import plot as plot_module
from cgforge.plugin.md.files import TrajectoryWriter
from cgforge.plugin.md.run import MODEL_MISMATCH_MEV_PER_ATOM, MDInterrupted, plan_md, run_md


def _copper(seed: int = 0) -> Atoms:
    atoms = bulk("Cu", cubic=True).repeat((2, 2, 2))
    atoms.rattle(0.02, seed=seed)
    return atoms


class CallHook(EMT):
    """EMT that runs ``at_call[k]()`` during its k-th calculation (call 1: step 0's forces)."""

    def __init__(self, at_call: dict | None = None) -> None:
        super().__init__()
        self.at_call, self.calls = at_call or {}, 0

    def calculate(self, *args, **kwargs) -> None:
        self.calls += 1
        if self.calls in self.at_call:
            self.at_call[self.calls]()
        super().calculate(*args, **kwargs)


def _frames(path: Path) -> list[Atoms]:
    return read(path, ":")


@pytest.mark.parametrize("first", [
    dict(ensemble="nve"),
    dict(ensemble="nvt", temperature_K=450.0, timestep_fs=1.5, friction=0.05, seed=3),
    dict(ensemble="nvt", thermostat="csvr", temperature_K=250.0, taut_fs=40.0, seed=4),
    dict(ensemble="npt", temperature_K=350.0, pressure_bar=500.0, taut_fs=50.0, taup_fs=400.0,
         compressibility_per_bar=1e-5),
])
def test_a_restart_continues_the_saved_ensemble_and_options(tmp_path, first):
    run_md(_copper(), EMT(), steps=4, trajectory=tmp_path / "a.traj", trajectory_interval=2, log=None, **first)
    saved = _frames(tmp_path / "a.traj")[-1].info
    lines: list[str] = []
    run_md(None, EMT(), restart=tmp_path / "a.traj", steps=2, trajectory=tmp_path / "b.traj", log=lines.append)
    info = _frames(tmp_path / "b.traj")[-1].info
    for key in ("md_ensemble", "md_thermostat", "md_temperature_K", "md_timestep_fs", "md_friction",
                "md_pressure_bar", "md_taut_fs", "md_taup_fs", "md_compressibility_per_bar", "md_seed"):
        assert info.get(key) == saved.get(key), key
    assert info["md_ensemble"] == first["ensemble"]
    for key, value in first.items():
        assert info[f"md_{key}"] == value, key
    assert f", {first['ensemble'].upper()}" in lines[0] and "(its saved options)" in lines[0]
    assert f"timestep {first.get('timestep_fs', 0.5):g} fs" in lines[0]
    units = {"friction": "friction {:g} 1/fs", "taut_fs": "taut {:g} fs", "taup_fs": "taup {:g} fs",
             "compressibility_per_bar": "compressibility {:g} 1/bar"}  # issue 61: the restart's banner says them
    for key, text in units.items():
        if key in first:
            assert text.format(first[key]) in lines[0], key


def test_an_nve_restart_keeps_its_temperature(tmp_path):
    """issue 61: --temperature on an NVE restart was accepted and only moved the blow-up limit. NVE frames save the
    temperature of the first velocities: the restart's limit follows it, another temperature is refused."""
    run_md(_copper(), EMT(), steps=2, ensemble="nve", temperature_K=800.0, trajectory=tmp_path / "a.traj", log=None)
    assert _frames(tmp_path / "a.traj")[-1].info["md_temperature_K"] == 800.0
    with pytest.raises(ValueError, match="temperature_K: .*a.traj ran with temperature_K 800.0, and a restart"):
        run_md(None, EMT(), restart=tmp_path / "a.traj", steps=1, temperature_K=300.0, log=None)
    lines: list[str] = []
    run_md(None, EMT(), restart=tmp_path / "a.traj", steps=1, temperature_K=800.0, log=lines.append)
    assert "stop above 8000 K" in lines[0]


@pytest.mark.parametrize("flag, value, match", [
    ("ensemble", "nvt", "ensemble: .*a.traj ran with ensemble NVE, and a restart continues its run"),
    ("timestep_fs", 1.0, "timestep_fs: .*ran with timestep_fs 0.5"),
])
def test_a_restart_refuses_a_value_that_contradicts_the_saved_one(tmp_path, flag, value, match):
    run_md(_copper(), EMT(), ensemble="nve", steps=2, trajectory=tmp_path / "a.traj", log=None)
    with pytest.raises(ValueError, match=match) as info:
        run_md(None, EMT(), restart=tmp_path / "a.traj", steps=2, trajectory=tmp_path / "b.traj", log=None,
               **{flag: value})
    assert "read_structure" in str(info.value)  # how to start a new run from the frame instead
    assert not (tmp_path / "b.traj").exists()
    # the same value as saved is no contradiction
    run_md(None, EMT(), restart=tmp_path / "a.traj", steps=2, trajectory=tmp_path / "c.traj", log=None,
           ensemble="NVE", timestep_fs=0.5)


def test_a_restart_on_another_model_is_refused_before_any_step(tmp_path):
    run_md(_copper(), EMT(), ensemble="nve", steps=2, trajectory=tmp_path / "a.traj", log=None)
    lines: list[str] = []
    other = LennardJones(sigma=2.3, epsilon=0.4, rc=5.0)
    with pytest.raises(ValueError, match="a restart continues the same model") as info:
        run_md(None, other, restart=tmp_path / "a.traj", steps=2, trajectory=tmp_path / "b.traj", log=lines.append)
    assert "meV/atom apart" in str(info.value) and "was run with EMT" in str(info.value)
    assert not (tmp_path / "b.traj").exists()
    assert "stopped before the first step" in lines[-1] and "after step" not in lines[-1]
    # the same model within precision continues (an energy offset far below the tolerance)
    shifted = CallHook()
    run_md(None, shifted, restart=tmp_path / "a.traj", steps=2, trajectory=tmp_path / "c.traj", log=None)
    assert MODEL_MISMATCH_MEV_PER_ATOM < 3.0  # below the bundled MACE vs NequIP gap the user met


@pytest.mark.parametrize("change, match", [
    (lambda a: a.positions.__setitem__((3, 1), np.nan), r"atoms: 1 of 32 atoms have non-finite positions .first: "
                                                        "atom 3"),
    (lambda a: a.set_cell([[3.6, 0, 0], [7.2, 0, 0], [0, 0, 7.2]]), "atoms: the cell is singular along its periodic"),
    (lambda a: a.set_cell([[0, 0, 0], [0, 7.2, 0], [0, 0, 7.2]]), "atoms: the cell is singular along its periodic"),
])
def test_structure_problems_are_found_before_any_step(tmp_path, change, match):
    atoms = _copper()
    change(atoms)
    calc = CallHook()
    with pytest.raises(ValueError, match=match):
        plan_md(atoms, calc, steps=2, trajectory=tmp_path / "a.traj", log=None)
    assert calc.calls == 0 and not (tmp_path / "a.traj").exists()


def test_a_slab_cell_without_a_third_vector_is_fine(tmp_path):
    atoms = _copper()
    atoms.pbc = (True, True, False)
    atoms.cell[2] = 0.0
    plan_md(atoms, EMT(), steps=1, log=None)


def test_first_ctrl_c_says_at_once_what_happens_and_the_log_ends_with_the_trajectory(tmp_path, capsys):
    seen: list[str] = []

    def press() -> None:
        signal.raise_signal(signal.SIGINT)
        seen.append(capsys.readouterr().err)  # printed by the time the step goes on

    lines: list[str] = []
    plot = tmp_path / "cut.png"
    with pytest.raises(MDInterrupted) as info:
        run_md(_copper(), CallHook({8: press}), steps=20, trajectory=tmp_path / "cut.traj", trajectory_interval=5,
               log_interval=5, log=lines.append, plot=plot)
    assert "Ctrl-C: the run stops after the current step" in seen[0] and "Ctrl-C again to stop now" in seen[0]
    assert info.value.step == 7
    assert [f.info["md_step"] for f in _frames(tmp_path / "cut.traj")] == [0, 5, 7]
    progress = [int(line.split()[0]) for line in lines if line.split()[0].isdigit()]
    assert progress == [0, 5, 7]  # the log (and the plot, drawn from it) end where the trajectory does
    assert "interrupted (Ctrl-C) at step 7" in lines[-2] and lines[-1] == f"plot: {plot}"


def test_a_second_ctrl_c_while_a_frame_is_written_lets_the_frame_finish(tmp_path, monkeypatch):
    write = TrajectoryWriter.write

    def write_with_a_second_press(self, step, info):
        if step == 7:
            signal.raise_signal(signal.SIGINT)  # the second Ctrl-C, in the middle of writing step 7's frame
        write(self, step, info)

    monkeypatch.setattr(TrajectoryWriter, "write", write_with_a_second_press)
    with pytest.raises(MDInterrupted, match="at step 7"):
        run_md(_copper(), CallHook({8: lambda: signal.raise_signal(signal.SIGINT)}), steps=20,
               trajectory=tmp_path / "cut.traj", trajectory_interval=5, log=None)
    assert [f.info["md_step"] for f in _frames(tmp_path / "cut.traj")] == [0, 5, 7]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_plot_that_fails_after_a_good_run_is_a_warning(tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(plot_module, "write_plot", fail)
    lines: list[str] = []
    summary = run_md(_copper(), EMT(), steps=2, plot=tmp_path / "a.png", log=lines.append)
    assert summary.plot is None and summary.steps == 2
    assert f"warning: plot: {tmp_path / 'a.png'} not written (Operation not permitted)" in lines
    assert lines[-1].startswith("done: 2 steps")


def test_unwritable_outputs_are_refused_at_start_naming_the_argument(tmp_path):
    if not Path("/sys").is_dir():
        pytest.skip("needs /sys (a folder no one may create files in)")
    for key, name in (("trajectory", "/sys/out.traj"), ("log", "/sys/out.log"), ("plot", "/sys/out.png")):
        calc = CallHook()
        with pytest.raises(PermissionError, match=f"{key}: cannot write {name}: Permission denied"):
            run_md(_copper(), calc, steps=2, **{key: name})
        assert calc.calls == 0


def test_zero_steps_and_one_atom_read_well(tmp_path):
    lines: list[str] = []
    run_md(_copper(), EMT(), steps=0, log=lines.append)
    assert lines[-1].startswith("done: 0 steps, 0 ps in") and "nan" not in lines[-1]
    lines.clear()
    run_md(Atoms("Cu", cell=[10, 10, 10], pbc=False), EMT(), steps=1, log=lines.append)
    assert lines[0].startswith("cgforge md: 1 atom, NVT") and lines[-1].startswith("done: 1 step, ")
