"""`cgforge md` as the new user met it (issue 41, "What the new user met"): restarts continue the run they name,
outputs are checked writable before the model loads, structure problems and missing elements are found before
any step, a hint before a box far too large for a CPU, the banner says which code runs and the effective
options, `--version`/`--help` import no torch, the license needs no deprecated table, and the path from the
command line to the model call visits each file once. The q-SPC/Fw stand-in of test_cli_md replaces the model."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import traceback
import warnings
from pathlib import Path

import numpy as np
import pytest
from ase import Atoms
from ase.io import read
from test_cli_md import StandIn, _one_line_error

from cgforge.patches.common import UnknownElementError
from cgforge.plugin import calculator as calculator_module
from cgforge.plugin.cli import EXIT_ERROR, EXIT_OK, main
from cgforge.plugin.cli import md as md_cli
from cgforge.plugin.water import water_box

ROOT = Path(__file__).resolve().parents[2]


class WaterOnly:
    """The adapter surface `cgforge md` checks elements with: H and O only, as the bundled water models."""

    kind = "q-SPC/Fw stand-in"

    def species(self, numbers):
        bad = sorted(set(np.asarray(numbers).tolist()) - {1, 8})
        if bad:
            raise UnknownElementError(f"atoms: element(s) Z={bad} not known to the model, which knows H, O")
        return numbers


class CheckedStandIn(StandIn):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.adapter = WaterOnly()


class OtherModel(CheckedStandIn):
    """Another model: the same forces, every energy 0.1 eV per atom higher."""

    def calculate(self, atoms=None, properties=("energy",), system_changes=()) -> None:
        super().calculate(atoms, properties, system_changes)
        for key in ("energy", "free_energy"):
            if key in self.results:
                self.results[key] = self.results[key] + 0.1 * len(self.atoms)


@pytest.fixture
def stand_in(monkeypatch):
    StandIn.made.clear()
    monkeypatch.setattr(calculator_module, "Calculator", CheckedStandIn)
    return CheckedStandIn


def _no_model(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(calculator_module, "Calculator", refuse)


def _box(tmp_path: Path, *extra: str) -> list[str]:
    return ["md", "--molecules", "4", "--device", "cpu", "--relax", "0", *extra]


# --- 1, 2: restarts -------------------------------------------------------------------------------------------


def test_a_restart_continues_the_saved_ensemble_and_refuses_a_contradicting_flag(tmp_path, capsys, stand_in,
                                                                                monkeypatch):
    first = tmp_path / "nve.traj"
    assert main([*_box(tmp_path), "--ensemble", "nve", "--timestep", "0.25", "--steps", "4", "-o", str(first)]) == 0
    capsys.readouterr()
    second = tmp_path / "b.traj"
    assert main(["md", "--restart", str(first), "--device", "cpu", "--steps", "2", "-o", str(second)]) == 0
    out = capsys.readouterr().out
    assert ", NVE, timestep 0.25 fs, 2 steps from step 4 of" in out
    frames = read(second, ":")
    assert {f.info["md_ensemble"] for f in frames} == {"nve"} and frames[-1].info["md_timestep_fs"] == 0.25
    # NVT with its options: the restart keeps them all
    nvt = tmp_path / "nvt.traj"
    assert main([*_box(tmp_path), "--temperature", "350", "--thermostat", "csvr", "--taut", "50", "--seed", "7",
                 "--steps", "2", "-o", str(nvt)]) == 0
    assert main(["md", "--restart", str(nvt), "--device", "cpu", "--steps", "2", "-o", str(tmp_path / "c.traj")]) == 0
    info = read(tmp_path / "c.traj").info
    assert (info["md_ensemble"], info["md_thermostat"], info["md_temperature_K"], info["md_taut_fs"],
            info["md_seed"]) == ("nvt", "csvr", 350.0, 50.0, 7)
    capsys.readouterr()
    _no_model(monkeypatch)  # a contradiction is refused before the model loads
    for flag, value, saved in (("--ensemble", "nvt", "ensemble NVE"), ("--temperature", "300", None),
                               ("--timestep", "0.5", "timestep 0.25")):
        source = nvt if flag == "--temperature" else first
        assert main(["md", "--restart", str(source), "--device", "cpu", flag, value,
                     "-o", str(tmp_path / "d.traj")]) == EXIT_ERROR
        line = _one_line_error(capsys)
        assert f"{flag}: {source} ran with {saved or 'temperature 350.0'}, and a restart continues its run" in line
        assert f"--structure {source}" in line
    assert not (tmp_path / "d.traj").exists()


def test_a_restart_with_another_model_is_refused_before_any_step(tmp_path, capsys, stand_in, monkeypatch):
    first = tmp_path / "a.traj"
    assert main([*_box(tmp_path), "--ensemble", "nve", "--steps", "2", "-o", str(first)]) == 0
    capsys.readouterr()
    monkeypatch.setattr(calculator_module, "Calculator", OtherModel)
    assert main(["md", "--restart", str(first), "--device", "cpu", "--model", "nequip", "-o",
                 str(tmp_path / "b.traj")]) == EXIT_ERROR
    captured = capsys.readouterr()
    assert "a restart continues the same model" in captured.err and "was run with mace" in captured.err
    assert "100 meV/atom apart" in captured.err and f"--structure {first}" in captured.err
    assert "stopped" not in captured.out and len(captured.err.splitlines()) == 1  # the error printed once
    assert not (tmp_path / "b.traj").exists()


# --- 3: outputs writable at start ------------------------------------------------------------------------------


@pytest.mark.skipif(not Path("/sys").is_dir(), reason="needs /sys (a folder no one may create files in)")
@pytest.mark.parametrize("flag, name", [("-o", "/sys/out.traj"), ("--log", "/sys/x.log"), ("--plot", "/sys/x.png")])
def test_unwritable_outputs_fail_before_the_model_loads_naming_flag_and_path(tmp_path, capsys, monkeypatch, flag,
                                                                             name):
    _no_model(monkeypatch)
    extra = [] if flag == "-o" else ["-o", str(tmp_path / "a.traj")]
    assert main([*_box(tmp_path), flag, name, *extra]) == EXIT_ERROR
    line = _one_line_error(capsys)
    what = "--trajectory" if flag == "-o" else flag
    assert line == f"cgforge md: error: {what}: cannot write {name}: Permission denied"
    assert os.listdir(tmp_path) == []


def test_a_plot_that_fails_after_a_good_run_is_a_warning_with_the_summary(tmp_path, capsys, stand_in, monkeypatch):
    from cgforge.plugin.md import plot as plot_module

    def fail(*args, **kwargs):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(plot_module, "write_plot", fail)
    plot = tmp_path / "x.png"
    assert main([*_box(tmp_path), "--steps", "2", "-o", str(tmp_path / "a.traj"), "--plot", str(plot)]) == EXIT_OK
    captured = capsys.readouterr()
    assert f"warning: --plot: {plot} not written (Operation not permitted)" in captured.out
    assert captured.out.splitlines()[-1].startswith("done: 2 steps") and captured.err == ""


def test_exists_is_not_shown_before_the_real_reason(tmp_path, capsys, monkeypatch):
    _no_model(monkeypatch)
    structure = tmp_path / "in.xyz"
    water_box(4).write(structure)
    assert main(["md", "--structure", str(structure), "--device", "cpu", "-o", str(structure)]) == EXIT_ERROR
    line = _one_line_error(capsys)
    assert "is the --structure file" in line and "pass --force" not in line


# --- 4: structure problems before the model, missing elements before any step ------------------------------------


@pytest.mark.parametrize("atoms, message", [
    (Atoms("OH2", positions=[[0, 0, 0], [0.96, np.nan, 0], [-0.24, 0.93, 0]], cell=[6, 6, 6], pbc=True),
     "--structure: 1 of 3 atoms have non-finite positions (first: atom 1, H"),
    (Atoms("OH2", positions=[[0, 0, 0], [0.96, 0, 0], [-0.24, 0.93, 0]], cell=[[6, 0, 0], [6, 0, 0], [0, 0, 6]],
           pbc=True), "--structure: the cell is singular along its periodic directions"),
])
def test_structure_problems_are_found_before_the_model_loads(tmp_path, capsys, monkeypatch, atoms, message):
    _no_model(monkeypatch)
    structure = tmp_path / "in.traj"
    atoms.write(structure)
    assert main(["md", "--structure", str(structure), "--device", "cpu", "-o", str(tmp_path / "a.traj")]) == 1
    assert message in _one_line_error(capsys)


def test_an_element_the_model_lacks_is_found_right_after_the_load(tmp_path, capsys, stand_in):
    structure = tmp_path / "salty.xyz"
    atoms = water_box(4)
    atoms.numbers[0] = 11
    atoms.write(structure)
    assert main(["md", "--structure", str(structure), "--device", "cpu", "--relax", "5", "-o",
                 str(tmp_path / "a.traj")]) == EXIT_ERROR
    captured = capsys.readouterr()
    assert "--structure: element(s) Z=[11] not known to the model" in captured.err
    assert captured.out.startswith("model mace") and "relaxed" not in captured.out and "step" not in captured.out
    assert not (tmp_path / "a.traj").exists()


# --- 6, 7: the size hint, which code runs, the effective options --------------------------------------------------


def test_a_box_too_large_for_a_cpu_gets_a_hint_first(tmp_path, capsys, stand_in, monkeypatch):
    hint = md_cli.size_hint(60_000, "cpu")
    assert "60,000 atoms on a CPU: expect roughly 60 s per step and 15 GB" in hint and "--device cuda" in hint
    assert md_cli.size_hint(md_cli.CPU_HINT_ATOMS, "cpu") is None and md_cli.size_hint(12, "cpu", 11) is not None
    monkeypatch.setattr(md_cli, "size_hint", functools.partial(md_cli.size_hint, above_atoms=10))  # the rule's
    assert main([*_box(tmp_path), "--steps", "0", "-o", str(tmp_path / "a.traj")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("hint: 12 atoms on a CPU") and lines[1].startswith("model mace")


def test_help_and_banner_say_which_code_runs_and_the_effective_options(tmp_path, capsys, stand_in):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "on a CPU: the model's own code" in text and "on a GPU: cgforge's kernels" in text
    with pytest.raises(SystemExit):
        main(["md", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "FP32 MACE and NequIP models on CUDA" in text  # --radial-table
    assert "after --restart: the run's saved value" in text
    assert main([*_box(tmp_path), "--steps", "0", "-o", str(tmp_path / "a.traj")]) == 0
    out = capsys.readouterr().out
    assert "on cpu in float32, the model's own code" in out
    assert ("options: engine ASE's dynamics (auto: ASE's dynamics on a CPU), torch.compile off, CUDA graph off, "
            "radial tables off, memory: stored edges, skin 2 Å") in out
    assert "done: 0 steps, 0 ps in" in out and "nan" not in out


# --- 8: --version and --help import no torch ---------------------------------------------------------------------


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["md", "--help"]])
@pytest.mark.smoke
def test_version_and_help_load_no_torch(argv):
    code = ("import sys\nfrom cgforge.plugin.cli import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "heavy = [m for m in ('torch', 'e3nn', 'ase', 'cgforge.patches', 'cgforge.kernels') if m in sys.modules]\n"
            "print('HEAVY', heavy)")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "HEAVY []"


# --- 9: the license is an SPDX string (no setuptools deprecation box on install) --------------------------------


def test_the_license_is_an_spdx_expression(monkeypatch):
    pytest.importorskip("setuptools")
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    monkeypatch.chdir(ROOT)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), ROOT / "pyproject.toml")
    assert not [w for w in caught if "license" in str(w.message).lower()]
    assert dist.metadata.license_expression == "MIT"


# --- issue 36: the path from the command line to the model call visits each file once ----------------------------


def test_the_path_from_the_command_line_to_the_model_call_visits_each_file_once(tmp_path, monkeypatch):
    stacks: list[list[str]] = []

    class Recording(CheckedStandIn):
        def calculate(self, *args, **kwargs) -> None:
            if not stacks:
                stacks.append([f.filename for f in traceback.extract_stack()])
            super().calculate(*args, **kwargs)

    monkeypatch.setattr(calculator_module, "Calculator", Recording)
    assert main([*_box(tmp_path), "--steps", "1", "-o", str(tmp_path / "a.traj")]) == 0
    package = str(ROOT / "cgforge")
    files = [Path(f).relative_to(package).as_posix() for f in stacks[0] if f.startswith(package)]
    visits = [f for i, f in enumerate(files) if i == 0 or files[i - 1] != f]
    assert visits == ["plugin/cli/commands.py", "plugin/cli/md.py", "plugin/md/run.py"], visits  # then ASE's dynamics


def test_every_option_and_output_path_is_checked_once(tmp_path, stand_in, monkeypatch):
    """issue 36: `cgforge md` checked every option and output path twice (the command line, then run_md)."""
    import cgforge.plugin.md.run  # noqa: F401  (every module that binds the checks, patched where it binds them)
    from cgforge.plugin.md.options import MDOptions

    calls: dict[str, list] = {"check_new_path": [], "MDOptions": []}
    checked = MDOptions.__post_init__
    monkeypatch.setattr(MDOptions, "__post_init__", lambda self, names: calls["MDOptions"].append(names) or
                        checked(self, names))
    for name, seen in [("check_new_path", calls["check_new_path"])]:
        for module in [m for n, m in list(sys.modules.items()) if n.startswith("cgforge") and hasattr(m, name)]:
            original = getattr(module, name)

            def counted(*args, _original=original, _seen=seen, **kwargs):
                _seen.append(args[0])
                return _original(*args, **kwargs)

            monkeypatch.setattr(module, name, counted)
    outputs = [tmp_path / "a.traj", tmp_path / "a.log", tmp_path / "a.png"]
    assert main([*_box(tmp_path), "--steps", "1", "-o", str(outputs[0]), "--log", str(outputs[1]),
                 "--plot", str(outputs[2])]) == 0
    assert sorted(map(str, calls["check_new_path"])) == sorted(map(str, outputs))
    assert len(calls["MDOptions"]) == 1


def test_a_new_run_from_a_restart_frame_keeps_velocities_and_drops_the_old_records(tmp_path, capsys, stand_in):
    """What the refusal suggests: --structure TRAJ starts a new run from the last frame (velocities kept) with
    other options, and its frames carry none of the old run's records (its random state)."""
    first = tmp_path / "nvt.traj"
    assert main([*_box(tmp_path), "--steps", "2", "-o", str(first)]) == 0
    assert "md_rng" in read(first).info
    second = tmp_path / "nve.traj"
    assert main(["md", "--structure", str(first), "--device", "cpu", "--ensemble", "nve", "--steps", "2", "-o",
                 str(second)]) == 0
    frames = read(second, ":")
    assert np.allclose(frames[0].get_momenta(), read(first).get_momenta())
    assert frames[0].info["md_step"] == 0 and frames[0].info["md_ensemble"] == "nve"
    assert not any("md_rng" in f.info for f in frames)


# --- issue 61: what a new-user trial found -------------------------------------------------------------------


def test_a_restart_without_model_runs_the_model_its_frames_name(tmp_path, capsys, stand_in):
    first = tmp_path / "n.traj"
    assert main([*_box(tmp_path), "--model", "nequip", "--steps", "2", "-o", str(first)]) == 0
    assert read(first).info["md_model"] == "nequip (q-SPC/Fw stand-in)"
    capsys.readouterr()
    assert main(["md", "--restart", str(first), "--device", "cpu", "--steps", "1", "-o", str(tmp_path / "b.traj")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("model nequip (q-SPC/Fw stand-in") and read(tmp_path / "b.traj").info["md_model"] == \
        "nequip (q-SPC/Fw stand-in)"
    from cgforge.plugin.md.files import Restart

    gone = Restart(path=first, atoms=Atoms(), step=2, time_fs=1.0, etot0=None, rng_state=None,
                   model=f"{tmp_path / 'gone.model'} (mace)")
    with pytest.raises(ValueError, match=r"--restart: .*n.traj was run with the model .*gone.model \(mace\), which is "
                                         "not a bundled model and not a file here; name it with --model"):
        md_cli.model_of(None, gone)


def test_cli_messages_use_flag_spellings(tmp_path, capsys, stand_in):
    out = tmp_path / "a.traj"
    out.write_text("mine")
    assert main([*_box(tmp_path), "--steps", "1", "-o", str(out)]) == EXIT_ERROR
    line = _one_line_error(capsys)
    assert "pass --force to overwrite" in line and "force=True" not in line
    assert md_cli.flag_spelling("dtype: expected None, 'float32' or 'float64', got 'x'") == \
        "--dtype: expected None, 'float32' or 'float64', got 'x'"
    assert md_cli.flag_spelling("radial_table=True: its blocks; pass dtype=None") == \
        "--radial-table on: its blocks; leave out --dtype"
