"""benchmarks/step_floor.py: the floor of one force step, stage by stage, counted on the CPU (bundled water models,
small boxes). Run with ``.venv/bin/python -m pytest benchmarks/tests``."""

from __future__ import annotations

import json
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCHMARKS))
import step_floor  # noqa: E402
from bench_layer import layer_floor  # noqa: E402
from bench_symmetric_contraction import floors as sc_floors  # noqa: E402

sys.path.remove(str(BENCHMARKS))

BANDWIDTH, TFLOPS = 3.35e12, 66.9


@cache
def model(name: str) -> torch.nn.Module:
    return step_floor.load_model(name)


def convolutions(net: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in net.modules() if isinstance(getattr(m, "conv", None), step_floor.Convolution)]


@pytest.mark.parametrize("name", ["bundled-mace", "bundled-nequip"])
def test_small_box_floor_is_positive_and_the_sum_of_its_rows(name: str) -> None:
    result = step_floor.step_floor(name, 192, BANDWIDTH, TFLOPS, model=model(name))
    rows = result["rows"]
    assert result["nodes"] == 192 and result["edges"] > 192
    assert result["total_floor_ms"] > 0
    assert result["total_floor_ms"] == pytest.approx(sum(r["floor_ms"] for r in rows), rel=1e-12)
    assert result["total_bytes"] == pytest.approx(sum(r["fwd_bytes"] + r["bwd_bytes"] for r in rows), rel=1e-12)
    assert result["total_flops"] == pytest.approx(sum(r["fwd_flops"] + r["bwd_flops"] for r in rows), rel=1e-12)
    for r in rows:  # each row's floor is the larger of its two bounds, and says which
        by_bytes = (r["fwd_bytes"] + r["bwd_bytes"]) / BANDWIDTH * 1e3
        by_flops = (r["fwd_flops"] + r["bwd_flops"]) / (TFLOPS * 1e12) * 1e3
        assert r["floor_ms"] == pytest.approx(max(by_bytes, by_flops), rel=1e-12)
        assert r["bound"] == ("flops" if by_flops > by_bytes else "bytes")
    stages = {r["stage"] for r in rows}
    assert {"edge geometry", "spherical harmonics", "convolution", "node-wise linears", "readout"} <= stages
    assert ("symmetric contraction" in stages) == (name == "bundled-mace")


@pytest.mark.parametrize("name", ["bundled-mace", "bundled-nequip"])
def test_convolution_rows_are_layer_floor_once_per_layer(name: str) -> None:
    net = model(name)
    result = step_floor.step_floor(name, 192, BANDWIDTH, TFLOPS, model=net)
    rows = [r for r in result["rows"] if r["stage"] == "convolution"]
    convs = convolutions(net)
    assert len(rows) == len(convs) >= 2 and [r["layer"] for r in rows] == [str(i) for i in range(len(convs))]
    for row, conv in zip(rows, convs, strict=True):
        want = layer_floor(conv.conv.problem, result["nodes"], result["edges"], BANDWIDTH, TFLOPS)
        assert row["kernels"] == 2
        assert row["floor_ms"] == pytest.approx(want["floor_fb"], rel=1e-9)
        assert (row["fwd_bytes"] + row["bwd_bytes"]) / BANDWIDTH * 1e3 == pytest.approx(want["floor_fb_bytes_ms"])
        assert row["fwd_flops"] / (TFLOPS * 1e12) * 1e3 == pytest.approx(want["floor_fwd_flops_ms"])
    # with tables on, the radial weights add no kernel and no byte: the length is in layer_floor's per-edge bytes
    radial = [r for r in result["rows"] if r["stage"].startswith("radial")]
    assert len(radial) == len(convs) and all(r["kernels"] == 0 and r["floor_ms"] == 0 for r in radial)


def test_the_l2_term_counts_the_table_cubics_of_every_weight_per_edge() -> None:
    """With tables on, each convolution row reads 4 FP32 coefficients per weight per edge from L2, forward and
    backward, beyond its DRAM bytes; other rows' L2 bytes are their DRAM bytes. A row's floor is the largest of
    its three terms, and the L2 term only raises the total."""
    net = model("bundled-mace")
    l2 = 5e12
    plain = step_floor.step_floor("bundled-mace", 192, BANDWIDTH, TFLOPS, model=net)
    result = step_floor.step_floor("bundled-mace", 192, BANDWIDTH, TFLOPS, model=net, l2_bandwidth=l2)
    edges = result["edges"]
    convs = iter(convolutions(net))
    for r in result["rows"]:
        dram = r["fwd_bytes"] + r["bwd_bytes"]
        extra = 2 * edges * next(convs).conv.weight_numel * 4 * 4 if r["stage"] == "convolution" else 0
        assert r["l2_bytes"] == dram + extra and r["l2_reread"] == extra
        terms = {"bytes": dram / BANDWIDTH * 1e3, "l2": r["l2_bytes"] / l2 * 1e3,
                 "flops": (r["fwd_flops"] + r["bwd_flops"]) / (TFLOPS * 1e12) * 1e3}
        assert r["floor_ms"] == pytest.approx(max(terms.values()), rel=1e-12)
        assert terms[r["bound"]] == max(terms.values())
    assert any(r["bound"] == "l2" for r in result["rows"] if r["stage"] == "convolution")
    assert result["total_floor_ms"] > plain["total_floor_ms"]
    assert result["total_l2_bytes"] == pytest.approx(sum(r["l2_bytes"] for r in result["rows"]), rel=1e-12)
    # the MLP path has no table: no re-reads
    mlp = step_floor.step_floor("bundled-mace", 192, BANDWIDTH, TFLOPS, "mlp", model=net, l2_bandwidth=l2)
    assert all(r["l2_reread"] == 0 for r in mlp["rows"])


def test_rates_beside_are_each_rate_sets_floor() -> None:
    """``beside``: per rate set, the rows' floors at its three rates; the H200's faster DRAM never raises a row."""
    net = model("bundled-nequip")
    h100, h200 = step_floor.KNOWN_RATES["h100"], step_floor.KNOWN_RATES["h200"]
    result = step_floor.step_floor("bundled-nequip", 192, h100.hbm_gbs * 1e9, h100.tflops, model=net,
                                   l2_bandwidth=h100.l2_gbs * 1e9, beside=(h100, h200))
    same, faster = result["beside"]["H100 SXM"], result["beside"]["H200 SXM"]
    assert same["total_floor_ms"] == pytest.approx(result["total_floor_ms"], rel=1e-12)
    assert same["row_floor_ms"] == pytest.approx([r["floor_ms"] for r in result["rows"]], rel=1e-12)
    assert all(b <= a for a, b in zip(same["row_floor_ms"], faster["row_floor_ms"], strict=True))
    assert faster["total_floor_ms"] < same["total_floor_ms"]
    assert faster["rates"]["hbm_gbs"] == 4800.0 and dict(faster["rates"]["sources"])["hbm_gbs"]


def test_rates_from_a_devices_properties_and_the_table() -> None:
    """What a device reports sets its rates (Hopper: 128 FP32 lanes an SM; DRAM double data rate); what it does not
    comes from the table by name; an unknown device with nothing reported is refused naming what is missing."""
    rates = step_floor.rates_from_properties("NVIDIA H200", (9, 0), 132, 1_980_000, 3_200_000, 6144)
    assert rates.tflops == pytest.approx(132 * 128 * 2 * 1.98e9 / 1e12)
    assert rates.hbm_gbs == pytest.approx(2 * 3.2e9 * 6144 / 8 / 1e9)
    assert rates.l2_gbs == pytest.approx(5120 / 108 * 132 * 1.98)
    assert "the device" in dict(rates.sources)["tflops"]
    table = step_floor.rates_from_properties("NVIDIA H200", (9, 0), 132, None, None, None)
    assert (table.hbm_gbs, table.l2_gbs, table.tflops) == (4800.0, step_floor.KNOWN_RATES["h200"].l2_gbs,
                                                           step_floor.KNOWN_RATES["h200"].tflops)
    assert step_floor.KNOWN_RATES["h100"].tflops == pytest.approx(
        step_floor.rates_from_properties("H100", (9, 0), 132, 1_980_000, None, None).tflops, rel=1e-3)
    with pytest.raises(ValueError, match="hbm_gbs, l2_gbs, tflops"):
        step_floor.rates_from_properties("Some GPU", (7, 5), 40, None, None, None)
    assert step_floor.rates_named(" H200,h100 ") == (step_floor.KNOWN_RATES["h200"], step_floor.KNOWN_RATES["h100"])
    assert step_floor.rates_named("") == ()
    with pytest.raises(ValueError, match="--beside 'b200': unknown; choices: h100, h200, device"):
        step_floor.rates_named("h100,b200")


def test_symmetric_contraction_rows_are_bench_symmetric_contraction_floors() -> None:
    net = model("bundled-mace")
    result = step_floor.step_floor("bundled-mace", 192, BANDWIDTH, TFLOPS, model=net)
    rows = [r for r in result["rows"] if r["stage"] == "symmetric contraction"]
    assert len(rows) == len(net.products)
    for row, product in zip(rows, net.products, strict=True):
        want = sc_floors(product.symmetric_contractions, result["nodes"], torch.float32, BANDWIDTH)
        assert (row["fwd_bytes"] + row["bwd_bytes"]) / BANDWIDTH * 1e3 == pytest.approx(want["floor_fb"])
        assert row["fwd_flops"] / 1e9 == pytest.approx(want["gflop_fwd"])
        assert row["bwd_flops"] > row["fwd_flops"]  # grad x: both factors of every product


def test_doubling_the_box_roughly_doubles_the_floor() -> None:
    small = step_floor.step_floor("bundled-mace", 288, BANDWIDTH, TFLOPS, model=model("bundled-mace"))
    large = step_floor.step_floor("bundled-mace", 576, BANDWIDTH, TFLOPS, model=model("bundled-mace"))
    assert large["nodes"] == 2 * small["nodes"]
    assert 1.8 < large["edges"] / small["edges"] < 2.2
    assert 1.8 < large["total_floor_ms"] / small["total_floor_ms"] < 2.2


def test_the_radial_mlp_costs_more_than_the_table_and_is_counted_per_layer() -> None:
    table = step_floor.step_floor("bundled-nequip", 192, BANDWIDTH, TFLOPS, model=model("bundled-nequip"))
    mlp = step_floor.step_floor("bundled-nequip", 192, BANDWIDTH, TFLOPS, "mlp", model=model("bundled-nequip"))
    radial = [r for r in mlp["rows"] if r["stage"] == "radial weights (MLP)"]
    # the bundled NequIP's edge MLPs are 8 -> 32 -> 32 -> 64: 3 GEMMs a layer, forward and backward
    assert [r["kernels"] for r in radial] == [6, 6]
    edges = mlp["edges"]
    assert radial[0]["fwd_flops"] == 2 * edges * (8 * 32 + 32 * 32 + 32 * 64)
    assert mlp["total_floor_ms"] > table["total_floor_ms"]
    assert any(r["stage"] == "radial basis" for r in mlp["rows"])


def test_first_layer_stages_on_the_embedding_have_no_backward() -> None:
    rows = step_floor.stages(model("bundled-nequip"), nodes=100, edges=1000)
    by = {(r.stage, r.layer): r for r in rows}
    # layer 0: linear_1 on the embedding (forward only) and linear_2 (both); layer 1: both, both
    assert by["node-wise linears", "0"].kernels == 3 and by["node-wise linears", "1"].kernels == 4
    assert by["node embedding", "-"].bwd_bytes == 0


def test_linear_macs_pair_equal_irreps() -> None:
    from e3nn import o3

    assert step_floor.linear_macs(o3.Irreps("2x0e+3x1o"), o3.Irreps("4x0e+1x1o+5x2e")) == 2 * 4 + 3 * 1 * 3


def test_main_prints_the_table_and_writes_json(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("OUT", str(tmp_path))
    result = step_floor.main(["--model", "bundled-mace", "--atoms", "96", "--bandwidth-gbs", "1000",
                              "--beside", "h100,h200"])
    out = capsys.readouterr().out
    assert "1000 GB/s" in out and "L2 MB" in out and "H200 SXM" in out and "symmetric contraction" in out and f"{result['total_floor_ms']:9.4f}" in out
    (path,) = tmp_path.glob("step-floor-*.json")
    saved = json.loads(path.read_text())
    assert saved["total_floor_ms"] == pytest.approx(result["total_floor_ms"]) and saved["bandwidth_gbs"] == 1000


@pytest.mark.slow
@pytest.mark.parametrize("args, named", [(["--model", "mace-huge"], "mace-huge"), (["--atoms", "0"], "--atoms")])
def test_a_bad_flag_exits_non_zero_naming_it(args: list[str], named: str) -> None:
    run = subprocess.run([sys.executable, str(BENCHMARKS / "step_floor.py"), *args], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode != 0
    assert named in run.stderr, run.stderr[-2000:]
    if named == "mace-huge":
        assert all(choice in run.stderr for choice in step_floor.MODELS)
