"""The runtime's memory plan (``plugin.runtime.memory_plan``): stored path or streaming from the exact edge count,
and torch's expandable allocator segments near a full device, never over the user's own allocator setting."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cgforge.kernels import RowPolicy
from cgforge.patches.mace import row_chunks
from cgforge.patches.radial_table import FUSED_EDGE_ITEMS
from cgforge.plugin import Calculator
from cgforge.plugin.runtime import memory_plan, potential
from cgforge.plugin.runtime.memory_plan import plan_memory
from cgforge.plugin.runtime.options import RuntimeOptions
from cgforge.plugin.water import water_box

GB = 10**9
DEFAULTS = RuntimeOptions()


def test_the_plan_streams_only_what_would_not_fit() -> None:
    free = 84 * GB  # an H100 80GB with a model loaded
    fits = plan_memory(86_668_110, 860, free)  # the 1.03 M-atom water box with row chunks: 74.5 GB (73.4 measured)
    assert not fits.stream and fits.expandable and not fits.capture and fits.estimate_bytes == 86_668_110 * 860
    half = plan_memory(42_040_012, 860, free)  # 499k atoms: 36 GB, expandable, still captured
    assert not half.stream and half.expandable and half.capture
    small = plan_memory(436_566, 1120, free)  # 5184 atoms: far from full, nothing changes
    assert not small.stream and not small.expandable and small.capture
    edge = int(DEFAULTS.streaming_auto_fraction * free) // 1000
    assert not plan_memory(edge, 1000, free).stream and plan_memory(edge + 1, 1000, free).stream
    near = int(DEFAULTS.expandable_above_fraction * free) // 1000
    assert not plan_memory(near, 1000, free).expandable and plan_memory(near + 1, 1000, free).expandable
    full = int(DEFAULTS.uncaptured_above_fraction * free) // 1000
    assert plan_memory(full, 1000, free).capture and not plan_memory(full + 1, 1000, free).capture
    assert not plan_memory(10**9, 0, free).stream  # bytes not known: never streams on a guess
    tight = RuntimeOptions(streaming_auto_fraction=0.5, expandable_above_fraction=0.1, uncaptured_above_fraction=0.2)
    assert plan_memory(edge, 1000, free, options=tight).stream
    assert plan_memory(near, 1000, free, options=tight).expandable
    assert not plan_memory(full // 2, 1000, free, options=tight).capture


@pytest.mark.parametrize(("field", "bad"), [("streaming_auto_fraction", -0.1), ("uncaptured_above_fraction", True),
                                            ("order_above_atoms", -1), ("order_above_atoms", 1.5),
                                            ("radial_tf32_tol", float("nan"))])
def test_runtime_options_name_a_bad_value(field: str, bad) -> None:
    with pytest.raises(ValueError, match=field):
        RuntimeOptions(**{field: bad})
    with pytest.raises(TypeError, match="compile_backend"):
        RuntimeOptions(compile_backend=3)


@pytest.mark.parametrize("bad", [-1, 1.5, True, None])
def test_the_plan_names_a_bad_argument(bad) -> None:
    with pytest.raises(ValueError, match="edges must be an int >= 0"):
        plan_memory(bad, 100, GB)
    with pytest.raises(ValueError, match="free_bytes must be an int >= 0"):
        plan_memory(10, 100, bad)


@pytest.mark.parametrize("conf, on", [("expandable_segments:True", True), ("max_split_size_mb:512", False),
                                      ("garbage_collection_threshold:0.8, expandable_segments: true", True)])
def test_expandable_segments_leave_the_users_allocator_setting_alone(monkeypatch, conf: str, on: bool) -> None:
    calls = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append, raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)
    assert memory_plan.use_expandable_segments() is on
    assert calls == [] and memory_plan.os.environ["PYTORCH_CUDA_ALLOC_CONF"] == conf


def test_expandable_segments_are_asked_for_when_nothing_is_set(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append, raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert memory_plan.use_expandable_segments()
    assert calls == ["expandable_segments:True"]
    assert memory_plan.os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"  # children inherit it


def test_the_step_counts_the_edges_the_model_sees() -> None:
    torch.set_default_dtype(torch.float64)
    calc = Calculator("mace", device="cpu", dtype="float64", patch=True, warmup=False)
    atoms = water_box(16, seed=3)
    with pytest.raises(RuntimeError, match="no Verlet list loaded"):
        calc.step.edge_count()
    species = calc.adapter.species(atoms.numbers)
    counted = calc.step.prepare(atoms.positions, np.asarray(atoms.cell), (True, True, True), species)
    builds = calc.neighbours.n_builds
    atoms.calc = calc
    atoms.get_forces()
    assert counted == calc.n_edges > 0
    assert calc.neighbours.n_builds == builds  # the run found the prepared list fresh
    assert calc.potential.plan_memory(len(atoms), lambda: pytest.fail("counted on a CPU")) is None  # CUDA only


def test_row_chunked_boxes_are_estimated_with_their_own_bytes() -> None:
    """The largest boxes make their rows in chunks, which keep less per edge (847 B measured at 1.03 M atoms)
    than the whole rows (FUSED_EDGE_ITEMS): the estimate that decides streaming follows the size."""
    calc = Calculator("mace", device="cpu", dtype="float32", patch=True, radial_table=True, warmup=False)
    widest = max(b.conv_tp.irreps_out.dim for b in row_chunks.row_chunk_blocks(calc.model)) * 4
    for block in row_chunks.row_chunk_blocks(calc.model):  # the row policy the blocks were patched with
        block.conv_tp.rows = RowPolicy(chunked_above_bytes=1000 * widest)
    assert calc.adapter.stored_edge_bytes() == calc.adapter.stored_edge_bytes(1000) == FUSED_EDGE_ITEMS * 4
    assert calc.adapter.stored_edge_bytes(1001) == row_chunks.ROW_CHUNKED_EDGE_ITEMS * 4
    assert row_chunks.ROW_CHUNKED_EDGE_ITEMS < FUSED_EDGE_ITEMS


@pytest.mark.cuda
def test_cuda_the_calculator_and_the_engine_plan_each_size(monkeypatch) -> None:
    """On the GPU the first call of a size counts its edges (the run then finds the list built), asks for
    expandable segments when near full, and with workspace="whole" streams when the stored path would not fit (auto
    runs such a system in tiles); the MD engine plans at its start without streaming (its step is captured)."""
    from cgforge.plugin.md.run import run_md

    torch.set_default_dtype(torch.float64)
    asked = []
    monkeypatch.setattr(potential, "use_expandable_segments", lambda: asked.append(True) or True)
    atoms = water_box(16, seed=3)
    calc = Calculator("mace", device="cuda", dtype="float32", workspace="whole")  # the whole graph's own plan
    atoms.calc = calc
    atoms.get_forces()
    plan = calc.memory_plan
    assert plan is not None and plan.edges == calc.n_edges and not plan.stream and not calc.streaming
    assert not plan.expandable and asked == []
    tiny = RuntimeOptions(streaming_auto_fraction=1e-9, expandable_above_fraction=1e-9)
    engine_calc = Calculator("mace", device="cuda", dtype="float32", options=tiny, workspace="whole")
    run_md(water_box(16, seed=3), engine_calc, steps=2, temperature_K=300, engine="device")
    assert engine_calc.memory_plan.stream and not engine_calc.streaming and asked == [True]
    calc.potential.options = tiny  # read when the next plan is made
    smaller = water_box(12, seed=4)
    smaller.calc = calc
    smaller.get_forces()
    assert calc.memory_plan.edges == calc.n_edges and calc.streaming and calc.expandable_segments
    # workspace="auto" (the default): a system whose whole graph would not fit runs in tiles, no list over it made
    auto = Calculator("mace", device="cuda", dtype="float32", options=tiny)
    tiled = water_box(12, seed=4)
    tiled.calc = auto
    forces = tiled.get_forces()
    assert auto.potential.workspace.tiles_chosen and auto.memory_plan is None and not auto.streaming
    np.testing.assert_allclose(forces, smaller.get_forces(), rtol=0, atol=1e-3)


@pytest.mark.cuda
def test_cuda_a_box_near_a_full_device_runs_uncaptured_with_the_same_forces(monkeypatch) -> None:
    torch.set_default_dtype(torch.float64)
    monkeypatch.setattr(potential, "use_expandable_segments", lambda: True)
    atoms = water_box(16, seed=5)
    captured = Calculator("mace", device="cuda", dtype="float32", streaming=False)
    atoms.calc = captured
    want = atoms.get_forces()
    assert captured.cuda_graph
    uncaptured = RuntimeOptions(uncaptured_above_fraction=1e-9)
    near_full = Calculator("mace", device="cuda", dtype="float32", streaming=False, options=uncaptured)
    atoms.calc = near_full
    got = atoms.get_forces()
    assert not near_full.memory_plan.capture and not near_full.cuda_graph and not near_full.streaming
    np.testing.assert_allclose(got, want, atol=2e-5)
    near_full.potential.options = RuntimeOptions()  # read when the next plan is made
    smaller = water_box(12, seed=6)
    smaller.calc = near_full
    smaller.get_forces()
    assert near_full.cuda_graph  # back on for a size far from full
    pinned = Calculator("mace", device="cuda", dtype="float32", streaming=False, cuda_graph=True, options=uncaptured)
    atoms.calc = pinned
    atoms.get_forces()
    assert pinned.cuda_graph  # asked for: kept
