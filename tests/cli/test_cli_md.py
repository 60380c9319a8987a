"""`cgforge md` under bad input: flags checked before the model loads and named, outputs never the inputs,
unreadable structures in one line, blow-ups and Ctrl-C with their exit codes, --log, --ensemble npt,
--restart, --version and `python -m cgforge`. A q-SPC/Fw stand-in replaces the model where the model is not
under test (tests/test_md.py runs the command with real models)."""

from __future__ import annotations

import functools
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from ase import Atoms
from ase.io import read

import cgforge
from cgforge.plugin import calculator as calculator_module
from cgforge.plugin.cli import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_TERMINATED, EXIT_UNSTABLE, main
from cgforge.plugin.runtime.bundled import model_path
from cgforge.plugin.water import QSPCFwCalculator, water_box

ROOT = Path(__file__).resolve().parents[2]


class StandIn(QSPCFwCalculator):
    """Takes Calculator's arguments and shows the attributes `cgforge md` reads; q-SPC/Fw water underneath."""

    made: list[StandIn] = []

    def __init__(self, model, device=None, dtype=None, *, skin=1.0, radial_precision="fp32", radial_table=None,
                 stress_with_forces=False) -> None:
        super().__init__(cutoff=6.0, skin=skin)
        self.model = torch.nn.Linear(1, 1).to(torch.float32)
        self.adapter = SimpleNamespace(kind="q-SPC/Fw stand-in")
        self.device = torch.device(device)
        self.dtype = torch.float64
        self.radial_precision_requested = radial_precision
        self.radial_table_requested = radial_table
        self.stress_with_forces = stress_with_forces
        StandIn.made.append(self)


@pytest.fixture
def stand_in(monkeypatch):
    StandIn.made.clear()
    monkeypatch.setattr(calculator_module, "Calculator", StandIn)
    return StandIn


@pytest.fixture
def no_model(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(calculator_module, "Calculator", refuse)


def _md(tmp_path: Path, *extra: str) -> list[str]:
    return ["md", "--molecules", "4", "--device", "cpu", "--relax", "0", "-o", str(tmp_path / "out.traj"), *extra]


def _one_line_error(capsys) -> str:
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    return lines[0]


@pytest.mark.parametrize("extra, message", [
    (["--temperature", "-10"], "--temperature: expected a finite number >= 0, got -10.0"),
    (["--timestep", "0"], "--timestep: expected a finite number > 0, got 0.0"),
    (["--timestep", "nan"], "--timestep"),
    (["--steps", "-1"], "--steps: expected an int >= 0, got -1"),
    (["--traj-interval", "0"], "--traj-interval"),
    (["--log-interval", "0"], "--log-interval"),
    (["--seed", "-1"], "--seed"),
    (["--skin", "-1"], "--skin"),
    (["--relax", "-1"], "--relax"),
    (["--ensemble", "nve", "--friction", "0.1"], "--friction: the Langevin friction is for NVT (langevin); this "
                                                 "run is NVE"),
    (["--pressure", "10"], "--pressure: the barostat's pressure is for NPT; this run is NVT"),
    (["--taut", "50"], "--taut: the CSVR thermostat's coupling time is for NVT (csvr) and NPT; this run is NVT "
                       "(langevin)"),
    (["--ensemble", "npt", "--taup", "0"], "--taup"),
    (["--ensemble", "npt", "--compressibility", "-1"], "--compressibility"),
    (["--max-temperature", "100"], "--max-temperature: the blow-up limit 100 K must be above the target temperature"),
    (["--max-temperature", "-1"], "--max-temperature"),
    (["--model", "missing.model"], "--model: missing.model not found"),
    (["--log", "."], "--log: . is a directory"),
    (["--log", "no/such/dir/md.log"], "--log: directory no/such/dir does not exist"),
    (["--device", "tpu"], "--device: expected 'cpu', 'cuda' or 'cuda:N', got 'tpu'"),
    (["--radial-precision", "tf32"], "--radial-precision: tf32 needs a CUDA device"),
    (["--compile", "reduce-overhead"], "--compile: mode 'reduce-overhead' captures CUDA graphs of its own"),
    (["--compile", "fast"], "--compile: expected one of auto, off, default, max-autotune-no-cudagraphs, got 'fast'"),
])
def test_bad_flags_fail_before_the_model_loads_and_name_the_flag(tmp_path, capsys, no_model, extra, message):
    assert main(_md(tmp_path, *extra)) == EXIT_ERROR
    assert message in _one_line_error(capsys)
    assert os.listdir(tmp_path) == []


def test_compile_flag_reaches_the_calculator(tmp_path, capsys, monkeypatch):
    seen = []

    def capture(*args, **kwargs):
        seen.append(kwargs.get("compile", False))
        raise ValueError("stopped after the flags (test)")

    monkeypatch.setattr(calculator_module, "Calculator", capture)
    for extra in ([], ["--compile"], ["--compile", "max-autotune-no-cudagraphs"], ["--compile", "off"],
                  ["--compile", "auto"]):
        assert main(_md(tmp_path, *extra)) == EXIT_ERROR
        assert "stopped after the flags (test)" in _one_line_error(capsys)
    # auto and off build an eager calculator; auto decides after the model is loaded (auto_compile)
    assert seen == [False, "default", "max-autotune-no-cudagraphs", False, False]


class _StandInCalculator:
    """What auto_compile reads of a Calculator, on a device named without needing one."""

    def __init__(self, device: str, patched: bool = True, fits: bool = True, error: Exception | None = None,
                 tiles: bool = False):
        self.device, self.patched, self.fits, self.error, self.tiles = torch.device(device), patched, fits, error, tiles
        self.compile = None

    def compiled_fits(self, atoms) -> bool:
        if self.tiles:
            raise AssertionError("compiled_fits builds the whole Verlet list: not for a system in tiles")
        return self.fits

    def uses_tiles(self, atoms) -> bool:
        return self.tiles

    def set_compile(self, mode) -> None:
        if self.error is not None and mode:
            raise self.error
        self.compile = mode


class _Trial:
    """A stand-in for the engine trial: the ms a step of the calculator as it is set (plain or compiled); a time of
    None raises the engine's MDBlowUp (the trial's steps blew up)."""

    def __init__(self, calc: _StandInCalculator, plain_ms: float | None, compiled_ms: float | None):
        self.calc, self.plain_ms, self.compiled_ms, self.calls = calc, plain_ms, compiled_ms, []

    def __call__(self) -> tuple[float, float]:
        from cgforge.plugin.md.commit import MDBlowUp

        self.calls.append(self.calc.compile)
        ms, seconds = (self.compiled_ms, 21.0) if self.calc.compile else (self.plain_ms, 0.5)
        if ms is None:
            raise MDBlowUp(7, "energy", float("nan"))
        return ms, seconds


def test_compile_auto_rule():
    from cgforge.plugin.md.compile_trial import KEEP_BELOW
    from cgforge.plugin.md.options import COMPILE_AUTO_MIN_SECONDS, COMPILE_AUTO_MIN_STEPS
    from cgforge.plugin.md.run import auto_compile

    atoms = Atoms("H2O", positions=[[0, 0, 0], [0.96, 0, 0], [-0.24, 0.93, 0]])
    long_run = 100_000  # 100 s a millisecond of step
    assert long_run >= COMPILE_AUTO_MIN_STEPS and long_run * 2.0 / 1e3 >= COMPILE_AUTO_MIN_SECONDS

    def calc_and_trial(device="cuda", plain_ms=2.0, compiled_ms=1.5, **kwargs):
        calc = _StandInCalculator(device, **kwargs)
        return calc, _Trial(calc, plain_ms, compiled_ms)

    cpu, trial = calc_and_trial("cpu")
    assert auto_compile(cpu, atoms, long_run, trial) is None and cpu.compile is None and not trial.calls
    short, trial = calc_and_trial()
    line = auto_compile(short, atoms, COMPILE_AUTO_MIN_STEPS - 1, trial)
    assert f"off ({COMPILE_AUTO_MIN_STEPS - 1:,} steps; auto tries it for runs of {COMPILE_AUTO_MIN_STEPS:,}" in line
    assert short.compile is None and not trial.calls  # too short for a trial at all
    # long enough to try, but its plain steps take less than the minimum: timed plain once, never compiled
    quick, trial = calc_and_trial(plain_ms=0.1)
    said = []
    line = auto_compile(quick, atoms, long_run, trial, say=said.append)
    assert "off (100,000 steps of 0.10 ms take ~10 s; auto tries it for runs of 200 s" in line and not said
    assert quick.compile is None and trial.calls == [None]
    faster, trial = calc_and_trial(plain_ms=2.0, compiled_ms=1.5)
    said = []
    line = auto_compile(faster, atoms, long_run, trial, say=said.append)
    assert said == ["torch.compile auto: the plain step takes 2.00 ms here; compiling the model to time its compiled "
                    "step (tens of seconds)"]  # before the compiled trial, which compiles
    assert line == ("torch.compile: on (a trial on this system: 1.50 ms a step compiled, 2.00 plain; compiled in "
                    "21 s)") and faster.compile == "default" and trial.calls == [None, "default"]
    slower, trial = calc_and_trial(plain_ms=2.0, compiled_ms=2.2)
    line = auto_compile(slower, atoms, long_run, trial)
    assert line.startswith("torch.compile: off (a trial on this system: 2.20 ms a step compiled, 2.00 plain")
    assert slower.compile is False and trial.calls == [None, "default"]  # compiled, timed, set back to plain
    close, trial = calc_and_trial(plain_ms=2.0, compiled_ms=2.0 * KEEP_BELOW + 1e-3)  # within the trial's spread
    assert "off (a trial" in auto_compile(close, atoms, long_run, trial) and close.compile is False
    ase_path, _ = calc_and_trial()
    line = auto_compile(ase_path, atoms, long_run, None)
    assert "off (auto decides by a trial of the device engine" in line and ase_path.compile is None
    full, trial = calc_and_trial(fits=False)
    line = auto_compile(full, atoms, long_run, trial)
    assert "off (the box leaves too little GPU memory)" in line and full.compile is None and not trial.calls
    unpatched, trial = calc_and_trial(patched=False)
    assert "not patched by cgforge" in auto_compile(unpatched, atoms, long_run, trial)
    tiled, trial = calc_and_trial(tiles=True)
    assert "off (the system runs in tiles" in auto_compile(tiled, atoms, long_run, trial) and tiled.compile is None
    blown, trial = calc_and_trial(plain_ms=None)  # auto stays plain, the run reports the blow-up itself
    line = auto_compile(blown, atoms, long_run, trial)
    assert line.startswith("torch.compile: off (the trial's plain steps blew up: MD blew up at step 7") and \
        blown.compile is None
    blown, trial = calc_and_trial(compiled_ms=None)
    line = auto_compile(blown, atoms, long_run, trial)
    assert line.startswith("torch.compile: off (the trial's compiled steps blew up") and not blown.compile
    no_triton, trial = calc_and_trial(error=RuntimeError("compile: Inductor needs Triton"))
    assert auto_compile(no_triton, atoms, long_run, trial) == "torch.compile: off (compile: Inductor needs Triton)"
    assert not no_triton.compile


@pytest.mark.cuda
def test_compile_auto_compiles_a_long_run_on_the_gpu(tmp_path, capsys, monkeypatch):
    """`cgforge md` on a GPU with the auto rule's thresholds lowered to this run's length and its keep rule set to
    keep the compiled step whatever the trial measures: the trial times both engines on the GPU, the model stays
    compiled, the engine fuses its integrator, the run ends well, from the structure as given."""
    from cgforge.plugin.md import run as md_run

    torch.set_default_dtype(torch.float32)
    torch._dynamo.reset()
    monkeypatch.setattr(md_run, "auto_compile", functools.partial(md_run.auto_compile, min_steps=30, min_seconds=0.0,
                                                                  keep_below=math.inf))
    args = ["md", "--molecules", "64", "--device", "cuda", "--relax", "0", "--steps", "30",
            "-o", str(tmp_path / "out.traj")]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "torch.compile: on (a trial on this system: " in out, out
    frames = read(tmp_path / "out.traj", ":")
    assert len(frames) >= 2 and frames[0].info["md_step"] == 0
    assert main([*args[:-1], str(tmp_path / "short.traj"), "--steps", "29"]) == 0
    assert "torch.compile: off (29 steps" in capsys.readouterr().out
    torch._dynamo.reset()


def test_bad_flags_that_need_files(tmp_path, capsys, no_model):
    molecule = tmp_path / "gas.xyz"
    Atoms("H2O", positions=[[0, 0, 0], [0.96, 0, 0], [-0.24, 0.93, 0]]).write(molecule)
    assert main(["md", "--structure", str(molecule), "--ensemble", "npt", "-o", str(tmp_path / "a.traj")]) == 1
    assert "--ensemble: NPT changes the cell and needs a periodic 3-D cell" in _one_line_error(capsys)
    assert main(["md", "--molecules", "0", "-o", str(tmp_path / "a.traj")]) == 1
    assert "--molecules: expected an int >= 1, got 0" in _one_line_error(capsys)
    assert main(["md", "--molecules", "4", "-o", str(tmp_path / "a.pdb")]) == 1
    assert "--trajectory: " in _one_line_error(capsys)
    restart = tmp_path / "r.traj"
    restart.write_bytes(b"")
    assert main(["md", "--restart", str(restart), "--relax", "5", "-o", str(tmp_path / "a.traj")]) == 1
    assert "--relax: a restart continues the saved state" in _one_line_error(capsys)
    assert main(["md", "--restart", str(molecule), "-o", str(tmp_path / "a.traj")]) == 1
    assert "--restart: " in (line := _one_line_error(capsys)) and "no MD step counter" in line


def test_usage_errors_exit_2(capsys):
    for argv in (["md", "--ensemble", "nvx"], ["md", "--molecules", "4", "--structure", "a.xyz"],
                 ["md", "--restart", "a.traj", "--molecules", "4"], ["md", "--steps", "ten"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
    capsys.readouterr()


def test_outputs_never_overwrite_the_inputs_even_with_force(tmp_path, capsys, no_model):
    structure = tmp_path / "in.xyz"
    water_box(4).write(structure)
    model = tmp_path / "my.model"
    model.write_bytes(b"a model")
    before = structure.read_bytes()
    (tmp_path / "sub").mkdir()
    base = ["md", "--structure", str(structure), "--device", "cpu", "--force"]
    cases = [
        (["-o", str(structure)], "--trajectory: " + str(structure) + " is the --structure file"),
        (["--log", str(structure)], "--log: " + str(structure) + " is the --structure file"),
        (["-o", str(tmp_path / "a.traj"), "--log", str(tmp_path / "a.traj")], "--trajectory and --log name the same"),
        (["--model", str(model), "--log", str(model)], "is the --model file"),
        (["-o", str(tmp_path / "sub" / ".." / "in.xyz")], "is the --structure file"),
    ]
    for extra, message in cases:
        assert main([*base, *extra]) == EXIT_ERROR
        assert message in _one_line_error(capsys)
    assert main(["md", "--restart", str(structure), "-o", str(structure), "--force"]) == EXIT_ERROR
    assert "is the --restart file" in _one_line_error(capsys)
    assert structure.read_bytes() == before and model.read_bytes() == b"a model"


def test_unreadable_structures_are_one_line_naming_the_file(tmp_path, capsys, no_model):
    (tmp_path / "empty.xyz").write_bytes(b"")
    (tmp_path / "words.xyz").write_text("hello world\n")
    (tmp_path / "notes.txt").write_text("not a structure\n")
    (tmp_path / "folder").mkdir()
    cases = [("empty.xyz", "is empty"), ("words.xyz", "not a structure"), ("notes.txt", "not a structure"),
             (model_path("mace"), "not a structure"), (model_path("nequip"), "not a structure"),
             ("folder", "is a directory"), ("missing.xyz", "not found")]
    for name, reason in cases:
        path = tmp_path / name
        assert main(["md", "--structure", str(path), "--device", "cpu", "-o", str(tmp_path / "o.traj")]) == 1, name
        line = _one_line_error(capsys)
        assert f"--structure: {path}" in line and reason in line, line
    assert not (tmp_path / "o.traj").exists()


def test_log_file_restart_and_stand_in_banner(tmp_path, capsys, stand_in):
    log = tmp_path / "run.log"
    first = tmp_path / "first.traj"
    argv = ["md", "--molecules", "4", "--device", "cpu", "--relax", "2", "--steps", "6", "--log-interval", "3",
            "--traj-interval", "3", "--seed", "5", "--timestep", "0.25"]
    assert main([*argv, "-o", str(first), "--log", str(log)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert log.read_text().splitlines() == printed  # every line of the run, the model and relaxation lines too
    assert printed[0].startswith("model mace (q-SPC/Fw stand-in, cutoff 6 Å) on cpu in float32, the model's own "
                                 "code (faster than cgforge's kernels on a CPU), ready in")
    assert "kernels compiled" not in printed[0] and printed[1].startswith("relaxed")
    assert [f.info["md_step"] for f in read(first, ":")] == [0, 3, 6]
    assert main([*argv, "-o", str(first), "--log", str(log)]) == 1  # both exist: refused without --force
    assert "exists" in capsys.readouterr().err
    second = tmp_path / "second.traj"
    restart = ["md", "--restart", str(first), "--device", "cpu", "--steps", "3", "--traj-interval", "3",
               "--timestep", "0.25", "-o", str(second)]
    assert main(restart) == 0
    out = capsys.readouterr().out
    assert "from step 6 of" in out and "relaxed" not in out  # no relaxation of a restart
    assert [f.info["md_step"] for f in read(second, ":")] == [9]


@pytest.mark.parametrize("flag, requested", [(None, None), ("auto", None), ("on", True), ("off", False)])
def test_radial_table_flag_reaches_the_calculator(tmp_path, stand_in, flag, requested):
    extra = () if flag is None else ("--radial-table", flag)
    assert main(_md(tmp_path, "--steps", "2", *extra)) == 0
    assert stand_in.made[-1].radial_table_requested is requested


def test_npt_from_the_command_line(tmp_path, capsys, stand_in):
    out = tmp_path / "npt.traj"
    assert main(["md", "--molecules", "8", "--device", "cpu", "--relax", "0", "--ensemble", "NPT", "--pressure",
                 "1000", "--taup", "200", "--steps", "4", "--timestep", "0.25", "-o", str(out)]) == 0
    assert "NPT at 300 K and 1000 bar" in capsys.readouterr().out
    assert stand_in.made[-1].stress_with_forces is True  # the barostat's stress comes with the forces
    frames = read(out, ":")
    assert frames[-1].info["md_ensemble"] == "npt" and frames[-1].get_volume() != frames[0].get_volume()


def test_a_blow_up_exits_3_with_the_step_and_a_readable_trajectory(tmp_path, capsys, stand_in):
    out = tmp_path / "boom.traj"
    code = main(["md", "--molecules", "8", "--device", "cpu", "--relax", "0", "--ensemble", "nve", "--timestep", "8",
                 "--steps", "50", "--traj-interval", "1", "-o", str(out)])
    assert code == EXIT_UNSTABLE == 3
    line = _one_line_error(capsys)
    step = int(re.search(r"unstable at step (\d+): the temperature reached", line).group(1))
    assert "--max-temperature" in line
    assert [f.info["md_step"] for f in read(out, ":")] == list(range(step))


@pytest.mark.slow
def test_version_and_python_m_cgforge(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"cgforge {cgforge.__version__}"
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^version = "([^"]+)"', pyproject, re.M).group(1) == cgforge.__version__
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "cgforge", "--version"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == f"cgforge {cgforge.__version__}"
    done = subprocess.run([sys.executable, "-m", "cgforge", "md", "--temperature", "-10"], capture_output=True,
                          text=True, env=env, timeout=300)
    assert done.returncode == 1
    assert done.stderr.strip() == "cgforge md: error: --temperature: expected a finite number >= 0, got -10.0"


_CTRL_C_SCRIPT = textwrap.dedent("""
    import sys
    sys.path[:0] = [{tests!r}, {tests!r} + "/cli", {root!r}]
    from test_cli_md import StandIn
    from cgforge.plugin import calculator
    from cgforge.plugin.cli import main
    calculator.Calculator = StandIn
    sys.exit(main(sys.argv[1:]))
""")


def _signal_a_run(tmp_path: Path, signum: int, after_step: int, *extra: str) -> tuple[int, list[str], str, str]:
    """`cgforge md` (the stand-in model) sent ``signum`` once its progress line of ``after_step`` is out: its
    exit code, the lines read before, the rest of stdout, stderr."""
    script = _CTRL_C_SCRIPT.format(tests=str(ROOT / "tests"), root=str(ROOT))
    argv = [sys.executable, "-c", script, "md", "--molecules", "8", "--device", "cpu", "--relax", "0", "--steps",
            "100000", "--log-interval", "1", "--timestep", "0.25", *extra]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    deadline = time.monotonic() + 240
    seen = []
    for line in proc.stdout:  # wait until a few steps have run
        seen.append(line)
        if re.match(rf"\s+{after_step}\s", line) or time.monotonic() > deadline:
            break
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=120)
    return proc.returncode, seen, stdout, stderr


@pytest.mark.slow
def test_ctrl_c_exits_130_with_a_complete_trajectory(tmp_path):
    """A real SIGINT to a running `cgforge md` (the stand-in model): exit 130, a message with the last step,
    a trajectory that ends with that step and continues with --restart."""
    out = tmp_path / "long.traj"
    rc, seen, stdout, stderr = _signal_a_run(tmp_path, signal.SIGINT, 3, "-o", str(out))
    assert rc == EXIT_INTERRUPTED == 130, stderr
    assert stderr.startswith("cgforge md: Ctrl-C: the run stops after the current step"), stderr
    assert "press Ctrl-C again to stop now" in stderr.splitlines()[0]
    step = int(re.search(r"interrupted \(Ctrl-C\) at step (\d+)", stderr).group(1))
    assert f"ends at step {step} (continue with --restart {out}" in stderr and "Traceback" not in stderr
    assert read(out, -1).info["md_step"] == step >= 3
    last = [line for line in "".join(seen).splitlines() + stdout.splitlines() if re.match(r"\s+\d+\s", line)][-1]
    assert int(last.split()[0]) == step  # the last progress line is the trajectory's last step


@pytest.mark.slow
def test_sigterm_exits_143_with_the_last_frame_log_and_plot(tmp_path):
    """What a batch scheduler sends before it kills a job: handled like the first Ctrl-C (issue 63): exit 143,
    the message, a trajectory that ends with the step it names, the log's last lines and the plot."""
    out, log, plot = tmp_path / "long.traj", tmp_path / "long.log", tmp_path / "long.png"
    rc, _, _, stderr = _signal_a_run(tmp_path, signal.SIGTERM, 2, "--traj-interval", "1", "-o", str(out), "--log",
                                     str(log), "--plot", str(plot))  # a frame at every step
    assert rc == EXIT_TERMINATED == 143, stderr
    assert stderr.startswith("cgforge md: SIGTERM: the run stops after the current step"), stderr
    step = int(re.search(r"interrupted \(SIGTERM\) at step (\d+)", stderr).group(1))
    assert f"ends at step {step} (continue with --restart {out}" in stderr and "Traceback" not in stderr
    assert read(out, -1).info["md_step"] == step >= 2
    logged = log.read_text().splitlines()
    assert logged[-2].startswith(f"interrupted (SIGTERM) at step {step}") and logged[-1] == f"plot: {plot}"
    assert plot.stat().st_size > 0 and plot.read_bytes()[:4] == b"\x89PNG"


def test_sigterm_while_the_model_loads_exits_143_and_leaves_no_empty_output(tmp_path, capsys, monkeypatch):
    """Before the run starts SIGTERM unwinds too: exit 143, one line, the reserved trajectory name released."""

    class Terminated(StandIn):
        def __init__(self, *args, **kwargs) -> None:
            os.kill(os.getpid(), signal.SIGTERM)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(calculator_module, "Calculator", Terminated)
    assert main(_md(tmp_path, "--log", str(tmp_path / "a.log"))) == EXIT_TERMINATED
    assert capsys.readouterr().err.strip() == "cgforge md: terminated (SIGTERM)"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.log"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_two_runs_without_a_name_get_two_trajectories(tmp_path, monkeypatch, no_model):
    """A job array's runs started in the same second in one folder: the default name is reserved when it is
    chosen, before the model loads, so the second run takes the next free name (issue 63)."""
    from cgforge.plugin.cli.md import prepare_md

    monkeypatch.chdir(tmp_path)
    args = cgforge.plugin.cli.build_parser().parse_args(["md", "--molecules", "4", "--device", "cpu", "--relax", "0"])
    first, second = prepare_md(args), prepare_md(args)
    assert first.plan.trajectory != second.plan.trajectory and first.plan.trajectory.exists() and \
        second.plan.trajectory.exists()
    assert re.fullmatch(r"md-\d{8}-\d{6}(-\d+)?\.traj", second.plan.trajectory.name)
    first.plan.close()
    second.plan.close()
    assert list(tmp_path.iterdir()) == []  # nothing ran: the reservations are released
