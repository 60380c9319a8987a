"""cgforge's ML-IAP timers (``cgforge.plugin.lammps.timers``) on the CPU, through the stand-in of LAMMPS's data object:
phases accumulate per call, the table's rows and rank label, ``report`` prints it through LAMMPS's ``print``, and
timers off read no clock at all. The real-LAMMPS check (the table in LAMMPS's log file) is in test_lammps_real.py."""

from __future__ import annotations

import pickle

import pytest
import torch
from lammps_standin import build_domains, run_domains

from cgforge.plugin.cli import main as cli_main
from cgforge.plugin.lammps import CgforgeMLIAP, timers
from cgforge.plugin.lammps.ranks import launcher_rank
from cgforge.plugin.water import water_box


@pytest.fixture(scope="module")
def mace_file(tmp_path_factory) -> str:
    from mace_helpers import build_model

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        path = tmp_path_factory.mktemp("timers") / "tiny.model"
        torch.save(build_model(r_max=3.0), path)
    finally:
        torch.set_default_dtype(previous)
    return str(path)


def _domains(obj: CgforgeMLIAP, *, exchange: bool = False, n_domains: int = 1) -> list:
    atoms = water_box(12, seed=3)
    cutoff = obj.cutoff if exchange else obj.ghost_cutoff
    return build_domains(atoms, obj.element_types, obj.cutoff, cutoff, n_domains=n_domains,
                         ghost_neighbours=not exchange, exchange=exchange, flavour="kokkos" if exchange else "host")


def _call(models: list[CgforgeMLIAP], domains: list, n: int = 1) -> None:
    for _ in range(n):
        for d in domains:
            d.f[:] = 0.0
        run_domains(models, domains)


@pytest.fixture(scope="module")
def padded(mace_file):
    """One rank's object on the padded step (timers off), set up by a first call, and its domain."""
    obj = CgforgeMLIAP(mace_file, _padded=True)
    domains = _domains(obj)
    _call([obj], domains)
    return obj, domains


def test_phases_accumulate_and_the_table(padded):
    """The padded step's calls (one rank): each phase counted once per call (arrays twice: LAMMPS's views, then the
    buffers), times positive and below the calls' wall time; the table's rows, its rank label, and a reset."""
    obj, domains = padded
    obj.set_timers(True)
    _call([obj], domains, 3)
    assert obj.last_path == "padded"
    t = obj._timers
    assert t.calls == 3 and t.counts["model"] == 3 and t.counts["forces"] == 3 and t.counts["arrays"] == 6
    assert t.counts["waits"] >= 3 and t.counts["exchange forward"] == 0
    assert all(t.seconds[p] > 0 for p in ("arrays", "model", "forces"))
    assert t.seconds["model"] < t.call_seconds and t.between > 0
    lines = t.table(2, 4)
    assert lines[0].startswith("cgforge ML-IAP timers, rank 2 of 4 (cpu, host clock): 3 calls, ")
    rows = {line[:34].strip(): line[34:].split() for line in lines[2:]}
    assert set(rows) == {"LAMMPS's arrays to torch", "model: energies and forces", "results back to LAMMPS",
                         "host waits for the device"}  # phases that never ran have no row
    count, total, per_call, share = rows["model: energies and forces"]
    assert int(count) == 3 and float(total) == pytest.approx(t.seconds["model"], abs=1e-3)
    assert float(per_call) == pytest.approx(1e3 * t.seconds["model"] / 3, abs=1e-3)
    assert 0 < float(share) < 100
    t.reset()
    assert t.calls == 0 and not any(t.counts.values()) and t.table(0, 1)[2:] == []


def test_exchanges_are_timed_inside_the_model(mace_file):
    """Two domains in exchange mode (eager): every message-passing layer after the first exchanges forward, and
    backward in reverse, once per call; they are nested in the model's time."""
    obj = CgforgeMLIAP(mace_file, timers=True)
    domains = _domains(obj, exchange=True, n_domains=2)
    models = [pickle.loads(pickle.dumps(obj)) for _ in domains]  # one per rank, as LAMMPS loads the file
    _call(models, domains, 2)
    for m in models:
        t = m._timers
        assert m.last_mode == "exchange" and t.calls == 2
        assert t.counts["exchange forward"] == t.counts["exchange reverse"] == 2 * (m.layers - 1) > 0
        assert t.seconds["exchange forward"] + t.seconds["exchange reverse"] < t.seconds["model"]
        table = "\n".join(t.table(0, 2))
        assert "    forward exchanges" in table and "    reverse exchanges" in table  # indented under the model


def test_off_reads_no_clock(padded, monkeypatch):
    """Timers off: no clock read and no CUDA event in a call (each phase is the shared no-op); on: read."""
    obj, domains = padded
    obj.set_timers(False)
    reads = []
    monkeypatch.setattr(timers, "perf_counter", lambda: reads.append(1) or 0.0)
    monkeypatch.setattr(torch.cuda, "Event", lambda **kw: pytest.fail("a CUDA event with timers off"))
    _call([obj], domains, 2)
    assert obj._timers is timers.OFF and obj._step.timers is timers.OFF and obj._hooks.timers is timers.OFF
    assert obj._timers.phase("model") is obj._timers.wait() is obj._timers.call()
    assert reads == []
    obj.set_timers(True)
    _call([obj], domains)
    assert reads


def test_report_prints_through_lammps_and_restarts(padded):
    """``report`` hands every timed object's table to LAMMPS's ``print`` through a string variable (the input
    echoes only the print line), then starts from zero; ``switch`` turns timers on for live objects."""
    obj, domains = padded
    obj.set_timers(True)
    _call([obj], domains, 2)

    class FakeLammps:
        def __init__(self):
            self.commands, self.variables = [], {}

        def extract_setting(self, name):
            return {"world_rank": 0, "world_size": 1}[name]

        def command(self, line):
            self.commands.append(line)

        def set_string_variable(self, name, value):
            self.variables[name] = value

    lmp = FakeLammps()
    timers.report(lmp)
    assert lmp.commands == ['variable cgforge_timers_table string ""', 'print "${cgforge_timers_table}"']
    text = lmp.variables["cgforge_timers_table"]
    assert "cgforge ML-IAP timers, rank 0 of 1 (cpu, host clock): 2 calls" in text
    assert '"' not in text and "$" not in text
    assert obj._timers.calls == 0  # restarted
    timers.report(lmp)
    assert "no timed calls" in lmp.variables["cgforge_timers_table"]
    obj.set_timers(False)
    assert timers.switch(True) >= 1 and obj.timers and obj._timers.enabled
    timers.switch(False)  # other live objects of this test process as they were (off by default)
    with pytest.raises(TypeError, match="on: expected True or False"):
        timers.switch("yes")
    with pytest.raises(TypeError, match="timers: expected True or False"):
        CgforgeMLIAP("mace", timers=1)


def test_unreported_tables_at_exit(padded, capsys, monkeypatch):
    """Tables no input reported go to standard error when Python exits, labelled by the launcher's rank."""
    obj, domains = padded
    obj.set_timers(True)
    _call([obj], domains)
    monkeypatch.setenv("PMI_RANK", "1")
    monkeypatch.setenv("PMI_SIZE", "2")
    timers._at_exit()
    err = capsys.readouterr().err
    assert "never reported into LAMMPS's log" in err and "rank 1 of 2 (cpu, host clock): 1 calls" in err
    timers._at_exit()
    assert capsys.readouterr().err == ""  # reported once


def test_cli_timers_flag(mace_file, tmp_path, capsys):
    out = tmp_path / "m.pkl"
    assert cli_main(["lammps-model", mace_file, str(out), "--timers"]) == 0
    with open(out, "rb") as f:
        assert pickle.load(f).timers is True
    assert "python cgforge_timers invoke" in capsys.readouterr().out


def test_launcher_rank():
    assert launcher_rank({}) == 0
    assert launcher_rank({"PMI_RANK": "3"}) == 3
    assert launcher_rank({"OMPI_COMM_WORLD_RANK": "x", "SLURM_PROCID": "5"}) == 5


@pytest.mark.cuda
@pytest.mark.parametrize("flavour", ["host", "kokkos"])
def test_cuda_phases_are_timed_by_events(mace_file, flavour, monkeypatch):
    """On CUDA (captured padded step, host or Kokkos arrays): the model is timed by CUDA events, folded once complete
    with no synchronisation added to a call (the table synchronises once); each phase at most the calls' wall time.
    Timers off create no event."""
    obj = CgforgeMLIAP(mace_file, patch=True, device="cuda")
    atoms = water_box(12, seed=3)
    (data,) = build_domains(atoms, obj.element_types, obj.cutoff, obj.ghost_cutoff, flavour=flavour, device="cuda")
    real_event = torch.cuda.Event
    syncs = []
    real_sync = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: syncs.append(1) or real_sync(*a))
    monkeypatch.setattr(torch.cuda, "Event", lambda **kw: pytest.fail("a CUDA event with timers off"))
    _call([obj], [data], 2)
    assert obj.last_path == "captured"
    syncs.clear()
    _call([obj], [data], timers.FOLD_AT)
    untimed_syncs = len(syncs)
    monkeypatch.setattr(torch.cuda, "Event", real_event)
    obj.set_timers(True)
    syncs.clear()
    _call([obj], [data], timers.FOLD_AT)
    t = obj._timers
    assert len(syncs) == untimed_syncs  # no synchronisation added to the calls
    assert t.events and t.calls == timers.FOLD_AT and t.counts["model"] == timers.FOLD_AT
    assert t.seconds["model"] == 0 and len(t._pending) == timers.FOLD_AT  # one event pair a call, none read yet
    _call([obj], [data], 2)  # the first of them folds the earlier calls' pairs, complete by now: no wait
    assert t.seconds["model"] > 0 and len(t._pending) < 4
    syncs.clear()
    lines = t.table(0, 1)
    assert len(syncs) == 1  # the table's one synchronisation
    assert "model and exchanges by CUDA events, the rest host clock" in lines[0] and not t._pending
    assert 0 < t.seconds["model"] <= t.call_seconds and t.seconds["arrays"] > 0 and t.seconds["forces"] > 0

