"""MD driver, `cgforge md` and examples/water_md.py: they run, conserve energy in NVE, write trajectories to
new files only."""

from __future__ import annotations

import copy
import io
import runpy
from pathlib import Path

import numpy as np
import pytest
import torch
from ase.io import read
from mace_helpers import build_model  # noqa: E402

from cgforge.plugin import Calculator, run_md  # noqa: E402
from cgforge.plugin.cli import main as cli_main  # noqa: E402
from cgforge.plugin.water import QSPCFwCalculator, water_box  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
cuda = pytest.mark.cuda


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return build_model(r_max=4.0)


@pytest.fixture(scope="module")
def model_file(model, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("models") / "water.model"
    torch.save(copy.deepcopy(model), path)
    return path


@pytest.mark.slow
def test_nve_conserves_energy(model, tmp_path):
    stiff = copy.deepcopy(model)
    stiff.scale_shift.scale *= 1000  # water-like forces (max ~0.6 eV/Å) instead of a random model's ~1e-3
    atoms = water_box(8, seed=1)
    lines: list[str] = []
    summary = run_md(atoms, Calculator(stiff, device="cpu"), ensemble="nve", temperature_K=300,
                     timestep_fs=0.25, steps=40, log_interval=10, trajectory=tmp_path / "nve.traj", log=lines.append)
    # Bound: 0.05 meV/atom over 10 fs at 0.25 fs steps. Measured 0.003; forces off by 10% give ~2.
    assert summary.temperature_K > 50  # it moved
    frames = read(tmp_path / "nve.traj", ":")
    assert len(frames) == 5  # steps 0, 10, 20, 30, 40
    assert not np.allclose(frames[0].positions, frames[-1].positions)
    assert np.isfinite(frames[-1].get_forces()).all()  # forces stored with the frames
    assert len(lines) == 2 + 5 + 1  # banner, header, 5 progress lines, done
    assert "ns/day" in lines[1] and "drift" in lines[1]


@pytest.mark.slow  # > 10 s on a CPU: the full tier (CI) runs it
def test_nvt_thermostat_and_extxyz(model, tmp_path):
    atoms = water_box(8, seed=2)
    summary = run_md(atoms, Calculator(copy.deepcopy(model), device="cpu"), ensemble="nvt", temperature_K=500,
                     timestep_fs=0.5, steps=12, friction=0.05, trajectory=tmp_path / "nvt.xyz", trajectory_interval=4,
                     log_interval=5, log=None, seed=3)
    assert summary.steps == 12 and summary.ns_per_day > 0
    frames = read(tmp_path / "nvt.xyz", ":")
    assert len(frames) == 4


def test_run_md_refuses_to_overwrite_and_bad_arguments(model, tmp_path):
    calc = Calculator(copy.deepcopy(model), device="cpu", warmup=False)
    existing = tmp_path / "old.traj"
    existing.write_text("keep me")
    atoms = water_box(8, seed=1)
    with pytest.raises(FileExistsError, match="exists"):
        run_md(atoms, calc, steps=1, trajectory=existing, log=None)
    assert existing.read_text() == "keep me"
    run_md(atoms, calc, steps=2, trajectory=existing, force=True, trajectory_interval=1, log=None)
    assert len(read(existing, ":")) == 3
    for kwargs, match in [({"ensemble": "npx"}, "ensemble"), ({"steps": -1}, "steps"),
                          ({"timestep_fs": 0}, "timestep_fs"), ({"trajectory": tmp_path / "x.pdb"}, "trajectory"),
                          ({"trajectory": tmp_path / "no" / "x.traj"}, "does not exist")]:
        with pytest.raises(ValueError if "exist" not in match else FileNotFoundError, match=match):
            run_md(atoms, calc, log=None, **kwargs)


@pytest.mark.slow
def test_cli_md_runs_and_refuses_to_overwrite(model_file, tmp_path, capsys):
    out = tmp_path / "cli.traj"
    argv = ["md", "--model", str(model_file), "--molecules", "8", "--steps", "4", "--traj-interval", "2",
            "--log-interval", "2", "--device", "cpu", "-o", str(out)]
    assert cli_main(argv) == 0
    printed = capsys.readouterr().out
    assert "ns/day" in printed and str(out) in printed
    assert len(read(out, ":")) == 3
    size = out.stat().st_size
    assert cli_main(argv) == 1
    assert "exists" in capsys.readouterr().err
    assert out.stat().st_size == size
    assert cli_main([*argv, "--force", "--ensemble", "nve"]) == 0


@pytest.mark.slow  # > 10 s on a CPU: the full tier (CI) runs it
def test_cli_md_relaxes_a_generated_box_first(tmp_path, capsys):
    """The bundled model on the grid box: forces of eV/Å that FIRE brings down before MD starts."""
    argv = ["md", "--model", "mace", "--molecules", "8", "--steps", "1", "--device", "cpu", "--relax", "20"]
    assert cli_main([*argv, "-o", str(tmp_path / "r.traj")]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("relaxed"))
    before, after = (float(v) for v in line.split("energy ")[1].split(" eV")[0].split(" -> "))
    assert after < before - 1.0 and "relaxed 20 FIRE steps" in line
    assert cli_main([*argv[:-2], "--relax", "-1", "-o", str(tmp_path / "n.traj")]) == 1
    assert "--relax" in capsys.readouterr().err


def test_cli_md_reads_a_structure_and_reports_bad_input(model_file, tmp_path, capsys):
    structure = tmp_path / "in.xyz"
    water_box(8, seed=4).write(structure)
    out = tmp_path / "s.traj"
    assert cli_main(["md", "--model", str(model_file), "--structure", str(structure), "--steps", "2",
                     "--device", "cpu", "-o", str(out)]) == 0
    assert len(read(out, ":")) >= 1
    assert cli_main(["md", "--model", str(tmp_path / "nope.model"), "--molecules", "8", "--steps", "1",
                     "--device", "cpu", "-o", str(tmp_path / "n.traj")]) == 1
    assert "not found" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert cli_main(["md", "--model", str(model_file), "--device", "cuda", "-o", str(tmp_path / "c.traj")]) == 1
        assert "CUDA is not available" in capsys.readouterr().err
    assert cli_main(["md", "--model", str(model_file), "--molecules", "8", "--device", "cpu", "--radial-precision",
                     "3xtf32", "-o", str(tmp_path / "t.traj")]) == 1
    assert "--radial-precision: 3xtf32 needs a CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "t.traj").exists()


def test_water_md_example(model_file, tmp_path, capsys):
    main = runpy.run_path(str(ROOT / "examples" / "water_md.py"))["main"]
    out = tmp_path / "example.traj"
    argv = ["--model", str(model_file), "--molecules", "8", "--steps", "3", "--log-interval", "1",
            "--device", "cpu", "-o", str(out), "--log", str(tmp_path / "example.log")]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "final temperature" in printed and "ns/day" in printed
    assert (tmp_path / "example.log").read_text().splitlines()[-1] in printed  # the MD lines to both
    assert [f.info["md_step"] for f in read(out, ":")] == [0, 3]  # frames every 10 steps and the last step
    with pytest.raises(FileExistsError):
        main(argv)


@pytest.mark.slow  # > 10 s on a CPU: the full tier (CI) runs it
def test_bundled_mace_nve(tmp_path):
    """The bundled water model: NVE from an equilibrated small box conserves energy.

    The grid box of rigid molecules is far from equilibrium (its potential energy heats it to ~2000 K
    within 20 fs, with q-SPC/Fw as with the model), so it is first thermalised at 300 K with q-SPC/Fw
    (cheap). Bound: 0.05 meV/atom over 40 velocity-Verlet steps of 0.5 fs; q-SPC/Fw itself drifts by
    ~0.005 from the same state, a wrong or non-conservative force by meV/atom.
    """
    atoms = water_box(32, seed=0)
    run_md(atoms, QSPCFwCalculator(), ensemble="nvt", temperature_K=300, timestep_fs=0.5, steps=400,
           friction=0.05, log=None)
    summary = run_md(atoms, Calculator("mace", device="cpu"), ensemble="nve", timestep_fs=0.5, steps=40,
                     init_velocities=False, log=io.StringIO().write)
    assert abs(summary.energy_drift_meV_per_atom) < 0.05
    assert 150 < summary.temperature_K < 600


@cuda
def test_cuda_1000_steps_of_the_5184_atom_box(tmp_path):
    """1000 NVT steps on the benchmark box (FP32, small MACE): no neighbour-list or memory error, sane T."""
    atoms = water_box(n_side=12)
    torch.cuda.reset_peak_memory_stats()  # the peak of this run, not of earlier tests in the process
    calc = Calculator(build_model(hidden="16x0e+16x1o", r_max=5.0, dtype=torch.float32), device="cuda")
    summary = run_md(atoms, calc, ensemble="nvt", temperature_K=300, timestep_fs=0.5, steps=1000,
                     log_interval=250, trajectory=tmp_path / "big.traj", trajectory_interval=500, log=None)
    assert summary.steps == 1000 and np.isfinite(summary.temperature_K)
    assert calc.neighbours.n_builds >= 1
    peak = torch.cuda.max_memory_allocated()
    assert peak < 40e9, f"peak GPU memory {peak / 1e9:.1f} GB"


@pytest.mark.slow
def test_cli_md_refuses_a_missing_element_and_another_model_before_any_step(model, model_file, tmp_path, capsys):
    """issue 41: an element the model lacks is found right after the load (before relaxation and step 0); a
    restart on another model than the trajectory's is refused before its first step, never with a drift from the
    other model's energy."""
    structure = tmp_path / "salty.xyz"
    atoms = water_box(8, seed=4)
    atoms.numbers[0] = 11  # Na: the model knows H and O
    atoms.write(structure)
    argv = ["md", "--model", str(model_file), "--device", "cpu", "--relax", "3"]
    assert cli_main([*argv, "--structure", str(structure), "-o", str(tmp_path / "na.traj")]) == 1
    captured = capsys.readouterr()
    assert "cgforge md: error: --structure: element(s) Na not known to the model, which knows H, O" in captured.err
    assert "relaxed" not in captured.out and "step" not in captured.out and not (tmp_path / "na.traj").exists()
    first = tmp_path / "first.traj"
    assert cli_main([*argv[:-2], "--molecules", "8", "--relax", "5", "--ensemble", "nve", "--steps", "2",
                     "-o", str(first)]) == 0
    other = tmp_path / "other.model"
    torch.save(build_model(r_max=4.0, seed=1), other)
    capsys.readouterr()
    assert cli_main(["md", "--model", str(other), "--device", "cpu", "--restart", str(first), "-o",
                     str(tmp_path / "b.traj")]) == 1
    captured = capsys.readouterr()
    assert f"--restart: {first} was run with {model_file} (mace)" in captured.err
    assert "a restart continues the same model" in captured.err and "stopped" not in captured.out  # printed once
    assert not (tmp_path / "b.traj").exists()
    assert cli_main(["md", "--model", str(model_file), "--device", "cpu", "--restart", str(first), "--steps", "2",
                     "-o", str(tmp_path / "c.traj")]) == 0  # the same model continues
    assert "NVE" in capsys.readouterr().out
