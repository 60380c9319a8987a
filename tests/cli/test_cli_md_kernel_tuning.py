"""``cgforge md --kernel-tuning FILE.json``: the file read into a ``KernelTuning`` before the model loads (errors
name the flag, the file and the key), handed to the Calculator, and printed on the options line (issue 36)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from cgforge.kernels import KernelTuning, SCTuning, TPTuning
from cgforge.plugin import calculator as calculator_module
from cgforge.plugin.cli import EXIT_ERROR, main
from cgforge.plugin.cli.md import read_kernel_tuning
from cgforge.plugin.md.run import options_banner


def _md(tmp_path: Path, *extra: str) -> list[str]:
    return ["md", "--molecules", "4", "--device", "cpu", "--relax", "0", "-o", str(tmp_path / "out.traj"), *extra]


def _tuning_file(tmp_path: Path, content: object, raw: bool = False) -> Path:
    path = tmp_path / "tuning.json"
    path.write_text(content if raw else json.dumps(content))
    return path


def _error_line(capsys) -> str:
    """The one line the run wrote to stderr (a traceback would be several)."""
    (line,) = capsys.readouterr().err.splitlines()
    return line


@pytest.fixture
def calls(monkeypatch) -> list[dict]:
    """The keyword arguments of each Calculator the run builds; the run stops there."""
    seen: list[dict] = []

    def capture(*args, **kwargs):
        seen.append(kwargs)
        raise ValueError("stopped at the calculator (test)")

    monkeypatch.setattr(calculator_module, "Calculator", capture)
    return seen


@pytest.mark.parametrize("content, message", [
    ({"tp": {"loop_order": "edges"}, "pc": {}}, "unknown key 'pc'; a kernel tuning has the keys 'tp' (TPTuning), "
                                               "'sc' (SCTuning), 'rows' (RowPolicy), 'harmonics' (a bool) and "
                                               "'linear_kernel_max_channels' (an int >= 0)"),
    ({"linear_kernel_max_channels": -1}, "linear_kernel_max_channels: expected an int >= 0, got -1"),
    ({"linear_kernel_max_channels": True}, "linear_kernel_max_channels: expected an int >= 0, got True"),
    ({"tp": {"loop_ordr": "edges"}}, "tp.loop_ordr: unknown key; TPTuning has forward_chunk, backward_chunk, "
                                     "loop_order,"),
    ({"sc": {"blocks": 64}}, "sc.blocks: unknown key; SCTuning has block, chunk, pairings"),
    ({"tp": {"loop_order": 3}}, "tp.loop_order: loop_order must be one of ('auto', 'segments', 'edges', 'chunks'), "
                                "got 3"),
    ({"tp": {"forward_chunk": 48}}, "tp.forward_chunk: forward_chunk must be None or a positive multiple of 32, "
                                    "got 48"),
    ({"sc": {"block": "64"}}, "sc.block: block must be a multiple of 32 in [32, 1024], got '64'"),
    ({"sc": {"chunk": True}}, "sc.chunk: expected int, got True"),
    ({"sc": {"pairings": ["pq", "xy"]}}, "sc.pairings: pairings must be a non-empty subset of ('pq', 'pd', 'qd')"),
    ({"tp": {"backward_chunk_passes": 1}}, "tp.backward_chunk_passes: backward_chunk_passes must be a bool, got 1"),
    ({"tp": {"receiver_backward_min_row_bytes": 0}}, "tp.receiver_backward_min_row_bytes: "
                                                      "receiver_backward_min_row_bytes must be None or a positive int, "
                                                      "got 0"),
    ({"tp": {"receiver_backward_atomic": "yes"}}, "tp.receiver_backward_atomic: receiver_backward_atomic must be a "
                                                  "bool, got 'yes'"),
    ({"tp": {"receiver_backward_fixed_point": "yes"}}, "tp.receiver_backward_fixed_point: "
                                                       "receiver_backward_fixed_point must be 'auto', True or False, "
                                                       "got 'yes'"),
    ({"tp": ["edges"]}, "tp: expected an object of TPTuning's fields, got list"),
    ({"rows": {"chunk_bytes": 0}}, "rows.chunk_bytes: chunk_bytes must be an int >= 1, got 0"),
    ([1, 2], "expected an object with the keys 'tp', 'sc', 'rows', 'harmonics' and/or 'linear_kernel_max_channels', "
             "got list"),
])
def test_bad_tuning_files_fail_before_the_model_loads_naming_the_key(tmp_path, capsys, calls, content, message):
    path = _tuning_file(tmp_path, content)
    assert main(_md(tmp_path, "--kernel-tuning", str(path))) == EXIT_ERROR
    assert _error_line(capsys).startswith(f"cgforge md: error: --kernel-tuning: {path}: {message}")
    assert calls == [] and os.listdir(tmp_path) == ["tuning.json"]


def test_bad_tuning_files_messages_in_full(tmp_path):
    path = _tuning_file(tmp_path, {"tp": {"loop_order": 3}})
    with pytest.raises(ValueError) as err:
        read_kernel_tuning(str(path))
    assert str(err.value) == (f"--kernel-tuning: {path}: tp.loop_order: loop_order must be one of ('auto', "
                              "'segments', 'edges', 'chunks'), got 3")
    with pytest.raises(ValueError, match=r"--kernel-tuning: .*missing.json not found"):
        read_kernel_tuning(str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match=r"--kernel-tuning: .*tuning.json: not a readable JSON file"):
        read_kernel_tuning(str(_tuning_file(tmp_path, "{'tp': {}}", raw=True)))


def test_missing_and_unreadable_files_exit_before_the_model_loads(tmp_path, capsys, calls):
    assert main(_md(tmp_path, "--kernel-tuning", str(tmp_path / "none.json"))) == EXIT_ERROR
    assert "--kernel-tuning: " in _error_line(capsys) and calls == []
    path = _tuning_file(tmp_path, '{"tp": ', raw=True)
    assert main(_md(tmp_path, "--kernel-tuning", str(path))) == EXIT_ERROR
    assert f"--kernel-tuning: {path}: not a readable JSON file" in _error_line(capsys) and calls == []


def test_the_tuning_reaches_the_calculator(tmp_path, capsys, calls):
    path = _tuning_file(tmp_path, {"tp": {"loop_order": "edges", "max_blocks": 4}, "sc": {"pairings": ["pq", "pd"]}})
    assert main(_md(tmp_path, "--kernel-tuning", str(path))) == EXIT_ERROR  # stopped at the calculator
    assert main(_md(tmp_path)) == EXIT_ERROR
    assert "stopped at the calculator (test)" in capsys.readouterr().err
    assert calls[0]["tuning"] == KernelTuning(tp=TPTuning(loop_order="edges", max_blocks=4),
                                              sc=SCTuning(pairings=("pq", "pd")))
    assert "tuning" not in calls[1]  # without the flag the Calculator's default


def test_from_dict_reads_every_field_and_leaves_the_rest_at_their_defaults():
    assert KernelTuning.from_dict({}) == KernelTuning()
    assert KernelTuning.from_dict({"sc": {"block": 64}}) == KernelTuning(sc=SCTuning(block=64))
    every = KernelTuning(tp=TPTuning(forward_chunk=64, backward_chunk=96, loop_order="chunks", backward_min_blocks=2,
                                     backward_loop_order="segments", single_irrep_backward_chunk=None,
                                     backward_chunk_passes=False, backward_range_bytes=1 << 20, max_blocks=8),
                         sc=SCTuning(block=256, chunk=4, pairings=("pq", "qd")))
    data = json.loads(json.dumps({"tp": every.tp.__dict__, "sc": every.sc.__dict__}))  # what a file holds
    assert KernelTuning.from_dict(data) == every
    gemms = KernelTuning.from_dict({"harmonics": False, "linear_kernel_max_channels": 0})
    assert gemms == KernelTuning(harmonics=False, linear_kernel_max_channels=0)
    assert "linear_kernel_max_channels=0" in gemms.describe()


def _calc(tuning, patched=True):
    return SimpleNamespace(device=torch.device("cpu"), compile=None, streaming=False, streaming_requested=None,
                           cuda_graph=False, radial_table=False, patched=patched, tuning=tuning)


def test_the_options_line_prints_a_tuning_other_than_the_defaults():
    tuned = KernelTuning(tp=TPTuning(loop_order="edges"), sc=SCTuning(block=64))
    line = options_banner(_calc(tuned), "ase", "auto", 2.0)
    assert line.endswith(", kernel tuning: " + tuned.describe().replace("\n", ", "))
    assert "loop_order='edges'" in line and "block=64" in line
    for calc in (_calc(None), _calc(KernelTuning()), _calc(tuned, patched=False)):
        assert "kernel tuning" not in options_banner(calc, "ase", "auto", 2.0)


def test_a_real_run_prints_the_tuning(tmp_path, capsys):
    path = _tuning_file(tmp_path, {"tp": {"loop_order": "edges"}})
    assert main(_md(tmp_path, "--steps", "2", "--log-interval", "2", "--kernel-tuning", str(path))) == 0
    out = capsys.readouterr().out
    assert "cgforge's kernels" in out.splitlines()[0]  # tuned: patched also on a CPU
    options = next(line for line in out.splitlines() if line.startswith("options: "))
    assert "kernel tuning: TPTuning(" in options and "loop_order='edges'" in options
