"""issue 61: every MD option is one MDOptions field (default, check, flag, help, restart rule); the command line,
run_md's keywords, the restart defaults, the banner and the table in docs/md.md come from it."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
from pathlib import Path

import pytest

from cgforge.plugin.cli.md import add_md_arguments
from cgforge.plugin.md.options import (
    KEPT,
    MODES,
    OPTION_FIELDS,
    RESTART_RULES,
    MDOptions,
    add_arguments,
    options_table,
)
from cgforge.plugin.md.run import run_md

DOCS = Path(__file__).resolve().parents[2] / "docs" / "md.md"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_md_arguments(parser)
    return parser


def _mode_kwargs(modes: tuple[str, ...] | None) -> dict[str, str]:
    """Keywords of a run in which a field of these modes applies."""
    mode = (modes or ("nvt-langevin",))[0]
    return {"ensemble": mode[:3], **({"thermostat": mode[4:]} if mode.startswith("nvt") else {})}


def test_every_field_has_a_flag_a_check_a_restart_rule_and_help():
    parser = _parser()
    actions = {a.dest: a for a in parser._actions}
    for key, meta in OPTION_FIELDS.items():
        assert meta["flag"].startswith("--") and meta["flag"] in actions[key].option_strings, key
        assert callable(meta["check"]) and meta["restart"] in RESTART_RULES and meta["help"], key
        assert actions[key].default is None  # not given: the field's default (or the restart's value) applies
        assert set(meta["modes"] or ()) <= set(MODES), key


@pytest.mark.parametrize("key", list(OPTION_FIELDS))
def test_every_field_is_checked_where_it_is_made(key):
    kwargs = {**_mode_kwargs(OPTION_FIELDS[key]["modes"]), key: object()}
    with pytest.raises(TypeError, match=f"^{re.escape(key)}: expected"):
        MDOptions(**kwargs)


def test_the_docs_table_is_the_generated_one():
    text = DOCS.read_text(encoding="utf-8")
    start = text.index("<!-- options table: options_table() -->\n") + len("<!-- options table: options_table() -->\n")
    assert text[start:text.index("\n<!-- end of the options table -->", start)] == options_table()
    for key, meta in OPTION_FIELDS.items():
        assert f"| `{meta['flag']}` | `{key}` |" in options_table()


def test_run_md_takes_one_keyword_per_field_with_its_default():
    parameters = inspect.signature(run_md).parameters
    for field in dataclasses.fields(MDOptions):
        assert parameters[field.name].default == field.default, field.name
        assert parameters[field.name].kind is inspect.Parameter.KEYWORD_ONLY


def test_options_of_another_mode_are_refused_and_the_rest_resolved():
    with pytest.raises(ValueError, match=r"^--taut: the CSVR thermostat's coupling time is for NVT \(csvr\) and NPT; "
                                         r"this run is NVT \(langevin\)"):
        MDOptions(taut_fs=50.0, names=lambda k: {"taut_fs": "--taut"}.get(k, k))
    o = MDOptions(thermostat="csvr", taut_fs=50)
    assert (o.friction, o.taut_fs, o.pressure_bar, o.max_temperature_K) == (None, 50.0, None, 5000.0)
    assert dataclasses.replace(o, steps=3) == dataclasses.replace(o, steps=3)  # made again, checked again: the same
    npt = MDOptions(ensemble="npt", temperature_K=600)
    kept = [k for k, meta in OPTION_FIELDS.items() if meta["restart"] == KEPT and k not in ("thermostat", "friction")]
    assert sorted(npt.saved()) == sorted(kept)
    assert npt.describe() == ("NPT at 600 K and 1.01325 bar, taut 100 fs, taup 1000 fs, compressibility 4.57e-05 "
                              "1/bar, timestep 0.5 fs")


def test_a_restart_follows_its_saved_options():
    saved = MDOptions(ensemble="nvt", thermostat="csvr", taut_fs=40, seed=3).saved()
    o = MDOptions.given({"steps": 5}, saved={**saved, "engine": "device"}, source="a.traj", new_run="x")
    assert (o.thermostat, o.taut_fs, o.seed, o.engine, o.steps) == ("csvr", 40.0, 3, "device", 5)
    assert MDOptions.given({"engine": "ase"}, saved={**saved, "engine": "device"}).engine == "ase"  # said, not refused
    with pytest.raises(ValueError, match="taut_fs: a.traj ran with taut_fs 40.0, and a restart continues its run"):
        MDOptions.given({"taut_fs": 50.0}, saved=saved, source="a.traj", new_run="x")


def test_the_generated_flags_parse_to_keywords():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--traj-interval", "5", "--taut", "20", "--no-init-velocities", "--force"])
    given = {k: v for k, v in vars(args).items() if v is not None}
    assert given == {"trajectory_interval": 5, "taut_fs": 20.0, "init_velocities": False, "force": True}


def test_an_nve_restart_that_saved_no_temperature_refuses_one():
    saved = {"ensemble": "nve", "timestep_fs": 0.5, "seed": 0}  # frames written before NVE saved its temperature
    assert MDOptions.given({}, saved=saved).max_temperature_K == 5000.0
    with pytest.raises(ValueError, match=r"--temperature: a.traj saved no temperature \(an NVE run: its restart "
                                         "continues the saved velocities\\); leave --temperature out"):
        MDOptions.given({"temperature_K": 0.0}, names=lambda k: {"temperature_K": "--temperature"}.get(k, k),
                        saved=saved, source="a.traj")
    assert MDOptions.given({"temperature_K": 350.0}, saved={}).temperature_K == 350.0  # no saved options at all
