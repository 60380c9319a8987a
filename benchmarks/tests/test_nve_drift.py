"""nve_drift.py's numbers from a known energy series, and one short run of the script on the CPU (issue 62's
conservation print)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import nve_drift  # noqa: E402


def test_drift_stats_recover_a_line_and_its_spread():
    times = np.linspace(0.0, 50.0, 501)  # ps
    n_atoms = 1536
    wiggle = 0.01 * np.sin(7.0 * times)  # meV/atom about the line
    per_atom_mev = 0.02 * times + wiggle
    totals = -1000.0 + per_atom_mev * n_atoms / 1e3  # eV
    stats = nve_drift.drift_stats(times, totals, n_atoms)
    assert stats["slope_mev_per_atom_per_ps"] == pytest.approx(0.02, rel=1e-3)
    assert stats["max_abs_mev_per_atom"] == pytest.approx(np.abs(per_atom_mev).max(), rel=1e-9)
    assert stats["spread_mev_per_atom"] == pytest.approx(0.01 / np.sqrt(2), rel=2e-2)
    flat = nve_drift.drift_stats(np.array([0.0]), np.array([-5.0]), 3)  # one read: nothing to fit
    assert flat == {"max_abs_mev_per_atom": 0.0, "slope_mev_per_atom_per_ps": 0.0, "spread_mev_per_atom": 0.0}


@pytest.mark.slow
def test_a_short_cpu_run_prints_and_stores_its_row(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    nve_drift.main(["--models", "bundled-nequip", "--molecules", "8", "--ps", "0.004", "--every", "2",
                    "--equilibrate-ps", "0.003", "--device", "cpu"])
    out = capsys.readouterr().out
    (path,) = tmp_path.glob("nve-drift-*.json")
    row = json.loads(path.read_text())["results"][0]
    assert row["model"] == "bundled-nequip" and row["atoms"] == 24 and row["steps"] == 4
    assert row["equilibration_steps"] == 3  # Langevin first; the NVE's own counts start after it
    assert row["series"]["ps"] == pytest.approx([0.0, 0.002, 0.004])  # E(0) and every 2 steps
    assert row["stats"]["steps"] == 4 and np.isfinite(row["max_abs_mev_per_atom"])
    assert 0 < row["mean_temperature_K"] < 1000
    assert any(line.startswith("bundled-nequip") and " 24 " in line for line in out.splitlines())


def test_a_negative_equilibration_is_refused(capsys):
    with pytest.raises(SystemExit):
        nve_drift.main(["--equilibrate-ps", "-1", "--device", "cpu"])
    assert "--equilibrate-ps" in capsys.readouterr().err
