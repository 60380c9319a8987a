"""The convolution reading its weights from a radial table (``Convolution.forward_table``): equal to the
convolution of the table's values, with gradients in x, y and the edge lengths (and their derivatives), on the
CPU path, in the generated kernels (NVRTC on the CPU) and (CUDA) on the GPU."""

from __future__ import annotations

import pytest
import torch
from tp_cases import PROBLEMS, e3nn_tp, rel

from cgforge.kernels import ConvGraph, Convolution, TPTuning
from cgforge.kernels.radial_table import radial_table

R_MAX = 5.0

# Spill traffic (bytes stored + loaded a thread) allowed in the MACE-layer kernels below: ptxas leaves a few stack
# slots around the grad-y reduce-scatter in some of them (up to 64 B, NVRTC 12, 2026-11-28; 80 B in mace-medium's
# receiver walk once its grad-out block is staged before the edge loop: the same 8-byte frame, 16 B stored, reloaded
# at more places); more means a schedule went wrong.
SMALL_SPILL_BYTES = 96


def _case(problem: str, n: int, e: int, dtype=torch.float64, device="cpu", seed=0, intervals=64):
    """A convolution, its graph, inputs (x, y, lengths) that require grad, and a random table."""
    torch.manual_seed(seed)
    conv = Convolution.from_e3nn(e3nn_tp(PROBLEMS[problem]))
    gen = torch.Generator().manual_seed(seed)
    sender, receiver = torch.randint(0, n, (e,), generator=gen), torch.randint(0, n, (e,), generator=gen)
    x = torch.randn(n, conv.irreps_in1.dim, generator=gen, dtype=torch.float64)
    y = torch.randn(e, conv.irreps_in2.dim, generator=gen, dtype=torch.float64)
    # lengths inside the table, on its knots, at both ends and (clamped) beyond them
    lengths = torch.rand(e, generator=gen, dtype=torch.float64) * (R_MAX + 1.0) - 0.5
    lengths[:4] = torch.tensor([0.0, R_MAX, R_MAX * 17 / intervals, R_MAX * 3 / intervals])[: min(4, e)]
    coeffs = torch.randn(intervals, conv.weight_numel, 4, generator=gen, dtype=torch.float64)
    to = {"dtype": dtype, "device": device}
    graph = ConvGraph(sender.to(device), receiver.to(device), n)
    return (conv.to(device), graph, *(t.to(**to).requires_grad_() for t in (x, y, lengths)), coeffs.to(**to))


def _both(conv, graph, x, y, lengths, coeffs):
    fused = conv.forward_table(x, y, lengths, coeffs, R_MAX, graph)
    plain = conv(x, y, radial_table(lengths, coeffs, R_MAX), graph)
    return fused, plain


@pytest.mark.parametrize("problem", ["nequip-water", "diffdock-L1"])  # uvu and uvw paths
def test_equals_the_convolution_of_the_table_values(problem: str) -> None:
    conv, graph, x, y, lengths, coeffs = _case(problem, 9, 60)
    fused, plain = _both(conv, graph, x, y, lengths, coeffs)
    assert rel(fused, plain) < 1e-13 and fused.abs().max() > 0
    g = torch.randn_like(plain)
    for a, b in zip(torch.autograd.grad(fused, (x, y, lengths), g), torch.autograd.grad(plain, (x, y, lengths), g),
                    strict=True):
        assert rel(a, b) < 1e-12 and b.abs().max() > 0


def _second_derivatives(fused, plain, inputs, seed=5):
    """d/d(inputs) of <h, d/d(inputs) of sum(out^2)> for both (the op's double backward and the composition's).
    The output's cotangent 2 out depends on the inputs, as a model's does: that path must not count twice."""
    gen = torch.Generator().manual_seed(seed)
    hs = [torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t) for t in inputs]
    results = []
    for out in (fused, plain):
        first = torch.autograd.grad(out.square().sum(), inputs, create_graph=True)
        scalar = sum((h * d).sum() for h, d in zip(hs, first, strict=True))
        results.append(torch.autograd.grad(scalar, inputs))
    return results


def test_second_derivatives_equal_the_composition() -> None:
    conv, graph, x, y, lengths, coeffs = _case("nequip-water", 6, 30)
    fused, plain = _both(conv, graph, x, y, lengths, coeffs)
    for a, b in zip(*_second_derivatives(fused, plain, (x, y, lengths)), strict=True):
        assert rel(a, b) < 1e-12 and b.abs().max() > 0


def test_lengths_as_a_column_and_bad_inputs() -> None:
    conv, graph, x, y, lengths, coeffs = _case("nequip-water", 5, 20)
    torch.testing.assert_close(conv.forward_table(x, y, lengths.unsqueeze(1), coeffs, R_MAX, graph),
                               conv.forward_table(x, y, lengths, coeffs, R_MAX, graph), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"lengths: expected \[20\] or \[20, 1\], got \[19\]"):
        conv.forward_table(x, y, lengths[:19], coeffs, R_MAX, graph)
    with pytest.raises(ValueError, match=rf"coeffs: expected \[N, {conv.weight_numel}, 4\]"):
        conv.forward_table(x, y, lengths, coeffs[:, :-1], R_MAX, graph)
    with pytest.raises(ValueError, match="constants"):
        conv.forward_table(x, y, lengths, coeffs.clone().requires_grad_(), R_MAX, graph)
    with pytest.raises(ValueError, match="r_max must be a positive number"):
        conv.forward_table(x, y, lengths, coeffs, 0.0, graph)
    with pytest.raises(TypeError, match="coeffs has dtype torch.float32"):
        conv.forward_table(x, y, lengths, coeffs.float(), R_MAX, graph)
    with pytest.raises(TypeError, match="graph must be a cgforge ConvGraph"):
        conv.forward_table(x, y, lengths, coeffs, R_MAX, None)


def test_table_kernels_compile_without_spills() -> None:
    # MACE's layer shape (some other shapes spill in FP64, with or without a table)
    from cgforge.kernels.core.compiler import compile_cubin, nvrtc_available
    from cgforge.kernels.tensor_product import plan as plans
    from cgforge.kernels.tensor_product.layout import CONV_BACKWARD, CONV_FORWARD

    if not nvrtc_available():
        pytest.skip("NVRTC is not installed")
    plan = plans.get(Convolution.from_e3nn(e3nn_tp(PROBLEMS["mace-medium"])).key)
    for dtype in (torch.float32, torch.float64):
        for layout, backward in ((CONV_FORWARD, False), (CONV_BACKWARD, True)):
            source, name = plan.source(dtype, layout.with_table(), backward)
            assert "locate(table, r[eid]" in source and "wrow" not in source and "gwrow" not in source
            assert ("grad_r[eid] +=" in source) == backward
            res = compile_cubin(source, arch="sm_90", name="conv_table.cu").resources(name)
            assert not res.spills, (name, res)


def _receiver_backward(conv: Convolution) -> Convolution:
    """``conv`` with the receiver-order backward for every width of grad-out row (where x needs no gradient)."""
    return Convolution(None, None, None, [], problem=conv.problem, tuning=TPTuning(receiver_backward_min_row_bytes=1))


def test_an_input_without_gradient_gets_none_and_the_same_other_gradients() -> None:
    """x that needs no gradient (MD's first layer: the species embedding): the backward forms no grad x and gives
    the same grad y and grad lengths, first and second order, as when x needs one."""
    conv, graph, x, y, lengths, coeffs = _case("nequip-water", 9, 60, seed=11)
    conv = _receiver_backward(conv)
    frozen = x.detach()
    g = torch.randn(9, conv.irreps_out.dim, dtype=torch.float64)
    for call in (lambda a: conv.forward_table(a, y, lengths, coeffs, R_MAX, graph),
                 lambda a: conv.forward_table_rows(a, y, lengths, coeffs, R_MAX, graph, torch.nn.Identity(), 4)):
        want = torch.autograd.grad(call(x), (y, lengths), g, create_graph=True)
        got = torch.autograd.grad(call(frozen), (y, lengths), g, create_graph=True)
        for a, b in zip(got, want, strict=True):
            assert rel(a, b) < 1e-13 and b.abs().max() > 0
        second = [torch.autograd.grad(sum(d.square().sum() for d in ds), (y, lengths)) for ds in (got, want)]
        for a, b in zip(*second, strict=True):
            assert rel(a, b) < 1e-12 and b.abs().max() > 0


def test_the_tuning_chooses_the_backward_for_an_input_without_gradient(monkeypatch) -> None:
    """The backward op is asked for no grad x where x needs none and the grad-out rows are at least
    receiver_backward_min_row_bytes wide; else (None, narrower rows, an x that needs a gradient) for it."""
    from cgforge.kernels.convolution import table_ops

    asked = []
    real = table_ops.conv_table_backward
    monkeypatch.setattr(table_ops, "conv_table_backward", lambda *a: asked.append(a[-1]) or real(*a))  # a spy
    conv, graph, x, y, lengths, coeffs = _case("nequip-water", 6, 30, seed=14)
    width = conv.irreps_out.dim * 8

    def tuned(least):
        return Convolution(None, None, None, [], problem=conv.problem,
                           tuning=TPTuning(receiver_backward_min_row_bytes=least))

    cases = ((tuned(width), x.detach(), False), (tuned(width), x, True), (tuned(width + 8), x.detach(), True),
             (tuned(None), x.detach(), True), (conv, x.detach(), width < TPTuning().receiver_backward_min_row_bytes))
    for module, inp, want in cases:
        out = module.forward_table(inp, y, lengths, coeffs, R_MAX, graph)
        torch.autograd.grad(out, (y, lengths), torch.ones_like(out))
        assert asked.pop() is want


def test_the_backward_op_without_grad_x_returns_an_empty_grad_x() -> None:
    from cgforge.kernels.convolution.table_ops import conv_table_backward

    conv, graph, x, y, lengths, coeffs = _case("nequip-water", 7, 40, seed=12)
    g = torch.randn(7, conv.irreps_out.dim, dtype=torch.float64)
    args = (x.detach(), y.detach(), lengths.detach(), coeffs, g, *graph.tensors(), R_MAX, conv.key, True)
    gx, gy, gr = conv_table_backward(*args, False)
    full = conv_table_backward(*args)
    assert gx.shape == (0,) and full[0].shape == x.shape
    assert torch.equal(gy, full[1]) and torch.equal(gr, full[2])


def test_the_receiver_backward_with_grad_x_adds_it_by_atomics_per_edge() -> None:
    """TPTuning.receiver_backward_atomic's kernel (NVRTC on the CPU): the forward's rows, grad x added to the
    sender's row (xr) inside the edge loop, no grad-out row gathered; compiles with little spill traffic."""
    from cgforge.kernels.core.compiler import compile_cubin, nvrtc_available
    from cgforge.kernels.tensor_product import plan as plans
    from cgforge.kernels.tensor_product.layout import CONV_BACKWARD_RECEIVERS

    tuning = TPTuning(receiver_backward_atomic=True, backward_loop_order="segments")
    plan = plans.get(Convolution.from_e3nn(e3nn_tp(PROBLEMS["mace-medium"]), tuning=tuning).key)
    for dtype in (torch.float32, torch.float64):
        source, name = plan.source(dtype, CONV_BACKWARD_RECEIVERS.with_table(), True)
        loop = source.index("for (long long k = e_begin")
        assert "gidx[eid]" not in source and "xidx[eid]" in source and "g + gr * OUT_DIM" not in source
        assert loop < source.index("atomicAdd(gxrow") and source.index("g + row * OUT_DIM") < loop
        if nvrtc_available():
            res = compile_cubin(source, arch="sm_90", name="conv_table_receivers.cu").resources(name)
            assert res.spill_stores + res.spill_loads <= SMALL_SPILL_BYTES, (name, res)


def _fixed_point_conv(conv: Convolution) -> Convolution:
    return Convolution(None, None, None, [], problem=conv.problem,
                       tuning=TPTuning(receiver_backward_fixed_point=True))


@pytest.mark.parametrize("problem", ["mace-medium", "nequip-water", "diffdock-L1"])  # uvu and uvw paths
def test_the_fixed_point_bound_holds_for_every_edge(problem: str) -> None:
    """fixed_point.grad_x_bound: one edge's grad x (each edge its own sender row, the CPU reference) times the
    most edges of one sender is within the bound, which is not looser than a few hundred times what occurs."""
    from cgforge.kernels.convolution import fixed_point
    from cgforge.kernels.convolution.table_ops import conv_table_backward
    from cgforge.kernels.tensor_product.launch import has_unweighted_paths

    conv, graph, x, y, lengths, coeffs = _case(problem, 40, 600, seed=21)
    conv = _fixed_point_conv(conv)
    g = torch.randn(40, conv.irreps_out.dim, dtype=torch.float64)
    e = lengths.shape[0]
    alone = ConvGraph(torch.arange(e), graph.receiver, e)  # edge k is sender k's only edge
    gx = conv_table_backward(torch.randn(e, conv.irreps_in1.dim, dtype=torch.float64), y.detach(), lengths.detach(),
                             coeffs, g, *alone.tensors(), R_MAX, conv.key, True)[0]
    t = graph.tensors()
    bound = fixed_point.grad_x_bound(conv.key, coeffs, y, g, lengths, t.rowptr_t, has_unweighted_paths(conv.key))
    degree = int((t.rowptr_t[1:] - t.rowptr_t[:-1]).max())
    assert gx.abs().max() * degree <= bound and bound < 300 * gx.abs().max() * degree


def test_the_fixed_point_scale_keeps_every_sum_inside_int64() -> None:
    """fixed_point.scale_for: a power of two with bound * scale in [2^61, 2^62) (a tiny bound: within the dtype's
    range); a bound that is not finite gives scale 1 and a grad x of NaN."""
    from cgforge.kernels.convolution import fixed_point

    for dtype in (torch.float32, torch.float64):
        for b in (0.0, 1e-30, 3.7, 2.0 ** 20, 1e20):
            bound = torch.tensor(b, dtype=torch.float64)
            scale = fixed_point.scale_for(bound, dtype)
            assert scale.dtype == dtype and float(torch.frexp(scale.double())[0]) == 0.5  # a power of two
            assert b * float(scale) < 2.0 ** 62 and (b * float(scale) >= 2.0 ** 61 or b < 1e-20)
        for b in (float("nan"), float("inf")):
            bound = torch.tensor(b, dtype=torch.float64)
            assert float(fixed_point.scale_for(bound, dtype)) == 1.0
            sums = torch.arange(6, dtype=torch.int64).reshape(2, 3)
            assert fixed_point.from_fixed(sums, torch.tensor(1.0), bound, dtype).isnan().all()
    sums = torch.tensor([[-(2 ** 61), 3], [2 ** 40 + 1, 0]])
    back = fixed_point.from_fixed(sums, torch.tensor(2.0 ** 40, dtype=torch.float64), torch.tensor(1.0),
                                  torch.float64)
    assert back.tolist() == [[-(2.0 ** 21), 3 / 2 ** 40], [1 + 2.0 ** -40, 0.0]]


def test_the_fixed_point_rule_takes_fp32_grad_out_rows_beyond_the_l2_within_the_sums_budget(monkeypatch) -> None:
    """table_ops.fixed_point_grad_x: ``auto`` where g exceeds the device's L2 (a device fact, set here) and the int64
    sums of x fit TPTuning.fixed_point_max_bytes; never in FP64; True and False as set."""
    from cgforge.kernels.convolution import table_ops

    problem = Convolution.from_e3nn(e3nn_tp(PROBLEMS["mace-medium"])).problem

    def rule(setting, x, g, max_bytes=1 << 30):
        tuning = TPTuning(receiver_backward_fixed_point=setting, fixed_point_max_bytes=max_bytes)
        key = Convolution(None, None, None, [], problem=problem, tuning=tuning).key
        return table_ops.fixed_point_grad_x(key, x, g)

    x, g = torch.zeros(10, 64), torch.zeros(10, 400)  # 16,000 bytes of grad-out, 5,120 of int64 sums
    monkeypatch.setattr(table_ops, "l2_bytes", lambda device: 15_999)
    assert rule("auto", x, g) and rule(True, x, g) and not rule(False, x, g)
    assert not rule("auto", x.double(), g.double()) and not rule(True, x.double(), g.double())
    assert not rule("auto", x, g, 5_119) and rule(True, x, g, 5_119) and rule("auto", x, g, 5_120)
    monkeypatch.setattr(table_ops, "l2_bytes", lambda device: 16_000)
    assert not rule("auto", x, g, 5_120)


def test_the_fixed_point_backward_kernel_adds_integers() -> None:
    """TPTuning.receiver_backward_fixed_point's kernel (NVRTC on the CPU): grad x an int64 buffer, each edge's part
    rounded at the scale read from the device and added by integer atomics; compiles with little spill
    traffic."""
    from cgforge.kernels.core.compiler import compile_cubin, nvrtc_available
    from cgforge.kernels.tensor_product import plan as plans
    from cgforge.kernels.tensor_product.layout import (
        CONV_BACKWARD_RECEIVERS_FIXED,
        CONV_BACKWARD_RECEIVERS_FIXED_SORTED,
    )

    plan = plans.get(_fixed_point_conv(Convolution.from_e3nn(e3nn_tp(PROBLEMS["mace-medium"]))).key)
    for layout in (CONV_BACKWARD_RECEIVERS_FIXED, CONV_BACKWARD_RECEIVERS_FIXED_SORTED):
        source, name = plan.source(torch.float32, layout.with_table(), True)
        assert "unsigned long long* __restrict__ gx" in source and "const scalar_t* __restrict__ gx_scale" in source
        assert "atomicAdd(gxrow + i, to_fixed(" in source and name.endswith("_backward") and "tf_backward" in name
        if nvrtc_available():
            res = compile_cubin(source, arch="sm_90", name="conv_table_fixed.cu").resources(name)
            assert res.spill_stores + res.spill_loads <= SMALL_SPILL_BYTES, (name, res)


def test_the_backward_without_grad_x_walks_the_receivers_and_stores_no_grad_x() -> None:
    """Its source (NVRTC on the CPU): x through xidx, the grad-out row of the row itself (staged once per row and
    edge loop, not per edge: ``Schedule.row_grad_once``), no grad x written; little spill traffic in MACE's layer
    shape."""
    from cgforge.kernels.core.compiler import compile_cubin, nvrtc_available
    from cgforge.kernels.tensor_product import plan as plans
    from cgforge.kernels.tensor_product.layout import CONV_BACKWARD, CONV_BACKWARD_NO_GX, CONV_BACKWARD_NO_GX_SORTED

    plan = plans.get(Convolution.from_e3nn(e3nn_tp(PROBLEMS["mace-medium"])).key)
    for dtype in (torch.float32, torch.float64):
        full, _ = plan.source(dtype, CONV_BACKWARD.with_table(), True)
        assert "gx + row * IN1_DIM" in full and "gidx[eid]" in full
        for layout in (CONV_BACKWARD_NO_GX, CONV_BACKWARD_NO_GX_SORTED):
            source, name = plan.source(dtype, layout.with_table(), True)
            assert name.endswith("tn_backward") and name != plan.source(dtype, CONV_BACKWARD.with_table(), True)[1]
            assert "gx + " not in source and "gidx[eid]" not in source and "xidx[eid]" in source
            assert "const long long gr = row;" in source and "grad_r[eid] +=" in source
            assert ("perm[k]" in source) == layout.perm
            once = plan.schedule(dtype, True).row_grad_once(layout)
            assert ("g + gr * OUT_DIM" in source) != once and ("g + row * OUT_DIM" in source) == once
            if once:  # before the edge loop
                assert source.index("g + row * OUT_DIM") < source.index("for (long long k = e_begin")
            if nvrtc_available():
                res = compile_cubin(source, arch="sm_90", name="conv_table_no_gx.cu").resources(name)
                assert res.spill_stores + res.spill_loads <= SMALL_SPILL_BYTES, (name, res)


def _row_map(width: int, seed: int = 7, dtype=torch.float64, device="cpu") -> torch.nn.Linear:
    """An affine row map narrowing the convolution's rows (a block's next linear), constant parameters."""
    torch.manual_seed(seed)
    return torch.nn.Linear(width, max(width // 2, 1)).to(dtype=dtype, device=device).requires_grad_(False)


@pytest.mark.parametrize("chunk_rows", [1, 4, 9, 50])  # one row, ragged ranges, one range, more than the rows
def test_rows_in_chunks_equal_the_map_of_the_whole_convolution(chunk_rows: int) -> None:
    """forward_table_rows: out_fn(forward_table(...)) made chunk_rows receiver rows at a time, values and first
    and second derivatives; the CPU path reads the sliced CSR rows as the kernels do."""
    conv, graph, x, y, lengths, coeffs = _case("nequip-water", 9, 60)
    linear = _row_map(conv.irreps_out.dim)
    chunked = conv.forward_table_rows(x, y, lengths, coeffs, R_MAX, graph, linear, chunk_rows)
    whole = linear(conv.forward_table(x, y, lengths, coeffs, R_MAX, graph))
    assert rel(chunked, whole) < 1e-13 and whole.abs().max() > 0
    g = torch.randn_like(whole)
    for a, b in zip(torch.autograd.grad(chunked, (x, y, lengths), g, retain_graph=True),
                    torch.autograd.grad(whole, (x, y, lengths), g, retain_graph=True), strict=True):
        assert rel(a, b) < 1e-12 and b.abs().max() > 0
    for a, b in zip(*_second_derivatives(chunked, whole, (x, y, lengths)), strict=True):
        assert rel(a, b) < 1e-12 and b.abs().max() > 0


def test_row_ranges_cover_every_row_once() -> None:
    from cgforge.kernels.convolution.table_rows import row_ranges

    assert row_ranges(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert row_ranges(8, 4) == [(0, 4), (4, 8)]
    assert row_ranges(3, 50) == [(0, 3)]
    assert row_ranges(0, 5) == [(0, 0)]  # no rows: one empty range, so the output still gets its width
    with pytest.raises(ValueError, match="chunk_rows"):
        row_ranges(5, 0)


def test_transposed_range_lists_each_ranges_edges_in_the_transposed_order() -> None:
    """Per receiver range, the sender-major CSR of exactly the edges whose receiver is in it, in the whole
    transposed CSR's order; over the ranges every edge once."""
    from cgforge.kernels.convolution.table_ops import _csr_edges
    from cgforge.kernels.convolution.table_rows import row_ranges, transposed_range

    _, graph, *_ = _case("nequip-water", 23, 300, seed=2)
    t = graph.tensors()
    order = t.perm_t.long()
    seen = []
    for r0, r1 in row_ranges(23, 6):
        rowptr, perm = transposed_range(t.rowptr_t, t.perm_t, t.receiver, r0, r1)
        assert rowptr.dtype == torch.int64 and perm.dtype == torch.int32 and rowptr.shape == t.rowptr_t.shape
        ids, senders = _csr_edges(rowptr, perm)
        inside = ((t.receiver[order] >= r0) & (t.receiver[order] < r1))
        assert torch.equal(ids, order[inside])  # the masked transposed order
        assert torch.equal(senders, t.sender[ids].long())  # each under its sender's row
        seen.append(ids)
    assert torch.equal(torch.sort(torch.cat(seen)).values, torch.arange(300))


@pytest.mark.parametrize("range_rows", [1, 5, 9, 50])  # one row each, ragged, one range
def test_backward_by_receiver_ranges_equals_the_whole_backward(monkeypatch, range_rows: int) -> None:
    """A first-order backward with the output gradient made by ranges of receiver rows: the whole backward's
    gradients (FP64); a backward that keeps its graph (second derivatives) takes the whole path."""
    from cgforge.kernels.convolution import table_rows

    conv, graph, x, y, lengths, coeffs = _case("nequip-water", 9, 60, seed=6)
    by_ranges = Convolution(None, None, None, [], problem=conv.problem,
                            tuning=TPTuning(backward_range_bytes=range_rows * conv.irreps_out.dim * 8))
    linear = _row_map(conv.irreps_out.dim)
    g = torch.randn(9, linear.out_features, dtype=torch.float64)
    want = torch.autograd.grad(conv.forward_table_rows(x, y, lengths, coeffs, R_MAX, graph, linear, 4),
                               (x, y, lengths), g)
    calls = []
    real = table_rows.transposed_range
    monkeypatch.setattr(table_rows, "transposed_range", lambda *a: calls.append(a[3:]) or real(*a))  # a spy
    out = by_ranges.forward_table_rows(x, y, lengths, coeffs, R_MAX, graph, linear, 4)
    got = torch.autograd.grad(out, (x, y, lengths), g)
    assert calls == table_rows.row_ranges(9, range_rows) if range_rows < 9 else calls == []
    for a, b in zip(got, want, strict=True):
        assert rel(a, b) < 1e-13 and b.abs().max() > 0
    calls.clear()
    out = by_ranges.forward_table_rows(x, y, lengths, coeffs, R_MAX, graph, linear, 4)
    torch.autograd.grad(out, (x, y, lengths), g, create_graph=True)
    assert calls == []  # second order: the whole gradient, differentiable


def test_rows_in_chunks_bad_arguments() -> None:
    conv, graph, x, y, lengths, coeffs = _case("nequip-water", 5, 20)
    linear = _row_map(conv.irreps_out.dim)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="chunk_rows"):
            conv.forward_table_rows(x, y, lengths, coeffs, R_MAX, graph, linear, bad)
    with pytest.raises(TypeError, match="out_fn"):
        conv.forward_table_rows(x, y, lengths, coeffs, R_MAX, graph, "linear", 2)
    atomic = ConvGraph(graph.sender, graph.receiver, graph.num_nodes, deterministic=False)
    with pytest.raises(ValueError, match="deterministic"):
        conv.forward_table_rows(x, y, lengths, coeffs, R_MAX, atomic, linear, 2)
    with pytest.raises(ValueError, match="x"):
        conv.forward_table_rows(x[:3], y, lengths, coeffs, R_MAX, graph, linear, 2)


# ---------------------------------------------------------------- CUDA

def _sorted_by_receiver(graph: ConvGraph, y: torch.Tensor, lengths: torch.Tensor):
    """The same graph with its edges in receiver order (its perm empty), and y and the lengths in that order."""
    order = torch.argsort(graph.receiver.long(), stable=True)
    sorted_graph = ConvGraph(graph.sender[order], graph.receiver[order], graph.num_nodes)
    assert sorted_graph.tensors().perm.numel() == 0
    return sorted_graph, *(t.detach()[order].requires_grad_() for t in (y, lengths))



@pytest.mark.cuda
@pytest.mark.parametrize("problem", ["mace-medium", "nequip-water", "diffdock-L2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("deterministic", [True, False])
def test_cuda_equals_the_convolution_of_the_table_values(problem: str, dtype: torch.dtype,
                                                         deterministic: bool) -> None:
    conv, graph, x, y, lengths, coeffs = _case(problem, 200, 3000, dtype=dtype, device="cuda", seed=3)
    if not deterministic:
        graph = ConvGraph(graph.sender, graph.receiver, graph.num_nodes, deterministic=False)
    fused, plain = _both(conv, graph, x, y, lengths, coeffs)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    assert rel(fused, plain) < tol
    g = torch.randn_like(plain)
    grads = torch.autograd.grad(fused, (x, y, lengths), g)
    for a, b in zip(grads, torch.autograd.grad(plain, (x, y, lengths), g), strict=True):
        assert rel(a, b) < tol and b.abs().max() > 0
    if deterministic:  # CSR rows, a fixed order: the same bits every run
        again = conv.forward_table(x, y, lengths, coeffs, R_MAX, graph)
        assert torch.equal(again, fused)
        assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(again, (x, y, lengths), g), grads,
                                                     strict=True))


@pytest.mark.cuda
@pytest.mark.parametrize("problem", ["mace-medium", "nequip-water", "diffdock-L2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("sorted_edges", [False, True])
def test_cuda_backward_without_grad_x_equals_the_whole_backward(problem: str, dtype: torch.dtype,
                                                                sorted_edges: bool) -> None:
    """x needing no gradient: the receiver-order kernel's grad y and grad lengths equal those of the backward that
    forms grad x too and the composition's; every run the same bits; through forward_table_rows as well."""
    conv, graph, x, y, lengths, coeffs = _case(problem, 300, 6000, dtype=dtype, device="cuda", seed=13)
    conv = _receiver_backward(conv).to("cuda")
    if sorted_edges:  # edges already in receiver order: perm is empty
        graph, y, lengths = _sorted_by_receiver(graph, y, lengths)
    frozen = x.detach()
    g = torch.randn(300, conv.irreps_out.dim, dtype=dtype, device="cuda")
    tol = 1e-5 if dtype == torch.float32 else 1e-12

    def grads(a, rows=False):
        out = (conv.forward_table_rows(a, y, lengths, coeffs, R_MAX, graph, torch.nn.Identity(), 37) if rows
               else conv.forward_table(a, y, lengths, coeffs, R_MAX, graph))
        return torch.autograd.grad(out, (y, lengths), g)

    want = grads(x)
    plain = torch.autograd.grad(conv(frozen, y, radial_table(lengths, coeffs, R_MAX), graph), (y, lengths), g)
    got = grads(frozen)
    for a, b, c in zip(got, want, plain, strict=True):
        assert rel(a, b) < tol and rel(a, c) < tol and b.abs().max() > 0
    assert all(torch.equal(a, b) for a, b in zip(grads(frozen), got, strict=True))
    for a, b in zip(grads(frozen, rows=True), got, strict=True):
        assert rel(a, b) < tol


@pytest.mark.cuda
@pytest.mark.parametrize("problem", ["mace-medium", "nequip-water", "diffdock-L2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("order", ["auto", "segments"])
def test_cuda_receiver_backward_with_atomic_grad_x_equals_the_whole_backward(problem: str, dtype: torch.dtype,
                                                                             order: str) -> None:
    """TPTuning.receiver_backward_atomic: x needing a gradient, the backward over the receivers adds grad x by
    atomics; grad x, grad y and grad lengths equal the sender-order backward's (to rounding: the atomics' order
    varies), with edge ids through perm and without."""
    conv, graph, x, y, lengths, coeffs = _case(problem, 300, 6000, dtype=dtype, device="cuda", seed=15)
    tuning = TPTuning(receiver_backward_atomic=True, backward_loop_order=None if order == "auto" else order)
    atomic = Convolution(None, None, None, [], problem=conv.problem, tuning=tuning).to("cuda")
    g = torch.randn(300, conv.irreps_out.dim, dtype=dtype, device="cuda")
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    # perm, then edges already in receiver order (no perm)
    for gr, yy, ll in ((graph, y, lengths), _sorted_by_receiver(graph, y, lengths)):
        want = torch.autograd.grad(conv.forward_table(x, yy, ll, coeffs, R_MAX, gr), (x, yy, ll), g)
        got = torch.autograd.grad(atomic.forward_table(x, yy, ll, coeffs, R_MAX, gr), (x, yy, ll), g)
        for a, b in zip(got, want, strict=True):
            assert rel(a, b) < tol and b.abs().max() > 0


@pytest.mark.cuda
@pytest.mark.parametrize("problem", ["mace-medium", "nequip-water", "diffdock-L2"])
def test_cuda_fixed_point_backward_equals_the_sender_order_one_with_the_same_bits_in_any_edge_order(
        problem: str) -> None:
    """TPTuning.receiver_backward_fixed_point (FP32): grad x, grad y and grad lengths equal the sender-order
    backward's to FP32 rounding; run again, and with the edges given in another order (so that the atomics add in
    another order), grad x has the same bits, and grad y and grad lengths per edge too."""
    conv, graph, x, y, lengths, coeffs = _case(problem, 300, 6000, dtype=torch.float32, device="cuda", seed=23)
    fixed = _fixed_point_conv(conv).to("cuda")
    g = torch.randn(300, conv.irreps_out.dim, device="cuda")

    def grads(c, gr, yy, ll):
        return torch.autograd.grad(c.forward_table(x, yy, ll, coeffs, R_MAX, gr), (x, yy, ll), g)

    want = grads(conv, graph, y, lengths)
    got = grads(fixed, graph, y, lengths)
    for a, b in zip(got, want, strict=True):
        assert rel(a, b) < 1e-5 and b.abs().max() > 0
    assert all(torch.equal(a, b) for a, b in zip(grads(fixed, graph, y, lengths), got, strict=True))
    order = torch.randperm(lengths.shape[0], generator=torch.Generator().manual_seed(4)).cuda()
    shuffled = ConvGraph(graph.sender[order], graph.receiver[order], graph.num_nodes)
    yy, ll = (t.detach()[order].requires_grad_() for t in (y, lengths))
    gx, gy, gl = grads(fixed, shuffled, yy, ll)
    assert torch.equal(gx, got[0]) and torch.equal(gy, got[1][order]) and torch.equal(gl, got[2][order])


@pytest.mark.cuda
def test_cuda_fixed_point_backward_of_a_nan_length_is_nan() -> None:
    """A NaN length: its edge's weights are NaN, so grad x is NaN (the fixed-point sums cannot carry a NaN: the
    bound is NaN and grad x is NaN throughout), never a finite number."""
    conv, graph, x, y, lengths, coeffs = _case("mace-medium", 50, 400, dtype=torch.float32, device="cuda", seed=25)
    fixed = _fixed_point_conv(conv).to("cuda")
    bad = lengths.detach().clone()
    bad[7] = float("nan")
    bad.requires_grad_()
    out = fixed.forward_table(x, y, bad, coeffs, R_MAX, graph)
    gx = torch.autograd.grad(out, x, torch.ones_like(out))[0]
    assert gx.isnan().all()


@pytest.mark.cuda
def test_cuda_second_derivatives_equal_the_composition() -> None:
    conv, graph, x, y, lengths, coeffs = _case("mace-medium", 50, 400, device="cuda")
    fused, plain = _both(conv, graph, x, y, lengths, coeffs)
    for a, b in zip(*_second_derivatives(fused, plain, (x, y, lengths)), strict=True):
        assert rel(a, b) < 1e-12 and b.abs().max() > 0


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("sorted_edges", [False, True])  # kernels reading edge ids through perm, or positions
def test_cuda_rows_in_chunks_equal_the_map_of_the_whole_convolution(dtype: torch.dtype, sorted_edges: bool) -> None:
    """The kernels on a sliced CSR row pointer (absolute edge positions): each range's rows are the whole
    graph's, bitwise; gradients and second derivatives as the composition's."""
    conv, graph, x, y, lengths, coeffs = _case("mace-medium", 200, 3000, dtype=dtype, device="cuda", seed=4)
    if sorted_edges:  # edges already in receiver order: perm is empty
        x = x.detach().requires_grad_()
        graph, y, lengths = _sorted_by_receiver(graph, y, lengths)
    linear = _row_map(conv.irreps_out.dim, dtype=dtype, device="cuda")
    rows_whole = conv.forward_table(x, y, lengths, coeffs, R_MAX, graph)
    chunked = conv.forward_table_rows(x, y, lengths, coeffs, R_MAX, graph, torch.nn.Identity(), 37)
    assert torch.equal(chunked, rows_whole)  # the same sums in the same order, range by range
    chunked = conv.forward_table_rows(x, y, lengths, coeffs, R_MAX, graph, linear, 37)
    whole = linear(rows_whole)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    assert rel(chunked, whole) < tol
    g = torch.randn_like(whole)
    for a, b in zip(torch.autograd.grad(chunked, (x, y, lengths), g, retain_graph=True),
                    torch.autograd.grad(whole, (x, y, lengths), g, retain_graph=True), strict=True):
        assert rel(a, b) < tol and b.abs().max() > 0
    if dtype == torch.float64:
        for a, b in zip(*_second_derivatives(chunked, whole, (x, y, lengths)), strict=True):
            assert rel(a, b) < 1e-11 and b.abs().max() > 0


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_backward_by_receiver_ranges_equals_the_whole_backward(dtype: torch.dtype) -> None:
    """The backward kernel on each range's transposed CSR (receiver - r0 into the range's gradient rows): the
    whole backward's gradients, every run the same bits. Not bitwise the whole path's: each range's gradient
    rows come from the row map's transpose on that range, and cuBLAS may round a GEMM of fewer rows otherwise
    (seen on an H100: grad y within the tolerance, not equal)."""
    conv, graph, x, y, lengths, coeffs = _case("mace-medium", 200, 3000, dtype=dtype, device="cuda", seed=8)
    linear = _row_map(conv.irreps_out.dim, dtype=dtype, device="cuda")
    g = torch.randn(200, linear.out_features, dtype=dtype, device="cuda")

    def grads(module: Convolution):
        out = module.forward_table_rows(x, y, lengths, coeffs, R_MAX, graph, linear, 37)
        return torch.autograd.grad(out, (x, y, lengths), g)

    want = grads(conv)
    by_ranges = Convolution(None, None, None, [], problem=conv.problem,
                            tuning=TPTuning(backward_range_bytes=45 * conv.irreps_out.dim * x.element_size()))
    got, again = grads(by_ranges), grads(by_ranges)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    for a, b in zip(got, want, strict=True):
        assert rel(a, b) < tol and b.abs().max() > 0
    assert all(torch.equal(a, b) for a, b in zip(got, again, strict=True))


@pytest.mark.cuda
def test_cuda_chunk_passes_give_the_one_launch_gradients_bitwise(monkeypatch) -> None:
    """mace-medium FP32 (chunks order backward): the same kernel launched once per channel chunk (as where the
    grad-out rows exceed the L2) or once for all chunks gives the same bits: each edge's grad y and grad r get the
    chunks' parts in the same order, grad x is stored per chunk."""
    from cgforge.kernels.tensor_product import launch
    from cgforge.kernels.tensor_product import plan as plans

    conv, graph, x, y, lengths, coeffs = _case("mace-medium", 300, 6000, dtype=torch.float32, device="cuda", seed=9)
    g = torch.randn(300, conv.irreps_out.dim, dtype=torch.float32, device="cuda")
    schedule = plans.get(conv.key).schedule(torch.float32, True)
    assert schedule.backward_passes() == 4

    def grads(l2: int):
        monkeypatch.setattr(launch, "l2_bytes", lambda device: l2)  # a device fact, not a knob
        out = conv.forward_table(x, y, lengths, coeffs, R_MAX, graph)
        return torch.autograd.grad(out, (x, y, lengths), g), launch.backward_launches(schedule, 300, x.device)

    (want, one), (got, passes) = grads(1 << 62), grads(0)
    assert one == [-1] and passes == [0, 1, 2, 3]
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b) and b.abs().max() > 0
