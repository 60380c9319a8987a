"""benchmarks/run.py (the driver) and benchmarks/report.py (docs/performance.md) without a GPU: the run folder, its
manifest's commit fields (HEAD, dirty, tree, override), the device's name and the report's choice of runs.

Development tooling, not the product: run with ``.venv/bin/python -m pytest benchmarks/tests``."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"cgforge_bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def driver():
    return _load("run")


def test_device_slug(driver) -> None:
    assert driver.device_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert driver.device_slug("NVIDIA H200") == "h200"
    assert driver.device_slug("NVIDIA A100-SXM4-80GB") == "a100"
    assert driver.device_slug("Tesla T4") == "t4"
    assert driver.device_slug("cpu (x86_64)") == "cpu"


def test_run_folder_takes_the_next_letter(driver, tmp_path: Path) -> None:
    import datetime

    day = datetime.date(2026, 11, 26)
    assert driver.run_folder(tmp_path, "layer", "h100", day).name == "layer-h100-20261126"
    (tmp_path / "layer-h100-20261126").mkdir()
    assert driver.run_folder(tmp_path, "layer", "h100", day).name == "layer-h100-20261126b"


def test_extra_arguments_replace_the_suites(driver) -> None:
    assert driver.plan(["layer"], ["mace-large"]) == [("layer", ("bench_layer.py", "mace-large"))]
    assert [s for s, _ in driver.plan(["capacity", "tp"], [])] == ["capacity", "capacity", "tp"]
    assert all((BENCHMARKS / c[0]).is_file() for suite in driver.SUITES.values() for c in suite.commands)


def test_extra_arguments_say_which_of_the_suites_options_they_drop(driver) -> None:
    """Arguments after -- replace a suite's: the options they leave unnamed fall back to the script's defaults."""
    dropped = driver.dropped_options(["engine"], ["--models", "bundled-mace", "--backends", "fastmace",
                                                  "--ensembles", "nvt", "--md-steps", "300", "--md-warmup=100"])
    assert dropped == ["--systems 5k", "--dtypes float32"]
    assert driver.dropped_options(["layer"], ["mace-large"]) == []  # its command has no options
    assert driver.dropped_options(["engine"], []) == []


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


def test_commit_reads_head_dirty_and_tree_or_the_override(driver, tmp_path: Path, monkeypatch) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "a.py").write_text("x = 1\n")
    _git(repo, "add", "a.py")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    monkeypatch.setattr(driver, "ROOT", repo)
    clean = driver.commit_info(None)
    assert clean["sha"] == _git(repo, "rev-parse", "HEAD") and clean["source"] == "git"
    assert clean["dirty"] is False and clean["git"]["tree"] == _git(repo, "rev-parse", "HEAD^{tree}")
    (repo / "a.py").write_text("x = 2\n")
    dirty = driver.commit_info(None)
    assert dirty["dirty"] is True and dirty["git"]["tree"] != clean["git"]["tree"]
    assert _git(repo, "status", "--porcelain") == "M a.py"  # the index was not touched
    assert _git(repo, "diff", "--cached", "--name-only") == ""
    stale = driver.commit_info("abc1234")  # a copy whose .git is stale: the override wins, git's view is kept
    assert stale["sha"] == "abc1234" and stale["source"] == "override" and stale["git"]["dirty"] is True
    monkeypatch.setattr(driver, "ROOT", tmp_path / "no-git")
    (tmp_path / "no-git").mkdir()
    assert driver.commit_info(None)["sha"] is None


@pytest.mark.slow
def test_a_run_writes_its_folder_manifest_log_and_json(tmp_path: Path) -> None:
    """The whole driver on a stand-in suite (a script that writes JSON to $OUT), as a GPU session would call it."""
    script = tmp_path / "probe.py"
    script.write_text(f"import json, os, sys\nfrom pathlib import Path\nsys.path.insert(0, {str(BENCHMARKS)!r})\n"
                      "from common import commit\nprint('probe', sys.argv[1:])\n"
                      "Path(os.environ['OUT'], 'probe.json').write_text(json.dumps(commit()))\n")
    code = (f"import runpy, sys; g = runpy.run_path({str(BENCHMARKS / 'run.py')!r}, run_name='probe'); "
            f"g['SUITES']['probe'] = g['Suite']('a probe', (({str(script)!r}, 'x'),)); sys.exit(g['main']())")
    results = tmp_path / "results"
    run = subprocess.run([sys.executable, "-c", code, "probe", "--results", str(results), "--commit", "1234567",
                          "--name", "probe"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    (folder,) = results.iterdir()
    assert folder.name.startswith("probe-") and folder.name[-8:].isdigit()
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["commit"]["sha"] == "1234567" and manifest["commit"]["source"] == "override"
    assert set(manifest["versions"]) >= {"torch", "cupy", "e3nn", "mace", "nequip", "cuequivariance"}
    assert manifest["versions"]["torch"] and manifest["finished"]
    (entry,) = manifest["runs"]
    assert entry["rc"] == 0 and entry["files"] == ["probe.json"] and entry["log"] == "probe.log"
    assert "probe ['x']" in (folder / "probe.log").read_text()
    assert json.loads((folder / "probe.json").read_text())["commit"] == "1234567"  # the scripts' JSON agrees


def _layer_json(folder: Path, date: str, cgforge_fb: float) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    row = {"problem": "mace-medium", "cgforge-table_fwd": 1.0, "cgforge-table_fb": cgforge_fb, "cueq-mlp_fwd": 2.0,
           "cueq-mlp_fb": 9.0, "floor_fb": 0.4}
    (folder / f"layer-{date[:10]}.json").write_text(json.dumps(
        {"environment": {"date": date, "device": "NVIDIA H100 80GB HBM3", "commit": "stale00"}, "rows": [row]}))


def test_the_report_quotes_the_newest_vetted_run(tmp_path: Path) -> None:
    report = _load("report")
    results = tmp_path / "results"
    _layer_json(results / "old-h100-20261120", "2026-11-20T10:00:00", 3.0)  # no manifest, not in TREES: skipped
    _layer_json(results / "layer-h100-20261127", "2026-11-27T10:00:00", 4.5)
    (results / "layer-h100-20261127" / "manifest.json").write_text(json.dumps(
        {"commit": {"sha": "abcdef1234567", "source": "git", "dirty": False}, "env": {}}))
    _layer_json(results / "ab-h100-20261128", "2026-11-28T10:00:00", 1.0)  # an A/B arm: skipped
    (results / "ab-h100-20261128" / "manifest.json").write_text(json.dumps(
        {"commit": {"sha": "1111111", "source": "git", "dirty": False}, "env": {"CGFORGE_LOOP_ORDER": "edges"}}))
    page = "\n".join(report.layer_section(report.load_runs(results, "layer")))
    assert "commit `abcdef123456` (manifest.json, git, clean)" in page
    assert "| 4.500 ms |" in page and "**2.00x**" in page and "stale00" not in page and "1111111" not in page


def _nve_json(folder: Path, date: str, slope: float, equilibrate_ps: float | None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    row = {"model": "bundled-mace", "dtype": "float32", "timestep_fs": 1.0, "ps": 50.0, "mean_temperature_K": 300.2,
           "slope_mev_per_atom_per_ps": slope, "max_abs_mev_per_atom": 0.1, "spread_mev_per_atom": 0.03,
           "ms_per_step": 0.9}
    args = {} if equilibrate_ps is None else {"equilibrate_ps": equilibrate_ps}
    (folder / f"nve-drift-{date[:10]}.json").write_text(json.dumps(
        {"environment": {"date": date, "device": "NVIDIA H200"}, "args": args, "results": [row]}))
    (folder / "manifest.json").write_text(json.dumps(
        {"commit": {"sha": f"{folder.name[-7:]}aaaaa", "source": "git", "dirty": False}, "env": {}}))


def test_the_nve_table_quotes_the_newest_equilibrated_run(tmp_path: Path) -> None:
    report = _load("report")
    results = tmp_path / "results"
    _nve_json(results / "nve-20261201", "2026-12-01T10:00:00", -0.0021, 10.0)
    _nve_json(results / "nve-20261202", "2026-12-02T10:00:00", -0.0013, 10.0)
    _nve_json(results / "nve-20261203", "2026-12-03T10:00:00", -0.0334, None)  # NVE from an unequilibrated box
    page = "\n".join(report.nve_section(results))
    assert "| bundled MACE | float32 | 1 fs | 50 | 300 K | -0.0013 meV/atom/ps |" in page
    assert "0261202aaaaa" in page and "-0.0021" not in page and "-0.0334" not in page
    assert "No nve_drift.py run that equilibrated first" in "\n".join(report.nve_section(tmp_path / "empty"))


@pytest.mark.parametrize("rel", list(_load("report").LOG_ROWS))
def test_a_log_row_that_is_not_in_its_log_stops_the_report(tmp_path: Path, rel: str) -> None:
    report = _load("report")
    for other in report.LOG_ROWS:  # every entry's log, as in the repository
        log = tmp_path / other
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text((BENCHMARKS / "results" / other).read_text())
    assert report.load_runs(tmp_path, "md")  # the values of the table are in the real logs
    value = repr(report.LOG_ROWS[rel]["rows"][-1]["nvt_s"])
    (tmp_path / rel).write_text((tmp_path / rel).read_text().replace(value, "0.3"))
    with pytest.raises(SystemExit, match=value):
        report.load_runs(tmp_path, "md")


def _md_json(folder: Path, date: str, rows: list[tuple]) -> None:
    """A vetted bench_md run (manifest.json, commit abc1234) of (model, backend, NVT seconds[, more keys]) rows."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "manifest.json").write_text(json.dumps({"commit": {"sha": "abc1234", "source": "git", "dirty": False},
                                                      "env": {}}))
    (folder / f"md-{date[:10]}.json").write_text(json.dumps(
        {"environment": {"date": date, "device": "NVIDIA H100 80GB HBM3"},
         "rows": [{"model": m, "backend": b, "system": "5k", "nvt_s": t, **(more[0] if more else {})}
                  for m, b, t, *more in rows]}))


def test_the_engine_table_takes_each_model_from_its_newest_run_with_fastmace(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A newer run that timed one model beside FastMACE replaces that model's row only."""
    report = _load("report")
    monkeypatch.setattr(report, "LOG_ROWS", {})  # only this folder's runs
    device = {"boundary_idle_ms": 0.012, "kernels": 140.6}
    _md_json(tmp_path / "a", "2026-11-20T10:00:00", [("bundled-mace", "cgforge-engine", 0.003,
                                                       {"floor_ms": 0.6, "nvt_device": device}),
                                                      ("bundled-mace", "fastmace", 0.004),
                                                      ("mace-mp-medium", "cgforge-engine", 0.015),
                                                      ("mace-mp-medium", "fastmace", 0.020)])
    _md_json(tmp_path / "b", "2026-11-21T10:00:00", [("mace-mp-medium", "cgforge-engine", 0.010),
                                                      ("mace-mp-medium", "fastmace", 0.025)])
    page = "\n".join(report.engine_section(report.load_runs(tmp_path, "md")))
    assert "| bundled MACE | 3.00 ms | - | 4.00 ms | - | 0.75 | 0.600 ms | 20% | 0.012 ms | 141 | 1 |" in page
    assert "| MACE-MP-medium shape | 10.00 ms | - | 25.00 ms | - | 0.40 | - | - | - | - | 2 |" in page
    assert "Run 1: " in page and "a/md-2026-11-20.json" in page and "Run 2: " in page


def test_the_engine_table_takes_compiled_and_nequip_rows_from_a_call_beside_the_fastmace_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled rows and NequIP M come from the FastMACE run's folder (same device and commit), not from elsewhere."""
    report = _load("report")
    monkeypatch.setattr(report, "LOG_ROWS", {})
    _md_json(tmp_path / "a", "2026-11-20T10:00:00", [("bundled-mace", "cgforge-engine", 0.003),
                                                      ("bundled-mace", "fastmace", 0.004)])
    _md_json(tmp_path / "a", "2026-11-21T10:05:00", [("bundled-mace", "cgforge-engine-compiled", 0.002),
                                                      ("nequip-M", "cgforge-engine", 0.009)])
    _md_json(tmp_path / "b", "2026-11-19T10:00:00", [("nequip-M", "cgforge-engine-compiled", 0.001)])  # elsewhere
    page = "\n".join(report.engine_section(report.load_runs(tmp_path, "md")))
    assert "| bundled MACE | 3.00 ms | 2.00 ms | 4.00 ms | 0.50 | 0.75 | - | - | - | - | 1, 2 |" in page
    assert "| NequIP preset M | 9.00 ms | - | - | - | - | - | - | - | - | 2 |" in page
    assert "b/md-2026-11-19.json" not in page


def test_the_engine_table_takes_compiled_rows_from_a_sibling_call_of_the_session_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A session's calls in subfolders of one results folder (run.py's folder per call) are beside each other; the
    subfolder of another session folder is not."""
    report = _load("report")
    monkeypatch.setattr(report, "LOG_ROWS", {})
    _md_json(tmp_path / "s1" / "engine", "2026-11-20T10:00:00", [("bundled-mace", "cgforge-engine", 0.003),
                                                                  ("bundled-mace", "fastmace", 0.004)])
    _md_json(tmp_path / "s1" / "compiled", "2026-11-20T10:20:00", [("bundled-mace", "cgforge-engine-compiled", 0.002)])
    _md_json(tmp_path / "s0" / "compiled", "2026-11-19T10:00:00", [("nequip-M", "cgforge-engine-compiled", 0.001)])
    page = "\n".join(report.engine_section(report.load_runs(tmp_path, "md")))
    assert "| bundled MACE | 3.00 ms | 2.00 ms | 4.00 ms | 0.50 | 0.75 | - | - | - | - | 1, 2 |" in page
    assert "s0/compiled" not in page


def test_the_engine_table_cites_a_newer_engine_run_only_for_its_nvt_steps(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A newer run of the engine alone is cited with its NVT steps; one that timed NPT only has none to cite."""
    report = _load("report")
    monkeypatch.setattr(report, "LOG_ROWS", {})
    _md_json(tmp_path / "a", "2026-11-20T10:00:00", [("bundled-mace", "cgforge-engine", 0.003),
                                                      ("bundled-mace", "fastmace", 0.004)])
    folder = tmp_path / "npt"
    _md_json(folder, "2026-11-21T10:00:00", [("bundled-mace", "cgforge-engine", 0.0)])
    (run,) = folder.glob("md-*.json")
    data = json.loads(run.read_text())
    data["rows"] = [{"model": "bundled-mace", "backend": "cgforge-engine", "system": "5k", "nvt_s": None,
                     "npt_s": 0.0026}]
    run.write_text(json.dumps(data))
    page = "\n".join(report.engine_section(report.load_runs(tmp_path, "md")))
    assert "A newer run" not in page
    _md_json(tmp_path / "nvt", "2026-11-22T10:00:00", [("bundled-mace", "cgforge-engine", 0.0025)])
    page = "\n".join(report.engine_section(report.load_runs(tmp_path, "md")))
    assert "A newer run timed the uncompiled engine alone, with no peer in that run: bundled MACE 2.50 ms (" in page


def test_the_engine_table_keeps_to_the_5k_box(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A newer run over several boxes (bench_md's --systems) gives the table its 5,184-atom rows only."""
    report = _load("report")
    monkeypatch.setattr(report, "LOG_ROWS", {})
    _md_json(tmp_path / "a", "2026-11-20T10:00:00", [("bundled-mace", "cgforge-engine", 0.003),
                                                      ("bundled-mace", "fastmace", 0.004)])
    _md_json(tmp_path / "b", "2026-11-21T10:00:00", [("bundled-mace", "cgforge-engine", 0.001, {"system": "1k"}),
                                                      ("bundled-mace", "fastmace", 0.002, {"system": "1k"})])
    page = "\n".join(report.engine_section(report.load_runs(tmp_path, "md")))
    assert "| bundled MACE | 3.00 ms | - | 4.00 ms |" in page
    assert "b/md-2026-11-21.json" not in page


def _batch_json(folder: Path, date: str, args: dict, rows: dict, ratios: dict | None = None) -> None:
    """A vetted bench_batch run of the bundled model: ``rows`` by name, ``args`` over bench_batch's defaults."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "manifest.json").write_text(json.dumps({"commit": {"sha": "abc1234", "source": "git", "dirty": False},
                                                      "env": {}}))
    (folder / f"bench_batch-{date[:10]}.json").write_text(json.dumps(
        {"environment": {"date": date, "device": "NVIDIA H200"}, "args": {"dtype": "float32", **args},
         "rows": {"bundled": rows}, "ratios": {"bundled": ratios or {}}}))


def test_the_batch_table_takes_each_workload_from_its_largest_fp32_run(tmp_path: Path) -> None:
    """Evaluation, relaxation and MD each come from the largest FP32 run of that workload, the newest among equals:
    a newer small or FP64 check displaces none of them."""
    report = _load("report")
    _batch_json(tmp_path / "full", "2026-12-01T10:00:00",
                {"structures": 1024, "relax_structures": 128, "md_steps": 1000},
                {"eval-batch": {"structures_per_s": 3000.0}, "relax-batch": {"structures_per_s": 17.0},
                 "md-batch-nvt": {"atom_steps_per_s": 1.0e6}},
                {"md: batch / torchsim-mace": {"ratio": 12.0, "target": 3.0}})
    _batch_json(tmp_path / "relax", "2026-12-02T10:00:00",
                {"structures": 64, "relax_structures": 128, "md_steps": 0, "fire_variant": "torchsim",
                 "peer_check_every": 1},
                {"eval-batch": {"structures_per_s": 2000.0}, "relax-batch": {"structures_per_s": 12.7}},
                {"relax: torchsim-mace final energies vs batch": {"max_ev_per_atom": 4e-5, "structures": 16,
                                                                  "target": 1e-4},
                 "eval: batch / torchsim-mace": {"ratio": 20.0, "target": None}})
    _batch_json(tmp_path / "fp64", "2026-12-03T10:00:00",
                {"dtype": "float64", "structures": 4096, "relax_structures": 4096, "md_steps": 0},
                {"eval-batch": {"structures_per_s": 1.0}, "relax-batch": {"structures_per_s": 1.0}})
    page = "\n".join(report.batch_section(tmp_path))
    assert "| bundled | evaluation | eval-batch | 3,000 structures/s |" in page  # 1,024 structures beat 64
    assert "| bundled | FIRE relaxation | relax-batch | 12.7 structures/s |" in page  # newest of two at 128
    assert "| bundled | MD | md-batch-nvt | 1,000,000 atom-steps/s |" in page
    assert "fp64/" not in page
    assert "FIRE in TorchSim's order, TorchSim checking convergence every step" in page
    assert "- bundled, relax: torchsim-mace final energies vs batch: max 4.00e-05 eV/atom" in page
    assert "eval: batch / torchsim-mace: 20.00x" not in page  # the relaxation run's own evaluation is not quoted


def test_the_page_is_current() -> None:
    """docs/performance.md is what benchmarks/report.py writes from benchmarks/results/ (regenerate after a run)."""
    run = subprocess.run([sys.executable, str(BENCHMARKS / "report.py"), "--check"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_results_index_lists_every_run_folder() -> None:
    """benchmarks/results/README.md has one row per run folder (add the row with the run) and no loose files."""
    import re

    results = BENCHMARKS / "results"
    listed = re.findall(r"^\| `([^`/]+)/`", (results / "README.md").read_text(), re.M)
    folders = sorted(p.name for p in results.iterdir() if p.is_dir())
    assert sorted(listed) == folders
    assert [p.name for p in results.iterdir() if p.is_file()] == ["README.md"]


# what a run leaves: logs, JSON, text, tables, compressed traces, READMEs (scripts and patches live in git history)
DATA_SUFFIXES = {".log", ".json", ".txt", ".md", ".csv", ".gz"}


def test_the_results_hold_data_and_readmes_only() -> None:
    """benchmarks/results/ keeps what runs wrote and the READMEs that say what ran; a probe script or a patch goes
    to benchmarks/ (kept runnable) or stays in git history, named by its README with the commit."""
    results = BENCHMARKS / "results"
    other = sorted(str(p.relative_to(results)) for p in results.rglob("*")
                   if p.is_file() and p.suffix not in DATA_SUFFIXES)
    assert other == []


def test_the_profile_table_takes_each_models_newest_vetted_captured_profile(tmp_path: Path) -> None:
    """profile_engine.py runs with a captured-step profile count; older ones (eager only) and unvetted ones do not."""
    report = _load("report")

    def profile_json(folder: Path, date: str, kernel_ms: float, captured: bool, vetted: bool = True) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        if vetted:
            (folder / "manifest.json").write_text(json.dumps(
                {"commit": {"sha": "abc1234", "source": "git", "dirty": False}, "env": {}}))
        part = {"kernels_per_step": 500, "kernel_ms": kernel_ms, "categories": {"convolution (cgforge)": 1.0}}
        result = {"compile": None, "sweep": [{"ms_per_step": 3.0}], "eager": part} | ({"captured": part} if captured
                                                                                      else {})
        (folder / f"engine-profile-{date[:10]}.json").write_text(json.dumps(
            {"environment": {"date": date, "device": "NVIDIA H100 80GB HBM3"}, "args": {"model": "bundled-mace"},
             "results": [result]}))

    profile_json(tmp_path / "a", "2026-11-20T10:00:00", 2.5, captured=True)
    profile_json(tmp_path / "b", "2026-11-21T10:00:00", 2.0, captured=False)  # eager only: skipped
    profile_json(tmp_path / "c", "2026-11-22T10:00:00", 1.5, captured=True, vetted=False)  # no commit: skipped
    page = "\n".join(report.profile_section(tmp_path))
    assert "| bundled MACE | 3.00 ms | 500 | 2.50 ms | 1.00 | 0.00 | 0.00 | 0.00 | 0.00 | 0.00 | 1.50 |" in page
    assert "a/engine-profile-2026-11-20.json" in page and "b/" not in page and "c/" not in page
