"""bench_md.py's step floor beside the measured rows (issue 38), on the CPU: step_floor.step_floor is replaced by a
counting stand-in (the real count of a large box takes minutes), except one small real count.
Run with ``.venv/bin/python -m pytest benchmarks/tests``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCHMARKS))
import bench_md  # noqa: E402
import step_floor  # noqa: E402

sys.path.remove(str(BENCHMARKS))


class FakeFloor:
    """step_floor.step_floor's stand-in: records its calls, returns `ms` (or raises `error`)."""

    def __init__(self, ms: float = 2.0, error: Exception | None = None) -> None:
        self.ms, self.error, self.calls = ms, error, []

    def __call__(self, name: str, atoms: int, bandwidth: float, tflops: float, radial: str = "table",
                 model=None, l2_bandwidth: float = float("inf")) -> dict:
        self.calls.append((name, atoms, bandwidth, tflops, radial, l2_bandwidth))
        if self.error is not None:
            raise self.error
        return {"total_floor_ms": self.ms}


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeFloor:
    stand_in = FakeFloor()
    monkeypatch.setattr(step_floor, "step_floor", stand_in)
    monkeypatch.setattr(bench_md, "_FLOORS", {})  # a fresh cache: as a new run
    return stand_in


def row(model: str = "mace-mp-medium", atoms: int = 5184, dtype: str = "float32", nvt_s: float = 0.004,
        backend: str = "cgforge") -> dict:
    return {"model": model, "backend": backend, "dtype": dtype, "atoms": atoms, "nvt_s": nvt_s}


def test_model_names_map_onto_step_floor_models() -> None:
    assert set(bench_md.FLOOR_MODELS) <= set(bench_md.MODELS)
    assert set(bench_md.FLOOR_MODELS.values()) <= set(step_floor.MODELS)
    assert "nequip-l1" not in bench_md.FLOOR_MODELS  # no nequip-l1 in step_floor
    # every model both scripts know by the same name has its floor
    assert {m for m in bench_md.MODELS if m in step_floor.MODELS} == set(bench_md.FLOOR_MODELS)


def test_a_floor_is_counted_once_per_model_and_atoms(fake: FakeFloor) -> None:
    settings = bench_md.floor_settings("cpu")
    rows = [row(backend=b) for b in ("cgforge", "e3nn", "cgforge-engine")] + [row(atoms=1029), row(atoms=1029)]
    systems = ["5k", "5k", "5k", "1k", "1k"]
    for r, name in zip(rows, systems):
        bench_md.add_floor(r, name, settings)
    assert [c[:2] for c in fake.calls] == [("mace-mp-medium", 5184), ("mace-mp-medium", 1029)]
    # off a GPU: step_floor's H100 SXM rates, in B/s and TFLOP/s, radial tables
    assert fake.calls[0][2:] == (3350e9, 66.9, "table", step_floor.KNOWN_RATES["h100"].l2_gbs * 1e9)
    assert settings["bandwidth_gbs"] == 3350.0 and settings["tflops"] == 66.9
    assert settings["rates"] == "H100 SXM"
    assert all(r["floor_ms"] == 2.0 for r in rows)


def test_on_a_gpu_the_floor_takes_that_gpus_rates(monkeypatch: pytest.MonkeyPatch) -> None:
    h200 = step_floor.KNOWN_RATES["h200"]
    seen = []
    monkeypatch.setattr(bench_md.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(step_floor, "device_rates", lambda index=0: seen.append(index) or h200)
    settings = bench_md.floor_settings("cuda:1")
    assert seen == [1]
    assert (settings["bandwidth_gbs"], settings["l2_gbs"], settings["tflops"], settings["rates"]) == (
        4800.0, h200.l2_gbs, h200.tflops, "H200 SXM")


def test_fraction_is_floor_over_measured_step(fake: FakeFloor) -> None:
    settings = bench_md.floor_settings("cpu")
    r = row(nvt_s=0.008)  # 8 ms measured, 2 ms floor
    bench_md.add_floor(r, "5k", settings)
    assert r["floor_ms"] == 2.0 and r["floor_fraction"] == pytest.approx(0.25)
    no_nvt = {k: v for k, v in row().items() if k != "nvt_s"}  # e.g. an MD row run with --ensembles npt
    bench_md.add_floor(no_nvt, "5k", settings)
    assert no_nvt["floor_ms"] == 2.0 and no_nvt["floor_fraction"] is None
    assert bench_md.floor_cells(r) == "   2.0000   25.0%"
    assert bench_md.floor_cells(row()).split() == ["-", "-"]


@pytest.mark.parametrize("r, system", [
    (row(dtype="float64"), "5k"),  # the floor is FP32
    (row(model="nequip-l1"), "5k"),  # a model step_floor does not know
    (row(), "dhfr"),  # step_floor counts a water box's edges, not DHFR's
    ({**row(), "error": "out of GPU memory in the NVT steps"}, "5k"),  # nothing measured
])
def test_rows_without_a_floor(fake: FakeFloor, r: dict, system: str) -> None:
    bench_md.add_floor(r, system, bench_md.floor_settings("cpu"))
    assert "floor_ms" not in r and "floor_fraction" not in r
    assert fake.calls == []


def test_a_raising_floor_leaves_the_row_without_one(fake: FakeFloor, capsys: pytest.CaptureFixture) -> None:
    fake.error = ValueError("no convolutions\nfound")
    settings = bench_md.floor_settings("cpu")
    first, second = row(), row(backend="e3nn")
    bench_md.add_floor(first, "5k", settings)
    bench_md.add_floor(second, "5k", settings)  # the failure is cached too: one note, one try
    assert "floor_ms" not in first and "floor_ms" not in second
    assert len(fake.calls) == 1
    note = capsys.readouterr().out.strip()
    assert note == "no step floor for mace-mp-medium at 5184 atoms: ValueError: no convolutions found"


WRITES: list[tuple[Path | None, int]] = []  # run_main's JSON writes: (the path passed, rows then)


def run_main(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, *flags: str) -> tuple[dict, str]:
    """bench_md.main on a 24-atom box with measure() and the JSON writer replaced: (payload, stdout)."""
    for name in ("DEVICE", "SKIN", "PROFILE", "NVT_ONLY"):  # main sets them: restored after the test
        monkeypatch.setattr(bench_md, name, getattr(bench_md, name))
    monkeypatch.setattr(bench_md, "MD", dict(bench_md.MD))
    monkeypatch.setattr(bench_md, "_PEERS", {})
    monkeypatch.setattr(bench_md, "environment", lambda: {"torch": "t", "date": "d", "device": "cpu"})
    payloads = []

    def write_json(name: str, payload: dict, path: Path | None = None) -> Path:
        payloads.append(payload)
        WRITES.append((path, len(payload["rows"])))
        return Path("md.json")

    WRITES.clear()
    monkeypatch.setattr(bench_md, "write_json", write_json)

    def measure(model_name, backend, dtype, atoms, files, steps, warmup) -> dict:
        return {**row(model_name, len(atoms), dtype, 0.004, backend), "npt_s": 0.005, "peak_gb": 0.1}

    monkeypatch.setattr(bench_md, "measure", measure)
    bench_md.main(["--device", "cpu", "--systems", "8", "--models", "bundled-mace,nequip-l1", "--backends",
                   "cgforge,e3nn", "--dtypes", "float32,float64", *flags])
    return payloads[0], capsys.readouterr().out


@pytest.mark.slow
def test_main_prints_and_stores_the_floor(fake: FakeFloor, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture) -> None:
    payload, out = run_main(monkeypatch, capsys)
    assert fake.calls and [c[:2] for c in fake.calls] == [("bundled-mace", 24)]  # once, FP32 only
    assert payload["floor"]["bandwidth_gbs"] == 3350.0 and payload["floor"]["tflops"] == 66.9
    floored = {(r["model"], r["backend"], r["dtype"]) for r in payload["rows"] if "floor_ms" in r}
    assert floored == {("bundled-mace", "cgforge", "float32"), ("bundled-mace", "e3nn", "float32")}
    assert all(r["floor_fraction"] == pytest.approx(0.5) for r in payload["rows"] if "floor_ms" in r)
    assert "floor ms" in out and "reached" in out and "3350 GB/s" in out
    table = [line for line in out.splitlines() if line.startswith("8 ")]
    assert len(table) == 8 and sum("2.0000   50.0%" in line for line in table) == 2


@pytest.mark.slow
def test_no_floor_flag_skips_it(fake: FakeFloor, monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture) -> None:
    payload, out = run_main(monkeypatch, capsys, "--no-floor")
    assert fake.calls == [] and payload["floor"] is None
    assert not any("floor_ms" in r or "floor_fraction" in r for r in payload["rows"])
    assert "3350 GB/s" not in out


def test_real_floor_of_a_small_box(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real count through bench_md's call (bundled NequIP, 30 atoms: ~2 s): positive, the fraction from it."""
    monkeypatch.setattr(bench_md, "_FLOORS", {})
    r = row("bundled-nequip", 30, nvt_s=0.001)
    bench_md.add_floor(r, "10", bench_md.floor_settings("cpu"))
    assert 0 < r["floor_ms"] < 1 and r["floor_fraction"] == pytest.approx(r["floor_ms"])


@pytest.mark.slow
def test_the_json_is_rewritten_after_every_row(fake: FakeFloor, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture) -> None:
    """A run cut short (a device call's timeout) keeps the rows it measured: one file, written after each row."""
    payload, _ = run_main(monkeypatch, capsys, "--no-floor")
    rows = len(payload["rows"])
    assert rows == 8 and WRITES[0] == (None, 1)
    assert WRITES[1:] == [(Path("md.json"), n) for n in range(2, rows + 1)] + [(Path("md.json"), rows)]
