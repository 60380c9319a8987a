"""run_md / `cgforge md` on cgforge's device engine (``engine="device"`` on CPU tensors here; the default on CUDA):
the same frames, lines, blow-up errors and exit codes, Ctrl-C and restarts as on ASE's dynamics; host copies only
at log and trajectory steps; --engine/--thermostat checks; --plot.

A small random MACE model (FP64, forces scaled to water's size) keeps each step cheap: the driver is under test."""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from ase.build import bulk
from ase.calculators.emt import EMT
from ase.io import read
from mace_helpers import build_model  # noqa: E402

from cgforge.plugin import Calculator  # noqa: E402
from cgforge.plugin.cli import EXIT_ERROR, EXIT_UNSTABLE, main  # noqa: E402
from cgforge.plugin.md.engine import Engine  # noqa: E402
from cgforge.plugin.md.options import EngineOptions  # noqa: E402
from cgforge.plugin.md.run import MDInstabilityError, MDInterrupted, run_md  # noqa: E402
from cgforge.plugin.runtime.step_graph import ModelStep  # noqa: E402
from cgforge.plugin.water import water_box  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        stiff = build_model(r_max=4.0)
    finally:
        torch.set_default_dtype(dtype)
    stiff.scale_shift.scale *= 1000  # water-like forces (max ~0.6 eV/Å) instead of a random model's ~1e-3
    return stiff


@pytest.fixture
def calc(model, fp64_one_thread) -> Calculator:
    return Calculator(copy.deepcopy(model), device="cpu", dtype="float64")


@pytest.fixture(scope="module")
def model_file(model, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("models") / "water.model"
    torch.save(copy.deepcopy(model), path)
    return path


def _steps(path: Path) -> list[int]:
    return [int(f.info["md_step"]) for f in read(path, ":")]


def _final(path: Path):
    return read(path, -1)


def _nan_from_call(monkeypatch, first: int, what: str = "forces", action=None) -> list[int]:
    """ModelStep.compute (the engine's model call, not the calculator's) returns non-finite forces or energy from
    call ``first`` on, or runs ``action`` at that call."""
    calls = [0]
    compute = ModelStep.compute

    def patched(self, **kw):
        out = compute(self, **kw)
        calls[0] += 1
        if calls[0] < first:
            return out
        if action is not None:
            if calls[0] == first:
                action()
            return out
        if what == "forces":
            forces = out.forces.clone()
            forces[3, 1] = math.nan
            return dataclasses.replace(out, forces=forces)
        return dataclasses.replace(out, energy=out.energy * math.inf)

    monkeypatch.setattr(ModelStep, "compute", patched)
    return calls


# --- the same run on both paths ---------------------------------------------------------------------------


def test_nve_on_the_engine_equals_ase_and_writes_the_same_frames_and_lines(calc, tmp_path):
    """FP64, the same calculator: velocity Verlet in torch and ASE's in numpy do the same operations. Bound 1e-10
    (measured bit for bit)."""
    runs = {}
    for engine in ("ase", "device"):
        lines: list[str] = []
        summary = run_md(water_box(4, seed=1), calc, ensemble="nve", temperature_K=300, timestep_fs=0.5, steps=6,
                         trajectory_interval=2, log_interval=3, seed=2, trajectory=tmp_path / f"{engine}.traj",
                         engine=engine, log=lines.append)
        assert summary.engine == engine and summary.steps == 6 and summary.last_step == 6
        runs[engine] = (read(tmp_path / f"{engine}.traj", ":"), lines)
    (ase_frames, ase_lines), (dev_frames, dev_lines) = runs["ase"], runs["device"]
    assert [f.info["md_step"] for f in dev_frames] == [0, 2, 4, 6]
    for a, d in zip(ase_frames, dev_frames, strict=True):
        assert np.abs(a.positions - d.positions).max() <= 1e-10
        assert np.abs(a.get_momenta() - d.get_momenta()).max() <= 1e-10
        assert np.abs(a.get_forces() - d.get_forces()).max() <= 1e-10
        assert abs(a.get_potential_energy() - d.get_potential_energy()) <= 1e-10
        assert a.info["md_etot0"] == pytest.approx(d.info["md_etot0"], abs=1e-10)
    assert "md_engine" in dev_frames[-1].info and "cgforge_engine" not in dev_frames[-1].info
    assert "device engine (velocity_verlet on cpu)" in dev_lines[0] and "ASE VelocityVerlet" in ase_lines[0]
    assert len(dev_lines) == len(ase_lines) == 1 + 1 + 3 + 1  # banner, header, steps 0, 3, 6, done
    assert "ns/day" in dev_lines[1]
    for a, d in zip(ase_lines[2:5], dev_lines[2:5], strict=True):  # step, time, T, Etot, drift (not the speed)
        assert a.split()[:2] + a.split()[3:] == d.split()[:2] + d.split()[3:]


def test_the_host_sees_the_state_only_at_log_and_trajectory_steps(calc, tmp_path, monkeypatch):
    writes: list[int] = []
    write_atoms = Engine._write_atoms

    def counted(self):
        writes.append(self.step)
        write_atoms(self)

    monkeypatch.setattr(Engine, "_write_atoms", counted)
    run_md(water_box(4, seed=1), calc, ensemble="nvt", steps=12, log_interval=4, trajectory_interval=6,
           trajectory=tmp_path / "t.traj", engine="device", log=None, engine_options=EngineOptions(block=3))
    assert writes == [0, 4, 6, 8, 12]
    assert _steps(tmp_path / "t.traj") == [0, 6, 12]


@pytest.mark.parametrize("ensemble, extra", [("nvt", {"friction": 0.05}), ("nvt", {"thermostat": "csvr"}),
                                             ("npt", {"pressure_bar": 5000.0, "taup_fs": 100.0})])
def test_engine_restart_repeats_the_uninterrupted_run(calc, tmp_path, ensemble, extra):
    """The engine's noise is a hash of (seed, step): the seed and step in the frame continue the same sequence.
    The restart rebuilds the neighbour list, which the model's own code sums in list order: bound 1e-12 (measured
    bit for bit)."""
    common = dict(ensemble=ensemble, temperature_K=400, timestep_fs=0.5, trajectory_interval=3, seed=7,
                  engine="device", log=None, **extra)
    run_md(water_box(4, seed=3), calc, steps=6, trajectory=tmp_path / "whole.traj", **common)
    run_md(water_box(4, seed=3), calc, steps=3, trajectory=tmp_path / "half.traj", **common)
    with pytest.raises(ValueError, match="seed: .*half.traj ran with seed 7, and a restart continues its run"):
        run_md(None, calc, restart=tmp_path / "half.traj", steps=3, trajectory=tmp_path / "x.traj",
               **{**common, "seed": 1})  # the frame's seed is the run's (as ASE's saved generator state is)
    summary = run_md(None, calc, restart=tmp_path / "half.traj", steps=3, trajectory=tmp_path / "rest.traj",
                     **common)
    assert (summary.first_step, summary.last_step, summary.engine) == (3, 6, "device")
    whole, again = _final(tmp_path / "whole.traj"), _final(tmp_path / "rest.traj")
    assert again.info["md_step"] == 6 and again.info["md_time_fs"] == 3.0
    assert np.abs(whole.positions - again.positions).max() <= 1e-12
    assert np.abs(whole.get_momenta() - again.get_momenta()).max() <= 1e-12
    assert np.abs(whole.cell.array - again.cell.array).max() <= 1e-12
    assert whole.info["md_etot0"] == again.info["md_etot0"]
    if ensemble == "npt":
        assert not np.allclose(whole.cell.array, water_box(4, seed=3).cell.array)  # the barostat moved the cell
        assert "stress" in whole.calc.results  # NPT frames carry the stress


# --- blow-ups, Ctrl-C --------------------------------------------------------------------------------------


@pytest.mark.parametrize("what, match", [("forces", "the forces are not finite"),
                                         ("energy", "the potential energy is")])
def test_engine_blow_up_stops_naming_the_step_and_keeps_the_trajectory_and_plot(calc, tmp_path, monkeypatch, what,
                                                                                 match):
    _nan_from_call(monkeypatch, 5, what)  # call 1: the start's forces; call k + 1: step k
    lines: list[str] = []
    out, plot = tmp_path / "boom.traj", tmp_path / "boom.png"
    with pytest.raises(MDInstabilityError, match=rf"MD became unstable at step 4: {match}") as info:
        run_md(water_box(4, seed=1), calc, ensemble="nve", steps=10, trajectory=out, trajectory_interval=1,
               log_interval=1, engine="device", log=lines.append, plot=plot)
    assert info.value.step == 4 and info.value.quantity == what
    assert _steps(out) == [0, 1, 2, 3]
    assert lines[-2].startswith("stopped: MD became unstable at step 4") and lines[-1] == f"plot: {plot}"
    assert plot.read_bytes()[:8] == PNG_MAGIC
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_engine_temperature_limit(calc):
    with pytest.raises(MDInstabilityError, match=r"unstable at step \d+: the temperature reached .* above the limit "
                                                 r"of 310 K \(max_temperature_K") as info:
        run_md(water_box(4, seed=1), calc, ensemble="nvt", temperature_K=300, max_temperature_K=310, friction=1.0,
               steps=200, seed=5, engine="device", log=None, init_velocities=False)
    assert info.value.quantity == "temperature" and info.value.value > 310 and info.value.step >= 1


def test_cli_blow_up_on_the_engine_exits_3(model_file, tmp_path, capsys, monkeypatch):
    _nan_from_call(monkeypatch, 3)
    out = tmp_path / "boom.traj"
    code = main(["md", "--model", str(model_file), "--molecules", "4", "--device", "cpu", "--relax", "0",
                 "--engine", "device", "--steps", "10", "--traj-interval", "1", "--dtype", "float64", "-o", str(out)])
    assert code == EXIT_UNSTABLE == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "MD became unstable at step 2: the forces are not finite" in err[0]
    assert _steps(out) == [0, 1]


def test_engine_ctrl_c_stops_after_the_block_and_the_run_continues(calc, tmp_path, monkeypatch):
    common = dict(ensemble="nvt", temperature_K=400, timestep_fs=0.5, seed=2, trajectory_interval=5, engine="device",
                  engine_options={"block": 2})
    run_md(water_box(4, seed=1), calc, steps=12, trajectory=tmp_path / "whole.traj", log=None, **common)
    # SIGINT during step 6 (call 7): the block of steps 6-7 completes, then the run stops at step 7
    _nan_from_call(monkeypatch, 7, action=lambda: signal.raise_signal(signal.SIGINT))
    lines: list[str] = []
    plot = tmp_path / "cut.png"
    with pytest.raises(MDInterrupted) as info:
        run_md(water_box(4, seed=1), calc, steps=12, trajectory=tmp_path / "cut.traj", log=lines.append, plot=plot,
               **common)
    monkeypatch.undo()
    assert info.value.step == 7 and info.value.summary.engine == "device"
    assert "interrupted (Ctrl-C) at step 7" in lines[-2] and lines[-1] == f"plot: {plot}"
    assert _steps(tmp_path / "cut.traj") == [0, 5, 7]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert plot.read_bytes()[:8] == PNG_MAGIC
    run_md(None, calc, restart=tmp_path / "cut.traj", steps=5, trajectory=tmp_path / "rest.traj", log=None, **common)
    assert np.abs(_final(tmp_path / "whole.traj").positions - _final(tmp_path / "rest.traj").positions).max() <= 1e-12


# --- choices and their checks ------------------------------------------------------------------------------


def _copper():
    atoms = bulk("Cu", cubic=True).repeat((2, 2, 2))
    atoms.rattle(0.02, seed=0)
    return atoms


@pytest.mark.parametrize("kwargs, error, match", [
    ({"engine": "gpu"}, ValueError, "engine: expected one of auto, device, ase, got 'gpu'"),
    ({"engine": 1}, TypeError, "engine: expected one of auto, device, ase"),
    ({"engine": "device"}, ValueError, r"engine: the device engine cannot run this: the device engine runs the "
                                       r"model step of a cgforge Calculator; EMT is not one.*; use engine ase"),
    ({"thermostat": "nose"}, ValueError, "thermostat: expected one of langevin, csvr"),
    ({"ensemble": "nve", "thermostat": "csvr"}, ValueError, "thermostat: the thermostat choice is for NVT"),
    ({"thermostat": "csvr", "friction": 0.1}, ValueError, r"friction: the Langevin friction is for NVT \(langevin\); "
                                                          r"this run is NVT \(csvr\)"),
    ({"taut_fs": 50.0}, ValueError, r"taut_fs: the CSVR thermostat's coupling time is for NVT \(csvr\) and "
                                     r"NPT; this run is NVT \(langevin\)"),
    ({"plot": "x.jpg"}, ValueError, r"plot: x.jpg must end with .png, .pdf or .svg"),
    ({"engine_options": {"blocks": 3}}, ValueError, "engine_options: unknown key 'blocks'"),
    ({"engine_options": {"block": 0}}, ValueError, "block: expected an int >= 1, got 0"),
    ({"engine_options": {"padded": True}}, ValueError, "engine_options: padded=True has no effect on run_md, which "
                                                      "reads block, steps_per_graph"),
    ({"engine_options": [("block", 3)]}, TypeError, "engine_options: expected EngineOptions, a dict or None"),
])
def test_engine_and_thermostat_arguments_are_checked_first(tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        run_md(_copper(), EMT(), steps=2, trajectory=tmp_path / "t.traj", log=None, **kwargs)
    assert os.listdir(tmp_path) == []


def test_auto_runs_ase_on_a_cpu_and_csvr_on_both_paths(calc, tmp_path):
    summary = run_md(_copper(), EMT(), steps=4, thermostat="csvr", taut_fs=20.0, timestep_fs=2.0, log=None,
                     trajectory=tmp_path / "emt.traj")
    assert summary.engine == "ase" and "md_rng" in _final(tmp_path / "emt.traj").info  # ASE's Bussi
    assert run_md(water_box(4), calc, steps=2, log=None).engine == "ase"  # a cgforge Calculator on a CPU
    summary = run_md(water_box(4), calc, steps=4, thermostat="csvr", engine="device", log=None)
    assert summary.engine == "device" and math.isfinite(summary.temperature_K)


@pytest.mark.parametrize("too_large", [False, True])
def test_auto_takes_ase_dynamics_for_a_box_the_memory_plan_streams(too_large):
    """On CUDA 'auto' asks the calculator's memory plan for the box first: one that only fits streaming (chunk
    ranges read on the host each step) runs under ASE's dynamics, the rest on the captured engine. A stand-in
    calculator says CUDA; the plan's own numbers are tests/test_memory_plan.py's."""
    from types import SimpleNamespace

    from cgforge.plugin.md.dynamics import choose_engine

    asked = []

    def plan_for(atoms):
        asked.append(len(atoms))
        stand_in.streaming = too_large

    stand_in = SimpleNamespace(step=None, adapter=None, neighbours=None, device=torch.device("cuda"), streaming=False,
                               plan_for=plan_for)
    box = water_box(4)
    assert choose_engine("auto", stand_in, box) == ("ase" if too_large else "device") and asked == [len(box)]
    assert choose_engine("ase", stand_in, box) == "ase" and asked == [len(box)]  # no plan needed


def test_ase_csvr_restart_continues_the_saved_generator(tmp_path):
    """ASE's Bussi draws from the numpy generator whose state each frame saves (md_rng)."""
    common = dict(thermostat="csvr", taut_fs=20.0, temperature_K=500, timestep_fs=2.0, seed=4, log=None,
                  trajectory_interval=5)
    run_md(_copper(), EMT(), steps=10, trajectory=tmp_path / "whole.traj", **common)
    run_md(_copper(), EMT(), steps=5, trajectory=tmp_path / "half.traj", **common)
    run_md(None, EMT(), restart=tmp_path / "half.traj", steps=5, trajectory=tmp_path / "rest.traj", **common)
    whole, again = _final(tmp_path / "whole.traj"), _final(tmp_path / "rest.traj")
    assert again.info["md_step"] == 10
    # EMT's sums follow its neighbour list, rebuilt at the restart: equal to rounding
    assert np.abs(whole.get_momenta() - again.get_momenta()).max() <= 1e-10


def test_cli_engine_and_thermostat_flags(model_file, tmp_path, capsys):
    for bad in (["--engine", "gpu"], ["--thermostat", "berendsen"]):
        with pytest.raises(SystemExit) as info:  # argparse's choices: a usage error, before anything loads
            main(["md", *bad])
        assert info.value.code == 2
    capsys.readouterr()
    base = ["md", "--model", str(model_file), "--molecules", "4", "--device", "cpu", "--relax", "0", "--steps", "2"]
    assert main([*base, "--ensemble", "nve", "--thermostat", "csvr", "-o", str(tmp_path / "a.traj")]) == EXIT_ERROR
    assert "--thermostat: the thermostat choice is for NVT" in capsys.readouterr().err
    out = tmp_path / "csvr.traj"
    assert main([*base, "--engine", "device", "--thermostat", "csvr", "--taut", "50", "-o", str(out)]) == 0
    assert "device engine (csvr on cpu)" in capsys.readouterr().out
    assert "md_engine" in _final(out).info


# --- the plot ----------------------------------------------------------------------------------------------


def test_plot_is_a_png_of_the_run_and_never_overwrites_an_input(calc, tmp_path, capsys):
    plot = tmp_path / "npt.png"
    summary = run_md(water_box(4, seed=2), calc, ensemble="npt", steps=4, log_interval=1, engine="device",
                     trajectory=tmp_path / "npt.traj", plot=plot, log=None)
    assert summary.plot == str(plot)
    assert plot.read_bytes()[:8] == PNG_MAGIC
    from matplotlib.image import imread

    image = imread(plot)
    assert image.ndim == 3 and image.shape[0] > 500 and image.shape[1] > 500  # five panels
    with pytest.raises(FileExistsError, match="plot: .*npt.png exists"):
        run_md(water_box(4), calc, steps=1, plot=plot, log=None)
    with pytest.raises(ValueError, match=r"plot: .*npt.traj is the restart file"):  # the real reason comes first
        run_md(None, calc, restart=tmp_path / "npt.traj", steps=1, plot=tmp_path / "npt.traj", force=True, log=None)
    with pytest.raises(ValueError, match=r"plot: .*o.traj must end with .png, .pdf or .svg"):  # never a trajectory
        run_md(None, calc, restart=tmp_path / "npt.traj", steps=1, plot=tmp_path / "o.traj", log=None)
    with pytest.raises(ValueError, match="log and plot name the same file"):
        run_md(water_box(4), calc, steps=1, plot=tmp_path / "x.png", log=tmp_path / "x.png")
    structure = tmp_path / "in.png.xyz"
    water_box(4).write(structure)
    assert main(["md", "--structure", str(structure), "--device", "cpu", "--plot", str(structure), "--force",
                 "-o", str(tmp_path / "o.traj")]) == EXIT_ERROR
    assert "--plot: " in capsys.readouterr().err  # a .xyz is no plot name, and never the input
    (tmp_path / "in.png").write_bytes(b"keep")
    assert main(["md", "--structure", str(tmp_path / "in.png"), "--device", "cpu", "--plot",
                 str(tmp_path / "in.png"), "--force", "-o", str(tmp_path / "o.traj")]) == EXIT_ERROR
    assert "--plot: " in capsys.readouterr().err and (tmp_path / "in.png").read_bytes() == b"keep"


# --- CUDA ----------------------------------------------------------------------------------------------------


@pytest.mark.cuda
def test_run_md_takes_the_engine_by_default_on_cuda(tmp_path):
    torch.set_default_dtype(torch.float32)
    calc = Calculator("mace", device="cuda")
    lines: list[str] = []
    summary = run_md(water_box(64, seed=1), calc, steps=20, log_interval=10, trajectory=tmp_path / "gpu.traj",
                     log=lines.append)
    assert summary.engine == "device" and "device engine (langevin on cuda" in lines[0]
    frames = read(tmp_path / "gpu.traj", ":")
    assert [f.info["md_step"] for f in frames] == [0, 10, 20] and np.isfinite(frames[-1].get_forces()).all()
    assert run_md(water_box(64, seed=1), calc, steps=2, engine="ase", log=None).engine == "ase"
    assert calc.memory_plan is not None and calc.memory_plan.edges > 0 and not calc.streaming  # planned by run_md


@pytest.mark.cuda
def test_cuda_engine_path_equals_ase_path_in_fp64(tmp_path):
    """The captured engine and ASE's velocity Verlet over the calculator's own captured step, FP64, 20 steps: the
    same trajectory to 1e-8 Å (the integrator's float64 arithmetic may round differently on the GPU)."""
    torch.set_default_dtype(torch.float64)
    calc = Calculator("mace", device="cuda", dtype="float64")
    frames = {}
    for engine in ("device", "ase"):
        out = tmp_path / f"{engine}.traj"
        run_md(water_box(64, seed=2), calc, ensemble="nve", steps=20, trajectory=out, engine=engine, log=None,
               plot=tmp_path / f"{engine}.png")
        frames[engine] = read(out, ":")
        assert (tmp_path / f"{engine}.png").read_bytes()[:8] == PNG_MAGIC
    for a, d in zip(frames["ase"], frames["device"], strict=True):
        assert np.abs(a.positions - d.positions).max() <= 1e-8
        assert np.abs(a.get_forces() - d.get_forces()).max() <= 1e-6


def test_a_restart_continues_on_the_engine_that_wrote_it(calc, tmp_path):
    """issue 61: a device-engine trajectory restarted without engine= continued on ASE's Langevin (auto on a CPU),
    whose noise differs, silently. The engine is followed now; another one given is said; a calculator the engine
    cannot run is refused naming the restart and the way out."""
    common = dict(ensemble="nvt", temperature_K=400, timestep_fs=0.5, trajectory_interval=3, seed=7)
    run_md(water_box(4, seed=3), calc, steps=6, trajectory=tmp_path / "whole.traj", engine="device", log=None,
           **common)
    run_md(water_box(4, seed=3), calc, steps=3, trajectory=tmp_path / "half.traj", engine="device", log=None,
           **common)
    lines: list[str] = []
    summary = run_md(None, calc, restart=tmp_path / "half.traj", steps=3, trajectory=tmp_path / "rest.traj",
                     log=lines.append)
    assert summary.engine == "device" and not any(line.startswith("note:") for line in lines)
    whole, again = _final(tmp_path / "whole.traj"), _final(tmp_path / "rest.traj")
    assert np.abs(whole.positions - again.positions).max() <= 1e-12
    lines.clear()
    summary = run_md(None, calc, restart=tmp_path / "half.traj", steps=1, trajectory=tmp_path / "ase.traj",
                     engine="ase", log=lines.append)
    assert summary.engine == "ase"
    assert lines[0].startswith(f"note: {tmp_path / 'half.traj'} was written by cgforge's device engine; this run "
                               "continues on ASE's dynamics, whose random numbers differ")
    with pytest.raises(ValueError, match=r"engine: the device engine \(.*half.traj was run by it, and a restart "
                                         r"continues on it\) cannot run this: .*EMT is not one.*; use engine ase"):
        run_md(None, EMT(), restart=tmp_path / "half.traj", steps=1, log=None)


@pytest.mark.cuda
def test_a_gpu_run_restarted_on_a_cpu_stays_on_the_device_engine(tmp_path):
    """issue 61: the trial's silent switch. A CUDA run (the device engine by default) restarted without engine= on
    a CPU calculator (where auto means ASE's dynamics) continues on the device engine, as its frames say."""
    torch.set_default_dtype(torch.float64)
    gpu = Calculator("mace", device="cuda", dtype="float64")
    run_md(water_box(16, seed=2), gpu, steps=4, trajectory=tmp_path / "gpu.traj", log=None, seed=3)
    assert "md_engine" in read(tmp_path / "gpu.traj").info
    lines: list[str] = []
    summary = run_md(None, Calculator("mace", device="cpu", dtype="float64", patch=True), restart=tmp_path / "gpu.traj",
                     steps=2, trajectory=tmp_path / "cpu.traj", log=lines.append)
    assert summary.engine == "device" and not any(line.startswith("note:") for line in lines)
