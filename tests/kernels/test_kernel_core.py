"""CPU tests of the kernel core and the stages of the tensor-product / convolution generator.

The convolution kernels' programs run on the CPU evaluator for every layout and both loop orders,
against e3nn in FP64; the printed source carries the program's statements; tuning values, typed graph
tensors, exception classes, old import paths (pickles) and the explain walkthrough.
"""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch
from oracles import e3nn_conv
from tp_cases import PROBLEMS, e3nn_tp, rel

from cgforge.kernels import (
    ConvGraph,
    KernelTuning,
    SCTuning,
    SharedMemoryError,
    TensorProduct,
    TPProblem,
    TPTuning,
    UnknownKernelKeyError,
    UnsupportedProblemError,
)
from cgforge.kernels.convolution import GraphTensors
from cgforge.kernels.core.compiler import nvrtc_available
from cgforge.kernels.core.ir import c_group
from cgforge.kernels.tensor_product import layout as layouts
from cgforge.kernels.tensor_product import plan as plans
from cgforge.kernels.tensor_product.codegen import grad_y_groups, render
from cgforge.kernels.tensor_product.evaluate import run_backward, run_forward
from cgforge.kernels.tensor_product.program import build_program, segment_groups
from cgforge.kernels.tensor_product.schedule import build_schedule

SMALL = ["nequip-water", "tetris-poly"]  # the others: slow (a shared CPU runs ~100k small torch ops per problem)
LARGE = [n for n in PROBLEMS if n not in SMALL]


def _graph(num_nodes: int, num_edges: int, seed: int) -> ConvGraph:
    gen = torch.Generator().manual_seed(seed)
    sender = torch.randint(0, num_nodes, (num_edges,), generator=gen)
    receiver = torch.randint(0, num_nodes, (num_edges,), generator=gen)
    return ConvGraph(sender, receiver, num_nodes)


def _conv_case(name: str, shared: bool):
    torch.set_default_dtype(torch.float64)
    tp = e3nn_tp(PROBLEMS[name], shared)
    graph = _graph(5, 13, seed=len(name))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, tp.irreps_in1.dim, generator=gen, dtype=torch.float64)
    y = torch.randn(13, tp.irreps_in2.dim, generator=gen, dtype=torch.float64)
    w = torch.randn(*(() if shared else (13,)), tp.weight_numel, generator=gen, dtype=torch.float64)
    g = torch.randn(5, tp.irreps_out.dim, generator=gen, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (x, y, w)]
    s, r = graph.sender.long(), graph.receiver.long()
    ref = e3nn_conv(tp, *leaves, s, r, 5)
    grads = torch.autograd.grad(ref, leaves, g)
    return TPProblem.from_e3nn(tp), graph, (x, y, w, g), ref.detach(), grads


def _check_conv_kernels(name: str, shared: bool, loop_order: str) -> None:
    problem, graph, (x, y, w, g), ref, grads = _conv_case(name, shared)
    t = graph.tensors()
    n, e = x.shape[0], y.shape[0]
    # chunk 32: several segments per irrep (the edges order keeps them all live)
    nodes = build_schedule(problem, itemsize=8, max_chunk=32, tuning=TPTuning(loop_order=loop_order),
                           rows_are_nodes=True)
    for layout, perm in ((layouts.CONV_FORWARD, t.perm), (layouts.CONV_FORWARD_SORTED, None)):
        if perm is None:  # the sorted-edges kernel: give it edges sorted by receiver
            order = torch.argsort(t.receiver.long(), stable=True)
            sorted_graph = ConvGraph(t.sender[order], t.receiver[order], n)
            ts = sorted_graph.tensors()
            out = run_forward(nodes, x, y[order], w if shared else w[order], layout, n, ts.rowptr, None, ts.sender)
        else:
            out = run_forward(nodes, x, y, w, layout, n, t.rowptr, t.perm, t.sender)
        assert rel(out, ref) < 1e-12, (layout, "forward")
    res = run_backward(nodes, x, y, w, g, layouts.CONV_BACKWARD, n, t.rowptr_t, t.perm_t, None, t.receiver)
    for a, b in zip(res, grads):
        assert rel(a, b) < 1e-12
    for row_grad_once in (True, False):  # the walks over the receivers: grad-out block once per loop, or per edge
        receivers = build_schedule(problem, itemsize=8, max_chunk=32, rows_are_nodes=True,
                                   tuning=TPTuning(loop_order=loop_order, row_grad_once=row_grad_once))
        for layout in (layouts.CONV_BACKWARD_NO_GX, layouts.CONV_BACKWARD_RECEIVERS):
            gx, gy, gw = run_backward(receivers, x, y, w, g, layout, n, t.rowptr, t.perm, t.sender)
            assert rel(gy, grads[1]) < 1e-12 and rel(gw, grads[2]) < 1e-12, (layout, row_grad_once)
            assert not layout.grad_x or rel(gx, grads[0]) < 1e-12, (layout, row_grad_once)
    edges = build_schedule(problem, itemsize=8, max_chunk=32, tuning=TPTuning(loop_order=loop_order))
    out = run_forward(edges, x, y, w, layouts.ATOMIC_FORWARD, e, None, None, t.sender, t.receiver, out_rows=n)
    assert rel(out, ref) < 1e-12
    res = run_backward(edges, x, y, w, g, layouts.ATOMIC_BACKWARD, e, None, None, t.sender, t.receiver)
    for a, b in zip(res, grads):
        assert rel(a, b) < 1e-12


def test_backward_program_on_receiver_ranges_sums_to_the_whole_backward():
    """The generated backward program walked as ``table_rows.conv_table_backward_by_ranges`` launches it: per
    receiver range the transposed CSR of that range's edges (ids in an [E + 1] array), receiver - r0 into the
    range's gradient rows. Grad x summed over the ranges, grad y and grad W written once per edge: the whole
    backward's."""
    from cgforge.kernels.convolution.table_rows import row_ranges, transposed_range

    problem, graph, (x, y, w, g), _, grads = _conv_case("nequip-water", False)
    t = graph.tensors()
    n = x.shape[0]
    nodes = build_schedule(problem, itemsize=8, max_chunk=32, rows_are_nodes=True)
    gx, gy, gw = torch.zeros_like(x), torch.zeros_like(y), torch.zeros_like(w)
    for r0, r1 in row_ranges(n, 2):
        rowptr, perm = transposed_range(t.rowptr_t, t.perm_t, t.receiver, r0, r1)
        shifted = (t.receiver - r0).to(torch.int32)
        part = run_backward(nodes, x, y, w, g[r0:r1], layouts.CONV_BACKWARD, n, rowptr, perm, None, shifted)
        gx += part[0]
        gy += part[1]
        gw += part[2]
    for a, b in zip((gx, gy, gw), grads, strict=True):
        assert rel(a, b) < 1e-12 and b.abs().max() > 0


@pytest.mark.parametrize("name", SMALL)
@pytest.mark.parametrize("loop_order", ["segments", "edges", "chunks"])
def test_conv_kernel_programs_match_e3nn(name, loop_order):
    """Every convolution kernel (deterministic with and without perm, atomic; forward and backward), as
    the program the GPU runs, evaluated on CPU in FP64 against e3nn + scatter."""
    _check_conv_kernels(name, name == "tetris-poly", loop_order)


@pytest.mark.slow
@pytest.mark.parametrize("name", LARGE)
@pytest.mark.parametrize("loop_order", ["segments", "edges", "chunks"])
def test_conv_kernel_programs_match_e3nn_large(name, loop_order):
    _check_conv_kernels(name, False, loop_order)


@pytest.mark.parametrize("backward", [False, True])
def test_source_prints_the_program(backward):
    """Each CG statement group of the program is a line of the source, in program order."""
    problem = TPProblem.build(*PROBLEMS["diffdock-L1"])
    schedule = build_schedule(problem, itemsize=4)
    source, _ = render(schedule, "float", layouts.TP_LAYOUT, forward=not backward, backward=backward)
    lines = [line.strip() for line in source.splitlines()]
    expected = [c_group(grp, "float") for sc in build_program(schedule, backward).segments for tc in sc.terms
                for grp in tc.products + tc.adjoint]
    cg_lines = [line for line in lines if line.startswith(("acc[j]", "t3[", "{ const scalar_t cg"))]
    assert cg_lines == expected and expected


def test_loads_name_their_source():
    schedule = build_schedule(TPProblem.build(*PROBLEMS["nequip-water"]))
    assert all(ld.source == "x" for seg in schedule.forward for ld in seg.loads)
    for seg in schedule.backward:
        assert [ld.source for ld in seg.loads][0] == "x" and {ld.source for ld in seg.loads[1:]} == {"g"}
        assert seg.x_smem == seg.loads[0].smem_offset


def test_loop_order_changes_only_csr_kernels():
    problem = TPProblem.build(*PROBLEMS["nequip-water"])
    seg, edg = (build_schedule(problem, tuning=TPTuning(loop_order=o), rows_are_nodes=True)
                for o in ("segments", "edges"))
    a, name_a = render(seg, "float", layouts.CONV_FORWARD, True, False)
    b, name_b = render(edg, "float", layouts.CONV_FORWARD, True, False)
    assert name_a != name_b and "edges outermost" in b and "edges outermost" not in a
    assert b.count("stage(smem + 0, y + eid") == 1  # y staged once per edge, not per segment


def test_grad_y_is_reduced_once_per_edge_loop():
    """The backward's segments that share an edge loop (chunks, edges) share grad y's register slots: the
    generated kernel reduces an edge's grad y over the warp once per group, not once per segment."""
    problem = TPProblem.build(*PROBLEMS["nequip-water"])
    sums = {}
    for order in ("segments", "chunks", "edges"):
        schedule = build_schedule(problem, max_chunk=32, tuning=TPTuning(loop_order=order), rows_are_nodes=True)
        program = build_program(schedule, backward=True)
        groups = segment_groups(program, order)
        for group in groups:
            assert len({sc.gy_slots for _, sc in group}) == 1  # one set of slots per edge loop
        source, _ = render(schedule, "float", layouts.CONV_BACKWARD, False, True)
        sums[order] = source.count("(part, lane)")  # one reduce_scatter call per group of partials and edge loop
        assert sums[order] == sum(len(grad_y_groups(group[0][1].gy_slots, table=False)) for group in groups)
    assert len(build_program(build_schedule(problem, max_chunk=32), backward=True).segments) == 4  # 4 irreps
    assert sums["edges"] < sums["segments"] and sums["chunks"] <= sums["segments"]


@pytest.mark.parametrize("order", ["chunks", "edges"])
def test_a_walk_over_the_receivers_stages_the_row_grad_once_per_edge_loop(order: str) -> None:
    """TPTuning.row_grad_once: in the orders where segments share an edge loop, their backward windows lie side by
    side, so the receiver walks stage the row's grad-out block before the loop and only x (and y) per edge; the
    sender walk still gathers a grad-out row per edge. False: overlapping windows, the block staged per edge."""
    problem = TPProblem.build(*PROBLEMS["nequip-water"])
    for once in (True, False):
        schedule = build_schedule(problem, max_chunk=32, rows_are_nodes=True,
                                  tuning=TPTuning(loop_order=order, row_grad_once=once))
        assert schedule.row_grad_once(layouts.CONV_BACKWARD_NO_GX) == once
        assert not schedule.row_grad_once(layouts.CONV_BACKWARD)
        for group in segment_groups(build_program(schedule, backward=True), order):
            spans = sorted((ld.smem_offset, ld.smem_offset + ld.count) for _, sc in group for ld in sc.segment.loads
                           if ld.source == "g")
            disjoint = all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
            assert disjoint or not once
        assert len(segment_groups(build_program(schedule, backward=True), order)[0]) > 1
        for layout in (layouts.CONV_BACKWARD_NO_GX, layouts.CONV_BACKWARD_RECEIVERS):
            source, _ = render(schedule, "float", layout, False, True)
            loop = source.index("for (long long k = e_begin")
            assert ("g + row * OUT_DIM" in source) == once and ("g + gr * OUT_DIM" in source) != once
            assert not once or source.rindex("g + row * OUT_DIM") < loop
        sender, _ = render(schedule, "float", layouts.CONV_BACKWARD, False, True)
        assert "g + gr * OUT_DIM" in sender and "g + row * OUT_DIM" not in sender


def test_stacked_windows_stay_within_their_cap() -> None:
    """Windows side by side only where the stacked window stays within TPTuning.stacked_window_bytes: by default
    mace-medium's (two in1 irreps, 4.4 KB) and mace-large's (three, 128 channels each, 11.5 KB) do; under an 8 KiB
    cap mace-large's keeps the overlapping windows of the old staging, and a larger cap takes it again."""
    cap = TPTuning().stacked_window_bytes
    for name, tuning, stacked in (("mace-medium", TPTuning(), True), ("mace-large", TPTuning(), True),
                                  ("mace-large", TPTuning(stacked_window_bytes=8 * 1024), False)):
        problem = TPProblem.build(*PROBLEMS[name])
        schedule = build_schedule(problem, rows_are_nodes=True, tuning=tuning)
        assert schedule.loop_order(True) == "chunks" and schedule.stacked_backward == stacked, name
        assert schedule.row_grad_once(layouts.CONV_BACKWARD_NO_GX) == stacked
        assert not stacked or schedule.backward_launch.smem_per_warp * 4 <= tuning.stacked_window_bytes <= cap
        old = build_schedule(problem, rows_are_nodes=True, tuning=TPTuning(row_grad_once=False))
        assert stacked or old.backward_launch == schedule.backward_launch  # as before the change
        wide = build_schedule(problem, rows_are_nodes=True, tuning=TPTuning(stacked_window_bytes=64 * 1024))
        assert wide.stacked_backward and wide.backward_launch.smem_per_warp > old.backward_launch.smem_per_warp
    with pytest.raises(ValueError, match="stacked_window_bytes"):
        TPTuning(stacked_window_bytes=0)


@pytest.mark.skipif(not nvrtc_available(), reason="NVRTC library not installed")
@pytest.mark.parametrize("scalar", ["float", "double"])
def test_edges_loop_order_compiles(scalar):
    from cgforge.kernels.core.compiler import compile_cubin

    problem = TPProblem.build(*PROBLEMS["nequip-water"])
    schedule = build_schedule(problem, itemsize=4 if scalar == "float" else 8,
                              tuning=TPTuning(loop_order="edges"), rows_are_nodes=True)
    for layout, backward in ((layouts.CONV_FORWARD, False), (layouts.CONV_BACKWARD, True)):
        source, base = render(schedule, scalar, layout, forward=not backward, backward=backward)
        fn = f"{base}_{'backward' if backward else 'forward'}"
        assert 0 < compile_cubin(source, arch="sm_90", name=f"{fn}.cu").resources(fn).registers <= 255


def test_tuning_values(monkeypatch):
    with pytest.raises(ValueError, match="forward_chunk"):
        TPTuning(forward_chunk=48)
    with pytest.raises(ValueError, match="loop_order"):
        TPTuning(loop_order="rows")
    with pytest.raises(ValueError, match="block"):
        SCTuning(block=100)
    for bad in ({"single_irrep_backward_chunk": 48}, {"backward_chunk_passes": 1}, {"backward_range_bytes": 0},
                {"max_blocks": True}, {"receiver_backward_fixed_point": 1}, {"receiver_backward_fixed_point": "on"},
                {"fixed_point_max_bytes": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            TPTuning(**bad)
    with pytest.raises(TypeError, match="KernelTuning takes"):
        KernelTuning(tp=SCTuning())
    # old keys kept; later knobs enter the key only when set
    assert TPTuning(32, None, "edges", backward_loop_order="chunks").key() == "32|None|edges|b:chunks"
    assert TPTuning().key() == "None|None|auto"
    assert TPTuning(receiver_backward_fixed_point=False).key() == "None|None|auto|receiver_backward_fixed_point=False"
    assert TPTuning(max_blocks=3, backward_chunk_passes=False).key() == (
        "None|None|auto|backward_chunk_passes=False|max_blocks=3")
    # no environment variable changes a kernel: a leftover sweep variable is not read
    monkeypatch.setenv("CGFORGE_FORWARD_CHUNK", "32")
    monkeypatch.setenv("CGFORGE_LOOP_ORDER", "edges")
    monkeypatch.setenv("CGFORGE_SC_PAIRINGS", "pq,pd")
    problem = TPProblem.build(*PROBLEMS["nequip-water"])
    plan = plans.get(plans.register(problem))  # no tuning given: the defaults
    assert plan.tuning == TPTuning() and plan.schedule(torch.float32).forward_launch.chunk == 64
    assert not hasattr(TPTuning, "from_env") and not hasattr(SCTuning, "from_env")
    explicit = TensorProduct(*PROBLEMS["nequip-water"], tuning=TPTuning(forward_chunk=64, backward_chunk=32))
    schedule = plans.get(explicit.key).schedule(torch.float32)
    assert (schedule.forward_launch.chunk, schedule.backward_launch.chunk) == (64, 32)
    assert schedule.tuning == explicit.tuning


def test_conv_graph_trusted_checks_dtypes_and_shapes():
    graph = _graph(4, 9, seed=3)
    same = ConvGraph.trusted(graph.tensors(), 4)
    assert isinstance(same.tensors(), GraphTensors) and same.num_edges == 9 and same.deterministic
    assert all(a is b for a, b in zip(same.tensors(), graph.tensors()))
    bad = graph.tensors()._replace(rowptr=graph.rowptr.int())
    with pytest.raises(TypeError, match="rowptr must be a contiguous 1-D torch.int64"):
        ConvGraph.trusted(bad, 4)
    with pytest.raises(ValueError, match="rowptr and rowptr_t need 6 entries"):
        ConvGraph.trusted(graph.tensors(), 5)


def test_exception_classes():
    with pytest.raises(UnsupportedProblemError) as err:
        TPProblem.build("1x7e", "1x0e", "1x7e", [(0, 0, 0, "uvu", True)])
    assert isinstance(err.value, ValueError)
    with pytest.raises(UnknownKernelKeyError, match="build the TensorProduct"):
        plans.get("tp_missing")
    big = TPProblem.build("4096x6e", "1x0e", "4096x6e", [(0, 0, 0, "uvw", True)])
    with pytest.raises(SharedMemoryError):
        build_schedule(big)


@pytest.mark.parametrize("path,name", [("cgforge.kernels.convolution.module", "Convolution"),
                                       ("cgforge.kernels.tensor_product.module", "TensorProduct"),
                                       ("cgforge.kernels.tensor_product.problem", "Instruction"),
                                       ("cgforge.kernels.tensor_product.problem", "TPProblem"),
                                       ("cgforge.kernels.symmetric_contraction.problem", "SCProblem"),
                                       ("cgforge.kernels.core.tuning", "TPTuning"),
                                       ("cgforge.kernels.core.tuning", "SCTuning")])
def test_class_paths_in_patched_model_pickles_resolve(path, name):
    """Pickles of patched models name these kernels classes (inside the patches' stand-ins)."""
    assert getattr(importlib.import_module(path), name).__module__ == path


@pytest.mark.parametrize("path", ["cgforge.kernels.problem", "cgforge.kernels.sc_problem", "cgforge.kernels.compiler",
                                  "cgforge.kernels.runtime"])
def test_no_pre_release_aliases(path):
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(path)


@pytest.mark.slow
def test_import_loads_no_model_package():
    """kernels/ knows no model: importing it loads no model package, no ASE and nothing of the layers above."""
    code = ("import sys, cgforge.kernels; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mace', 'nequip', 'ase') "
            "or m.startswith(('cgforge.patches', 'cgforge.plugin'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    # nor by name: kernels/ resolves nothing in the patches (MACE's class is cgforge.patches.mace's)
    import cgforge.kernels
    import cgforge.kernels.symmetric_contraction as sc

    for module in (cgforge.kernels, sc, sc.module):
        assert not hasattr(module, "SymmetricContraction") and not hasattr(module, "__getattr__")


def test_explain_prints_every_stage(capsys):
    from cgforge.kernels.explain import main

    arch = "sm_90" if nvrtc_available() else "none"
    assert main(["8x0e+8x1o", "0e+1o", "8x0e+8x1o+8x1e", "--arch", arch, "--lines", "5"]) == 0
    text = capsys.readouterr().out
    for stage in ("1. problem", "2. sparse CG", "3. schedule", "4. program", "6. generated forward kernel"):
        assert stage in text
    assert "l=(1, 1, 1): 6 nonzeros of 27" in text
    assert 'extern "C" __global__' in text
    assert "segments, loop order segments" in text  # rows are edges: nothing to reorder
    assert main(["8x0e+8x1o", "0e+1o", "8x0e+8x1o+8x1e", "--conv", "--arch", "none", "--lines", "0"]) == 0
    conv = capsys.readouterr().out  # one multiplicity, several irreps: the chunks order both ways
    assert conv.count("loop order chunks") == 2, conv
    if arch != "none":
        assert "5. ptxas report" in text and "registers" in text
    assert main(["8x0e", "0e", "--mode", "uvw"]) == 2  # uvw needs IRREPS_OUT: a clear error, no traceback


def test_auto_loop_order_per_direction():
    # MACE-MP-medium's second interaction: 128x0e+128x1o x sh(3) -> one 128-channel output per path (5120 wide)
    from cgforge.kernels.explain import instructions

    problem = TPProblem.build(*instructions("128x0e+128x1o", "0e+1o+2e+3o", "128x0e+128x1o+128x2e+128x3o", "uvu"))
    fp32 = build_schedule(problem, itemsize=4, rows_are_nodes=True)
    assert fp32.tuning.loop_order == "auto"
    # one in1 multiplicity: both directions walk the edges once per 32-channel chunk, every irrep's segment inside
    assert (fp32.loop_order(False), fp32.loop_order(True)) == ("chunks", "chunks")
    assert (fp32.forward_launch.chunk, fp32.backward_launch.chunk) == (32, 32)
    fp64 = build_schedule(problem, itemsize=8, rows_are_nodes=True)  # 320 words per lane: past the budget
    assert (fp64.loop_order(False), fp64.loop_order(True)) == ("segments", "segments")
    per_edge = build_schedule(problem, itemsize=4)  # rows are edges: one edge per row, nothing to reorder
    assert (per_edge.loop_order(False), per_edge.loop_order(True)) == ("segments", "segments")
    forced = build_schedule(problem, itemsize=4, rows_are_nodes=True, tuning=TPTuning(loop_order="segments"))
    assert (forced.loop_order(False), forced.forward_launch.chunk) == ("segments", 128)
    assert (forced.loop_order(True), forced.backward_launch.chunk) == ("segments", 64)
    own = build_schedule(problem, itemsize=4, rows_are_nodes=True, tuning=TPTuning(backward_loop_order="segments"))
    assert (own.loop_order(False), own.loop_order(True)) == ("chunks", "segments")  # the forward's auto stays
    assert (own.forward_launch.chunk, own.backward_launch.chunk) == (32, 64)
    # NequIP-like tapered channels: the forward in chunks, the backward in segments (its chunk of before)
    tapered = build_schedule(TPProblem.build(*instructions("128x0e+64x1o", "0e+1o", "128x0e+64x1o", "uvu")),
                             itemsize=4, rows_are_nodes=True)
    assert (tapered.loop_order(False), tapered.loop_order(True)) == ("chunks", "segments")
    assert (tapered.forward_launch.chunk, tapered.backward_launch.chunk) == (32, 64)
    # a single in1 irrep (MACE's first convolution): edges forward, segments backward
    single = build_schedule(TPProblem.build(*instructions("128x0e", "0e+1o+2e+3o", "128x0e+128x1o+128x2e+128x3o",
                                                          "uvu")), itemsize=4, rows_are_nodes=True)
    assert (single.loop_order(False), single.loop_order(True)) == ("edges", "segments")
    with pytest.raises(ValueError, match="backward_loop_order"):
        TPTuning(backward_loop_order="rows")
    source, name = render(fp32, "float", layouts.CONV_FORWARD.with_table(), True, False)
    assert "edges outermost" in source and name != render(forced, "float", layouts.CONV_FORWARD, True, False)[1]


def test_chunks_backward_runs_one_launch_per_channel_chunk(monkeypatch):
    """MACE-MP-medium's second convolution backward (chunks order, CSR rows, FP32): four 32-channel chunks the
    kernel can run one launch each (group_pass; -1 all), per chunk where the grad-out rows exceed the L2; one
    launch in FP64, per-edge rows, the segments order or with the passes off (read when the schedule is built).
    The first convolution's one-irrep backward: one 128-channel chunk (window under SINGLE_IRREP_WINDOW_BYTES)."""
    from cgforge.kernels.explain import instructions

    problem = TPProblem.build(*instructions("128x0e+128x1o", "0e+1o+2e+3o", "128x0e+128x1o+128x2e+128x3o", "uvu"))
    fp32 = build_schedule(problem, itemsize=4, rows_are_nodes=True)
    assert fp32.backward_passes() == 4
    source, name = render(fp32, "float", layouts.CONV_BACKWARD.with_table(), False, True)
    assert "int group_pass)" in source and all(f"group_pass == {i})" in source for i in range(4))
    assert "group_pass == 4" not in source
    # launched per chunk only where the grad-out rows exceed the L2: 1000 rows x 5120 x 4 B = 20.5 MB
    from cgforge.kernels.tensor_product import launch

    monkeypatch.setattr(launch, "l2_bytes", lambda device: 50 << 20)  # a device fact, not a knob
    assert launch.backward_launches(fp32, 1000, "cuda") == [-1]
    assert launch.backward_launches(fp32, 5184, "cuda") == [0, 1, 2, 3]
    assert launch.backward_launches(build_schedule(problem, itemsize=8, rows_are_nodes=True), 10**6, "cuda") == [-1]
    assert build_schedule(problem, itemsize=8, rows_are_nodes=True).backward_passes() == 1
    assert build_schedule(problem, itemsize=4).backward_passes() == 1
    assert build_schedule(problem, itemsize=4, rows_are_nodes=True,
                          tuning=TPTuning(backward_loop_order="segments")).backward_passes() == 1
    one = build_schedule(problem, itemsize=4, rows_are_nodes=True, tuning=TPTuning(backward_chunk_passes=False))
    assert one.backward_passes() == 1 and fp32.backward_passes() == 4
    one_source, one_name = render(one, "float", layouts.CONV_BACKWARD.with_table(), False, True)
    assert "group_pass ==" not in one_source and one_name != name
    single = build_schedule(TPProblem.build(*instructions("128x0e", "0e+1o+2e+3o", "128x0e+128x1o+128x2e+128x3o",
                                                          "uvu")), itemsize=4, rows_are_nodes=True)
    assert single.backward_launch.chunk == 128 and single.backward_passes() == 1
    off = TPTuning(single_irrep_backward_chunk=None)
    assert build_schedule(single.problem, itemsize=4, rows_are_nodes=True, tuning=off).backward_launch.chunk == 64
