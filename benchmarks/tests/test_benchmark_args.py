"""The benchmark scripts name a bad flag and exit non-zero before they need a GPU (the flags this project's GPU
sessions pass them: a typo must not cost a device call).

Development tooling, not the product, but in the default suite (pyproject's testpaths: tests/ and benchmarks/tests/);
alone: ``.venv/bin/python -m pytest benchmarks/tests``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1]


# Most of these scripts import torch and cgforge before they parse their flags (4-8 s a run on 2 cores): slow; the
# quick ones (under 1.5 s: no torch import) stay in the fast tier.
QUICK = {"bench_compile.py"}

BAD_FLAGS = [
    ("bench_layer.py", ["mace-huge"], "mace-huge"),
    ("bench_md.py", ["--systems", "5k,5k-morton", "--device", "cpu"], "5k-morton"),  # no ordering experiments
    ("bench_md.py", ["--backends", "cgforge,cgforge-mlp", "--device", "cpu"], "cgforge-mlp"),  # an ablation: options
    ("bench_layer.py", ["--tuning", "loop_order=rows"], "loop_order=rows"),
    ("bench_layer.py", ["--tuning", "backward_min_blocks=99"], "backward_min_blocks"),
    ("bench_layer.py", ["--tuning", "chunk=64"], "chunk=64"),
    ("bench_compile.py", ["--models", "bundled-mace,mace-huge"], "mace-huge"),
    ("bench_compile.py", ["--processes", "0"], "--processes"),
    ("investigations/tuning_ab.py", ["--models", "mace-huge", "--tuning", "a={}"], "mace-huge"),
    ("investigations/tuning_ab.py", ["--tuning", 'a={"tp": {"loop_order": "rows"}}'], "loop_order"),
    ("investigations/tuning_ab.py", ["--tuning", "a={"], "--tuning a"),
    ("investigations/tuning_ab.py", ["--tuning", 'a={"rows": {"chunk_bytes": 0}}'], "rows.chunk_bytes"),
    ("investigations/tuning_ab.py", ["--tuning", "{}"], "NAME=JSON"),
    ("investigations/tuning_ab.py", ["--tuning", "a={}", "--tuning", "a={}"], "same NAME"),
    ("investigations/tuning_ab.py", ["--tuning", "a={}", "--patch", "b=cgforge.plugin.md.engine:X=1"], "--patch b"),
    ("investigations/tuning_ab.py", ["--tuning", "a={}", "--patch", "a=cgforge.plugin.md.engine:NOPE=1"], "NOPE"),
    ("investigations/tuning_ab.py", ["--tuning", "a={}", "--patch", "a=cgforge.plugin.md.engine"], "MODULE:ATTRIBUTE"),
    ("investigations/tuning_ab.py", ["--tuning", "a={}", "--engine", 'b={"block": 5}'], "--engine"),
    ("investigations/tuning_ab.py", ["--tuning", "a={}", "--engine", 'a={"blocks": 5}'], "'blocks'"),
    ("investigations/tuning_ab.py", ["--tuning", "a={}", "--skin", "b=2"], "--skin"),
    ("investigations/tuning_ab.py", ["--tuning", "a={}", "--skin", "a=wide"], "'wide'"),
    ("investigations/tuning_ab.py", ["--tuning", "a={}", "--skin", "a=-1"], "'-1'"),
    ("investigations/tuning_ab.py", ["--tuning", "a={}", "--compile", "b=default"], "--compile"),
    ("investigations/tuning_ab.py", ["--tuning", "a={}", "--compile", "a=fast"], "'fast'"),
    ("profile_engine.py", ["--model", "mace-huge"], "mace-huge"),
    ("profile_engine.py", ["--ensemble", "nph"], "nph"),
    ("investigations/ptx_mix.py", ["--layers", "mace-huge"], "mace-huge"),
    ("investigations/ptx_mix.py", ["--tuning", '{"loop_order": "rows"}'], "loop_order"),
    ("bench_batch.py", ["--batch-size", "0"], "--batch-size"),
    ("investigations/search_host_ops.py", ["--cycles", "0"], "--cycles"),
    ("investigations/search_host_ops.py", ["--device", "cuda", "--path", "cuda"], "--path"),
    ("bench_batch.py", ["--models", "mace-huge"], "mace-huge"),
    ("bench_batch.py", ["--fire-variant", "vv_fire"], "vv_fire"),
    ("bench_batch.py", ["--peer-check-every", "0"], "--peer-check-every"),
    ("investigations/kernel_sources.py", ["--model", "mace-huge"], "mace-huge"),
    ("investigations/kernel_sources.py", ["--steps", "0"], "--steps"),
    ("nve_drift.py", ["--models", "mace-huge", "--device", "cpu"], "mace-huge"),
    ("nve_drift.py", ["--models", "bundled-nequip", "--dtype", "float64", "--device", "cpu"], "--dtype float64"),
    ("nve_drift.py", ["--ps", "0", "--device", "cpu"], "--ps"),
    ("investigations/hidden_table_accuracy.py", ["--width", "0"], "--width"),
]


@pytest.mark.parametrize("script, args, named",
                         [c if c[0] in QUICK else pytest.param(*c, marks=pytest.mark.slow) for c in BAD_FLAGS])
def test_a_bad_flag_is_named_and_exits_non_zero(script: str, args: list[str], named: str) -> None:
    run = subprocess.run([sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode != 0
    assert named in run.stderr, run.stderr[-2000:]


def test_layer_floor_counts_bytes_and_multiply_adds() -> None:
    """bench_layer's floor on a problem small enough to count by hand: 8x0e x 0e -> 8x0e, one uvu path."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from bench_layer import fp32_peak_tflops, layer_floor
    finally:
        sys.path.remove(str(BENCHMARKS))
    from cgforge.kernels import TPProblem

    problem = TPProblem.build("8x0e", "1x0e", "8x0e", [(0, 0, 0, "uvu", True)])
    floor = layer_floor(problem, nodes=10, edges=100, bandwidth=1e12, tflops=1.0)
    # forward: x and out rows (10 x 16 floats), per edge y + length + 3 indices (20 B), rowptr (10 x 8 B)
    assert floor["floor_fwd_bytes_ms"] == pytest.approx(2720 / 1e12 * 1e3)
    # 8 channels x 1 CG nonzero an edge forward, 2 FLOPs each; the backward's dx, dy, dw add 24
    assert floor["floor_fwd_flops_ms"] == pytest.approx(2 * 8 * 100 / 1e12 * 1e3)
    assert floor["floor_fb_flops_ms"] == pytest.approx(2 * 32 * 100 / 1e12 * 1e3)
    # backward adds g, x, grad x rows (10 x 24 floats), per edge 20 B + grad y and grad r (8 B), rowptr
    assert floor["floor_fb_bytes_ms"] == pytest.approx((2720 + 3840) / 1e12 * 1e3)
    assert floor["floor_fb"] == max(floor["floor_fb_bytes_ms"], floor["floor_fb_flops_ms"])
    assert fp32_peak_tflops("NVIDIA H100 80GB HBM3") == 66.9 and fp32_peak_tflops("Tesla T4") != 66.9


@pytest.mark.parametrize("args, named", [
    (["layr"], "'layr'"),  # an unknown suite
    ([], "SUITE"),
    (["layer", "md", "--", "mace-large"], "exactly one SUITE"),  # extra arguments for two suites
    (["capacity", "--", "--systems", "1m"], "exactly one SUITE"),  # nor for a suite of two commands
    (["layer", "--commit", "HEAD~1"], "--commit"),
    (["layer", "--name", "a/b"], "--name"),
    (["layer", "--timeout", "0"], "--timeout"),
])
def test_the_driver_names_a_bad_argument(args: list[str], named: str, tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, str(BENCHMARKS / "run.py"), *args, "--results", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert named in run.stderr, run.stderr[-2000:]
    assert not any(tmp_path.iterdir())


def test_bench_md_backends_are_choices_and_ablations_are_keywords() -> None:
    """bench_md's backends are what a user picks (our Calculator, compiled or not, our engine, the ASE path, the
    peers); an ablation is a Calculator or Engine keyword (--calculator / --engine KEY=VALUE, VALUE read as JSON or
    kept as text), and a keyword either lacks, or one bench_md sets itself, is refused naming the flag."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import bench_md
    finally:
        sys.path.pop(0)
    from cgforge.plugin.calculator import Calculator
    from cgforge.plugin.md.options import EngineOptions as Engine

    assert set(bench_md.ENGINE_BACKENDS) <= set(bench_md.MD_BACKENDS) <= set(bench_md.BACKENDS)
    assert set(bench_md.CGFORGE_OPTIONS) | set(bench_md.MD_BACKENDS) | {"e3nn", "cueq", "oeq"} == set(
        bench_md.BACKENDS)
    assert bench_md.keyword_options("calculator", ["radial_table=false", "radial_precision=3xtf32"], Calculator) == {
        "radial_table": False, "radial_precision": "3xtf32"}
    assert bench_md.keyword_options("engine", ["fuse_integrator=true", "block=5"], Engine) == {
        "fuse_integrator": True, "block": 5}
    for flag, item, target in (("calculator", "radial_tables=false", Calculator), ("calculator", "compile=true",
                               Calculator), ("engine", "seed=3", Engine), ("engine", "block", Engine)):
        with pytest.raises(SystemExit, match=f"--{flag}: .*{item!r}"):
            bench_md.keyword_options(flag, [item], target)


@pytest.mark.slow
def test_ptx_mix_counts_the_shuffles_of_the_grad_y_reduction() -> None:
    """ptx_mix.py on the bundled MACE's layer (NVRTC on the CPU): the reduce-scatter's backward has fewer shuffles
    than one butterfly per partial, the forward none."""
    from cgforge.kernels.core.compiler import nvrtc_available

    if not nvrtc_available():
        pytest.skip("NVRTC library not installed")

    def shuffles(tuning: str) -> dict[str, int]:
        run = subprocess.run([sys.executable, str(BENCHMARKS / "investigations/ptx_mix.py"), "--layers",
                              "mace-water-l2", "--tuning", tuning], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        header = next(line.split() for line in run.stdout.splitlines() if line.startswith("layer"))
        counts = len(header) - 2  # after "layer" and "kernel"; read from the right: the kernel labels hold spaces
        column = header.index("shfl") - len(header)
        return {" ".join(line.split()[1:-counts]): int(line.split()[column])
                for line in run.stdout.splitlines() if line.startswith("mace-water-l2")}

    scatter, butterfly = shuffles("{}"), shuffles('{"grad_y_reduce_scatter": false}')
    assert scatter["forward"] == butterfly["forward"] == 0
    assert 0 < scatter["bwd senders"] < butterfly["bwd senders"]


def test_device_timeline_counts_idle_time_and_kernels_per_step() -> None:
    """Two steps: kernels a [0, 10) and b [5, 20) overlap on two streams, a copy [30, 32), kernel c [40, 50):
    busy 10 + 10 + 2 + 10 = 32 us of 50, idle 18 us (gaps of 10 and 8); 3 kernels and 4 activities."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from common import device_timeline
    finally:
        sys.path.pop(0)
    spans = [(0.0, 10.0, "a"), (5.0, 20.0, "b"), (30.0, 32.0, "Memcpy DtoH"), (40.0, 50.0, "c")]
    line = device_timeline(spans, steps=2)
    assert line["wall_ms"] == pytest.approx(0.025) and line["busy_ms"] == pytest.approx(0.016)
    assert line["idle_ms"] == pytest.approx(0.009) and line["kernels"] == 1.5 and line["activities"] == 2
    assert line["gaps_us"] == [8.0, 10.0]
    assert line["idle_by_pair_us"] == {("b", "Memcpy DtoH"): 10.0, ("Memcpy DtoH", "c"): 8.0}


@pytest.mark.slow
def test_bench_batch_keeps_the_overlap_check_for_a_trained_model(tmp_path, monkeypatch) -> None:
    """Only a random-weight model's MD row runs without ``min_distance`` (and says so); the bundled model's keeps it."""
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from bench_batch import model_rows, parse, structures

    from cgforge.plugin.runtime.bundled import model_path

    args = parse(["--models", "bundled", "--peers", "batch", "--structures", "2", "--md-steps", "1",
                  "--device", "cpu", "--dtype", "float64"])
    rows: dict = {}
    model_rows("bundled", model_path("mace"), structures(2), [], args, rows)
    assert rows["md-batch-nvt"]["atom_steps_per_s"] > 0 and "note" not in rows["md-batch-nvt"]


def test_tf32_rounding_keeps_ten_mantissa_bits_to_nearest() -> None:
    """hidden_table_accuracy's TF32 emulation: 1 + 2^-10 stays, 1 + 2^-12 rounds down, 1 + 3 * 2^-12 up, the sign
    and the exponent pass through."""
    import torch

    sys.path.insert(0, str(BENCHMARKS / "investigations"))
    try:
        from hidden_table_accuracy import tf32
    finally:
        sys.path.pop(0)
    x = torch.tensor([1 + 2**-10, 1 + 2**-12, 1 + 3 * 2**-12, -(1 + 2**-12) * 2**40, 0.0])
    assert tf32(x).tolist() == [1 + 2**-10, 1.0, 1 + 2**-10, -(2**40), 0.0]
