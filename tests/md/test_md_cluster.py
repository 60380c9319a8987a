"""Runs that are safe on a cluster (issue 63): concurrent runs in one folder never share or replace an output
file (names are reserved when chosen), SIGTERM stops a run like the first Ctrl-C, and a trajectory whose last
frame was cut off restarts from its last whole frame. EMT on 32 copper atoms; the command line's SIGTERM is
tested in tests/cli/test_cli_md.py."""

from __future__ import annotations

import os
import re
import signal
import threading
from pathlib import Path

import numpy as np
import pytest
from ase.calculators.emt import EMT
from ase.io import read
from test_md_restarts_and_interrupts import CallHook, _copper

from cgforge.plugin.md.files import default_trajectory_path
from cgforge.plugin.md.run import MDInterrupted, plan_md, run_md


def _own_frames(path: Path, seed: int) -> bool:
    """The first frame of ``path`` is the structure of ``_copper(seed)``."""
    return np.allclose(read(path, 0).positions, _copper(seed).positions)


def test_two_concurrent_runs_in_one_folder_keep_their_own_frames(tmp_path):
    """A job array's two runs started in the same second without a name: each reserves its own file when the
    name is chosen (the bug: both took the same name and one run's frames were replaced)."""
    barrier = threading.Barrier(2)
    summaries: dict[int, object] = {}
    errors: list[BaseException] = []

    def run(seed: int, steps: int) -> None:
        try:
            barrier.wait(timeout=30)
            summaries[seed] = run_md(_copper(seed), EMT(), steps=steps, trajectory_interval=2, log=None,
                                     trajectory=default_trajectory_path("md", tmp_path), seed=seed)
        except BaseException as err:  # noqa: BLE001 (re-raised below, in the test's thread)
            errors.append(err)

    threads = [threading.Thread(target=run, args=(seed, steps)) for seed, steps in ((1, 4), (2, 6))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    names = {seed: Path(s.trajectory) for seed, s in summaries.items()}
    assert names[1] != names[2] and names[1].parent == names[2].parent == tmp_path
    for seed, steps in ((1, 4), (2, 6)):
        assert _own_frames(names[seed], seed)
        assert [f.info["md_step"] for f in read(names[seed], ":")] == list(range(0, steps + 1, 2))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in names.values())  # no leftovers


def test_names_are_reserved_when_chosen_and_released_when_nothing_was_written(tmp_path):
    """Deterministic: two runs planned before either writes a frame get two default names; the same explicit
    name is refused for the second; a run that ends before its first frame leaves no empty file."""
    first = plan_md(_copper(1), EMT(), steps=2, log=None, trajectory=default_trajectory_path("md", tmp_path),
                    plot=tmp_path / "a.png")
    second = plan_md(_copper(2), EMT(), steps=2, log=None, trajectory=default_trajectory_path("md", tmp_path))
    assert first.trajectory != second.trajectory
    assert first.trajectory.exists() and second.trajectory.exists()  # reserved (empty) before any step
    with pytest.raises(FileExistsError, match=r"plot: .*a\.png exists"):
        plan_md(_copper(3), EMT(), steps=2, log=None, plot=tmp_path / "a.png")
    with pytest.raises(FileExistsError, match="exists"):
        plan_md(_copper(3), EMT(), steps=2, log=None, trajectory=first.trajectory)
    second.close()  # never run: its reservation goes
    assert not second.trajectory.exists()
    first.run()
    assert _own_frames(first.trajectory, 1) and (tmp_path / "a.png").stat().st_size > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.trajectory.name, "a.png"])


def test_the_first_frame_never_replaces_a_file_another_program_wrote_there(tmp_path):
    plan = plan_md(_copper(1), EMT(), steps=2, log=None, trajectory=tmp_path / "a.traj")
    (tmp_path / "a.traj").unlink()
    (tmp_path / "a.traj").write_text("another run's frames")
    with pytest.raises(FileExistsError, match=r"trajectory: .*a\.traj was replaced by another program"):
        plan.run()
    assert (tmp_path / "a.traj").read_text() == "another run's frames"
    assert [p.name for p in tmp_path.iterdir()] == ["a.traj"]  # its temporary file removed


def test_sigterm_stops_a_run_like_the_first_ctrl_c(tmp_path, capsys):
    """SIGTERM (a scheduler's) in the middle of run_md: a notice, the step finished, its frame, line and plot,
    then MDInterrupted naming SIGTERM with the restart line; the handler is gone afterwards."""
    lines: list[str] = []
    calc = CallHook({5: lambda: os.kill(os.getpid(), signal.SIGTERM)})
    with pytest.raises(MDInterrupted) as info:
        run_md(_copper(), calc, steps=1000, trajectory=tmp_path / "a.traj", trajectory_interval=100,
               log_interval=100, log=lines.append, plot=tmp_path / "a.png")
    err = info.value
    assert err.signum == signal.SIGTERM and err.step == 4
    assert capsys.readouterr().err.startswith("run_md: SIGTERM: the run stops after the current step")
    assert f"interrupted (SIGTERM) at step 4; trajectory {tmp_path / 'a.traj'} ends at step 4 (continue with " \
           "--restart" in str(err)
    assert read(tmp_path / "a.traj", -1).info["md_step"] == 4
    assert int(lines[-3].split()[0]) == 4 and lines[-2] == str(err) and lines[-1] == f"plot: {tmp_path / 'a.png'}"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def _run_and_cut(tmp_path: Path, name: str, cut: int) -> Path:
    run_md(_copper(), EMT(), ensemble="nve", steps=6, trajectory=tmp_path / name, trajectory_interval=2, log=None)
    path = tmp_path / name
    data = path.read_bytes()
    path.write_bytes(data[:-cut])
    return path


@pytest.mark.parametrize("name, cut", [("a.traj", 40), ("a.traj", 1), ("a.xyz", 300), ("a.xyz", 1)])
def test_a_trajectory_whose_last_frame_was_cut_off_restarts_from_its_last_whole_frame(tmp_path, name, cut):
    path = _run_and_cut(tmp_path, name, cut)
    before = path.read_bytes()
    lines: list[str] = []
    summary = run_md(None, EMT(), restart=path, steps=2, trajectory=tmp_path / f"b{path.suffix}", log=lines.append)
    assert summary.first_step == 4 and summary.last_step == 6  # frames 0, 2, 4 whole; 6 cut
    note = lines[0]
    assert note.startswith(f"restart: {path}: its last frame is cut off") and "frame 3 of 4 (step 4)" in note
    ignored = int(re.search(r"the (\d+) bytes after it are ignored", note).group(1))
    assert ignored >= cut and "the file is left as it is" in note
    assert path.read_bytes() == before  # the user's file is never modified
    assert read(tmp_path / f"b{path.suffix}", -1).info["md_step"] == 6


def test_a_trajectory_with_no_whole_frame_keeps_the_reader_error(tmp_path):
    path = _run_and_cut(tmp_path, "a.traj", 1)
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ValueError, match="not a structure file ase.io can read"):
        run_md(None, EMT(), restart=path, steps=2, trajectory=tmp_path / "b.traj", log=None)


def test_a_cut_off_trajectory_read_as_a_structure_names_its_last_whole_frame(tmp_path):
    path = _run_and_cut(tmp_path, "a.traj", 40)
    with pytest.raises(ValueError, match=r"structure: .*a\.traj: its last frame is cut off .*frame 3 of 4 is the "
                                         r"last whole one, which a restart \(--restart"):
        plan_md(None, EMT(), steps=2, log=None, structure=path)
