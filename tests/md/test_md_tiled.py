"""MD with the fixed-workspace evaluation (``workspace="tiled"``): ASE's integrator drives the tiled calculator and
the trajectory equals the whole graph's; ``cgforge md --workspace tiled`` says so in its banner (issue 37)."""

from __future__ import annotations

import numpy as np
import pytest
from ase.io import read

from cgforge.plugin import Calculator
from cgforge.plugin.cli import main
from cgforge.plugin.md.run import run_md
from cgforge.plugin.runtime.options import RuntimeOptions
from cgforge.plugin.water import water_box


def _run(workspace: str, tmp_path, fp64_one_thread) -> np.ndarray:
    atoms = water_box(16, seed=5)
    calc = Calculator("mace", "cpu", "float64", workspace=workspace, options=RuntimeOptions(tile_atoms=16))
    out = tmp_path / f"{workspace}.traj"
    run_md(atoms, calc, ensemble="nve", timestep_fs=0.5, steps=4, trajectory=str(out), trajectory_interval=2,
           log_interval=2, seed=1)
    if workspace == "tiled":
        assert calc.potential.workspace.tiled_last and calc.potential.workspace.grid.n_tiles > 1
    return np.stack([frame.positions for frame in read(out, ":")])


@pytest.mark.slow
def test_nve_in_tiles_follows_the_whole_graphs_trajectory(tmp_path, fp64_one_thread):
    whole = _run("whole", tmp_path, fp64_one_thread)
    tiled = _run("tiled", tmp_path, fp64_one_thread)
    assert whole.shape == tiled.shape and whole.shape[0] >= 2
    np.testing.assert_allclose(tiled, whole, rtol=0, atol=1e-10)


def test_cgforge_md_workspace_tiled_runs_and_says_so(tmp_path, capsys):
    out = tmp_path / "md.traj"
    code = main(["md", "--molecules", "8", "--device", "cpu", "--relax", "0", "--steps", "2", "--workspace", "tiled",
                 "--ensemble", "nve", "-o", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "tiles with a fixed working set (workspace tiled)" in text
    assert len(read(out, ":")) >= 1


def test_the_device_engine_refuses_a_tiled_calculator_naming_why(fp64_one_thread):
    import pytest

    calc = Calculator("mace", "cpu", "float64", workspace="tiled", options=RuntimeOptions(tile_atoms=25))
    with pytest.raises(ValueError, match="evaluates this system in tiles"):
        run_md(water_box(8, seed=5), calc, ensemble="nve", steps=1, engine="device")
