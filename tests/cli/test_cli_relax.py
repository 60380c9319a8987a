"""`cgforge relax`: a file of many structures in, a new file of the same format out with energies, forces and a
status per structure; a bad structure is named and skipped, nothing else lost; exit 1 only when nothing could be
relaxed. The bundled MACE (loaded once, tests/plugin/test_batch.py's fixture) stands in for --model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from ase.build import molecule
from ase.db import connect
from ase.io import read, write

from cgforge.plugin import calculator as calculator_module
from cgforge.plugin.cli import EXIT_ERROR, EXIT_OK, main
from cgforge.plugin.water import water_box

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugin"))
import test_batch  # noqa: E402

mace_calc = test_batch.mace_calc


@pytest.fixture
def loaded(mace_calc, monkeypatch):
    """`Calculator(...)` in the command gives the loaded model (no second load)."""
    monkeypatch.setattr(calculator_module, "Calculator", lambda *args, **kwargs: mace_calc)
    return mace_calc


def frames() -> list:
    box = water_box(2, seed=3)
    box.rattle(0.1, seed=4)
    overlap = molecule("H2O")
    overlap.positions[2] = overlap.positions[1] + 0.05
    stretched = molecule("H2")
    stretched.positions[1, 2] += 0.2
    return [box, molecule("CH4"), overlap, stretched]


def test_relax_writes_every_structure_and_names_the_bad_ones(loaded, tmp_path, capsys) -> None:
    source = tmp_path / "many.xyz"
    write(source, frames(), format="extxyz")
    before = source.read_bytes()
    assert main(["relax", str(source), "--steps", "5", "--batch-size", "2"]) == EXIT_OK
    out, err = capsys.readouterr()
    assert "structure 1 skipped: atoms: element(s) C not known" in err
    assert "structure 2 skipped: atoms 1 and 2 are" in err and "overlapping atoms" in err
    assert "4/4 done (" in out and "2 failed" in out
    assert source.read_bytes() == before  # IN untouched
    written = {a.info["relax_index"]: a for a in read(tmp_path / "many.relaxed.xyz", index=":")}
    assert sorted(written) == [0, 1, 2, 3]
    assert written[1].info["relax_status"] == "failed" and "C not known" in written[1].info["relax_error"]
    for index in (0, 3):
        atoms = written[index]
        assert atoms.info["relax_status"] in ("converged", "unconverged") and atoms.info["relax_steps"] <= 5
        energy = atoms.get_potential_energy()  # as written; now evaluated again at the written positions
        atoms.calc = loaded
        assert atoms.get_potential_energy() == pytest.approx(energy, abs=1e-5)
    assert main(["relax", str(source)]) == EXIT_ERROR  # OUT exists
    assert "exists" in capsys.readouterr().err
    assert main(["relax", str(source), "-o", str(source), "--force"]) == EXIT_ERROR
    assert "never writes over its input" in capsys.readouterr().err
    assert source.read_bytes() == before


def test_relax_of_a_database_with_nothing_relaxable_exits_1(loaded, tmp_path, capsys) -> None:
    source = tmp_path / "bad.db"
    with connect(source) as db:
        for atoms in frames()[1:3]:
            db.write(atoms)
    assert main(["relax", str(source), "-o", str(tmp_path / "out.db")]) == EXIT_ERROR
    assert "none of the 2 structures could be relaxed" in capsys.readouterr().err
    rows = list(connect(tmp_path / "out.db").select())
    assert sorted(r.relax_index for r in rows) == [0, 1] and {r.relax_status for r in rows} == {"failed"}


def test_relax_checks_its_files_before_the_model_loads(tmp_path, capsys) -> None:
    assert main(["relax", str(tmp_path / "missing.xyz")]) == EXIT_ERROR
    assert "IN: " in capsys.readouterr().err
    (tmp_path / "a.traj").write_text("")
    assert main(["relax", str(tmp_path / "a.traj")]) == EXIT_ERROR
    assert "extended XYZ (.xyz, .extxyz) or an ASE database (.db)" in capsys.readouterr().err
    for flag, value in (("--max-atoms", "0"), ("--min-distance", "-1"), ("--fmax", "nan"), ("--batch-size", "0")):
        assert main(["relax", str(tmp_path / "a.traj"), flag, value]) == EXIT_ERROR
        assert flag in capsys.readouterr().err


def test_md_batch_runs_each_structure_as_alone_and_names_the_bad_ones(loaded, tmp_path, capsys) -> None:
    """`cgforge md-batch`: structure i's run is run_md_batch's of it alone with seed --seed + i (its velocities
    too), whatever failed beside it; the bad ones are written as failed with their reason."""
    import numpy as np

    from cgforge.plugin import run_md_batch
    from cgforge.plugin.md.dynamics import thermalize

    source = tmp_path / "many.xyz"
    write(source, frames(), format="extxyz")
    before = source.read_bytes()
    assert main(["md-batch", str(source), "--steps", "3", "--batch-size", "3", "--seed", "5", "--temperature",
                 "250", "--thermostat", "csvr", "--taut", "20"]) == EXIT_OK
    out, err = capsys.readouterr()
    assert "structure 1 skipped: atoms: element(s) C not known" in err
    assert "structure 2 skipped: atoms 1 and 2 are" in err
    assert "4/4 done (2 failed)" in out and "atom-steps/s" in out
    assert source.read_bytes() == before
    written = read(tmp_path / "many.md.xyz", index=":")
    assert [a.info["md_index"] for a in written] == [0, 1, 2, 3]
    assert [a.info["md_status"] for a in written] == ["done", "failed", "failed", "done"]
    assert "C not known" in written[1].info["md_error"]
    for index in (0, 3):
        start = frames()[index]
        thermalize(start, 250.0, np.random.default_rng(5 + index))
        want = run_md_batch(loaded, [start], ensemble="nvt", timestep_fs=0.5, steps=3, temperature_K=250.0,
                            thermostat="csvr", taut_fs=20.0, seed=[5 + index])[0]
        got = written[index]
        assert got.info["md_seed"] == 5 + index and got.info["md_thermostat"] == "csvr" and got.info["md_steps"] == 3
        # to extended XYZ's 8 decimals; another seed's noise moves them by ~1e-2
        np.testing.assert_allclose(got.positions, want.positions, rtol=0, atol=1e-7)
        np.testing.assert_allclose(got.get_momenta(), want.get_momenta(), rtol=0, atol=1e-7)
        assert got.get_potential_energy() == pytest.approx(want.get_potential_energy(), abs=1e-7)


def test_md_batch_checks_its_flags_before_the_model_loads(tmp_path, capsys) -> None:
    source = tmp_path / "one.xyz"
    write(source, [molecule("H2O")], format="extxyz")
    for flag, value in (("--temperature", "-5"), ("--timestep", "0"), ("--batch-size", "0"), ("--friction", "-1"),
                        ("--min-distance", "-1")):
        assert main(["md-batch", str(source), flag, value]) == EXIT_ERROR
        assert flag in capsys.readouterr().err
    assert main(["md-batch", str(source), "--ensemble", "nve", "--friction", "0.1"]) == EXIT_ERROR
    assert "--friction" in capsys.readouterr().err  # a Langevin option in NVE, as cgforge md refuses it
    assert main(["md-batch", str(source), "--thermostat", "csvr", "--friction", "0.1"]) == EXIT_ERROR
    assert "--friction" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["md-batch", str(source), "--ensemble", "nvx"])
    assert not (tmp_path / "one.md.xyz").exists()


def test_md_batch_npt_skips_a_structure_without_a_periodic_cell(loaded, tmp_path, capsys) -> None:
    source = tmp_path / "two.xyz"
    box = water_box(2, seed=3)
    box.rattle(0.05, seed=4)
    write(source, [molecule("H2O"), box], format="extxyz")
    assert main(["md-batch", str(source), "--ensemble", "npt", "--steps", "2"]) == EXIT_OK
    assert "structure 0 skipped: NPT changes the cell and needs a periodic 3-D cell" in capsys.readouterr().err
    written = read(tmp_path / "two.md.xyz", index=":")
    assert [a.info["md_status"] for a in written] == ["failed", "done"]
    assert written[1].info["md_ensemble"] == "npt" and written[1].info["md_pressure_bar"] == pytest.approx(1.01325)
    assert not (written[1].cell[:] == box.cell[:]).all()  # the barostat moved the cell, and it was written
