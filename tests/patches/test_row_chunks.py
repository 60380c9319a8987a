"""The stored path's widest rows in chunks (``patches.mace.row_chunks``): a MACE block's convolution output and
the linear after it made by ranges of atoms. Same energies and forces as the whole rows; chosen per system size
by the calculator (and the MD engine at its start), never while streaming or compiled."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cgforge.kernels import KernelTuning, RowPolicy
from cgforge.patches.mace import row_chunks
from cgforge.patches.mace.row_chunks import RecomputedHarmonics
from cgforge.patches.mace.streaming import AppliedLinear
from cgforge.plugin import Calculator
from cgforge.plugin.water import water_box


def _calculator(rows: RowPolicy | None = None, **kw) -> Calculator:
    """The bundled MACE with radial tables; ``rows``: the row policy it is patched with (None: the defaults)."""
    if rows is not None:
        kw["tuning"] = KernelTuning(rows=rows)
    return Calculator("mace", device=kw.pop("device", "cpu"), dtype=kw.pop("dtype", "float64"), patch=True,
                      radial_table=True, **kw)


def _set_rows(calc: Calculator, rows: RowPolicy) -> None:
    """Another row policy for the blocks of a calculator made already."""
    for block in calc.model.interactions:
        block.conv_tp.rows = rows


def _energy_forces(calc: Calculator, atoms) -> tuple[float, np.ndarray]:
    calc.reset()
    atoms = atoms.copy()
    atoms.calc = calc
    return atoms.get_potential_energy(), atoms.get_forces()


def _small_chunks(rows: int, itemsize: int = 8) -> RowPolicy:
    """Chunks of ``rows`` rows for any size (the real thresholds are ~1 GiB of rows, thousands of rows)."""
    widest = max(b.conv_tp.irreps_out.dim for b in row_chunks.streaming_blocks(_calculator(warmup=False).model))
    return RowPolicy(chunk_bytes=rows * widest * itemsize, chunked_above_bytes=0, min_chunk_rows=1)


def _model_energy(calc: Calculator, atoms) -> torch.Tensor:
    """The patched model's energy of ``atoms`` called directly (outside the calculator's step), differentiable."""
    from cgforge.plugin.runtime.neighbours import neighbour_list

    kw = {"dtype": torch.float64}
    positions, cell = torch.as_tensor(atoms.get_positions(), **kw), torch.as_tensor(np.array(atoms.cell), **kw)
    sender, receiver, shifts = neighbour_list(positions, cell, tuple(atoms.pbc), calc.cutoff)
    vectors = positions[receiver] - positions[sender] + shifts.to(positions.dtype) @ cell
    species = calc.adapter.species(atoms.numbers)
    return calc.adapter.energy(positions, vectors, species, calc.adapter.edge_index(sender, receiver), False)[0]


def _chunked_blocks(calc: Calculator) -> list[int | None]:
    return [b.conv_tp.row_chunk if isinstance(b.linear, AppliedLinear) else None for b in calc.model.interactions]


@pytest.mark.parametrize("rows", [7, 1000])  # ragged ranges; one range holding every row
@pytest.mark.slow
def test_row_chunks_give_the_whole_rows_energy_and_forces(rows: int) -> None:
    atoms = water_box(16, seed=11)
    e0, f0 = _energy_forces(_calculator(), atoms)
    calc = _calculator(_small_chunks(rows))
    e1, f1 = _energy_forces(calc, atoms)
    assert _chunked_blocks(calc) == [rows, rows] and isinstance(calc.model.spherical_harmonics, RecomputedHarmonics)
    assert abs(e1 - e0) <= 1e-12 * abs(e0) and np.abs(f1 - f0).max() <= 1e-10 * np.abs(f0).max()
    assert np.abs(f0).max() > 0
    # a smaller system under the threshold goes back to whole rows, and the linear to the block
    _set_rows(calc, RowPolicy(chunked_above_bytes=1 << 40))
    small = water_box(8, seed=2)
    e2, f2 = _energy_forces(calc, small)
    assert _chunked_blocks(calc) == [None, None] and not isinstance(calc.model.interactions[0].linear, AppliedLinear)
    assert not isinstance(calc.model.spherical_harmonics, RecomputedHarmonics)
    e3, f3 = _energy_forces(_calculator(), small)
    assert e2 == e3 and np.array_equal(f2, f3)


@pytest.mark.slow
def test_backward_by_receiver_ranges_gives_the_same_forces(monkeypatch) -> None:
    """Row chunks with the first-order backward by ranges of receiver rows (``TPTuning.backward_range_bytes``):
    the whole MACE model's forces as with the whole gradient (FP64)."""
    from cgforge.kernels import Convolution, TPTuning
    from cgforge.kernels.convolution import table_rows

    atoms = water_box(16, seed=12)
    e0, f0 = _energy_forces(_calculator(), atoms)
    calc = _calculator(_small_chunks(7))
    widths = [b.conv_tp.irreps_out.dim for b in row_chunks.row_chunk_blocks(calc.model)]
    tuning = TPTuning(backward_range_bytes=5 * widths[0] * 8)  # ranges of 5 atoms in block 1
    for block in row_chunks.row_chunk_blocks(calc.model):  # the same kernels with that tuning
        block.conv_tp.conv = Convolution(None, None, None, [], problem=block.conv_tp.conv.problem, tuning=tuning)
    calls = []
    real = table_rows.transposed_range
    monkeypatch.setattr(table_rows, "transposed_range", lambda *a: calls.append(a[3]) or real(*a))
    e1, f1 = _energy_forces(calc, atoms)
    want = [r0 for w in widths for r0, _ in table_rows.row_ranges(len(atoms), max(5 * widths[0] // w, 1))]
    assert sorted(calls) == sorted(want) and len(calls) > 2
    assert abs(e1 - e0) <= 1e-12 * abs(e0) and np.abs(f1 - f0).max() <= 1e-10 * np.abs(f0).max()


def test_recomputed_harmonics_equal_e3nns_to_second_order() -> None:
    """The harmonics keep only the vectors for the backward and evaluate again there: values, gradients and
    second derivatives as e3nn's (FP64)."""
    from e3nn import o3

    harmonics = o3.SphericalHarmonics(o3.Irreps.spherical_harmonics(3), normalize=True, normalization="component")
    recomputed = RecomputedHarmonics(harmonics)
    gen = torch.Generator().manual_seed(3)
    vectors = torch.randn(17, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(recomputed(vectors), harmonics(vectors), rtol=0, atol=0)
    assert torch.autograd.gradcheck(recomputed, (vectors,))
    assert torch.autograd.gradgradcheck(recomputed, (vectors,))
    g = torch.randn(17, 16, generator=gen, dtype=torch.float64)
    want = torch.autograd.grad(harmonics(vectors), vectors, g)[0]
    torch.testing.assert_close(torch.autograd.grad(recomputed(vectors), vectors, g)[0], want, rtol=1e-14, atol=1e-14)
    out = recomputed(vectors)  # what autograd keeps: the vectors, nothing of e3nn's evaluation
    assert type(out.grad_fn).__name__ == "_RecomputedBackward"
    assert len(out.grad_fn.saved_tensors) == 1 and out.grad_fn.saved_tensors[0] is vectors


def test_row_chunks_are_chosen_from_the_widest_rows() -> None:
    calc = _calculator(dtype="float32", warmup=False)
    widest = max(b.conv_tp.irreps_out.dim for b in calc.model.interactions)
    policy = RowPolicy()  # the defaults
    above = policy.chunked_above_bytes // (4 * widest)
    assert row_chunks.chunk_rows_for(calc.model, above, torch.float32) is None
    rows = row_chunks.chunk_rows_for(calc.model, above + 1, torch.float32)
    assert rows == max(policy.chunk_bytes // (4 * widest), policy.min_chunk_rows)
    mlp = Calculator("mace", device="cpu", dtype="float32", patch=True, radial_table=False, warmup=False)
    assert row_chunks.chunk_rows_for(mlp.model, 10 ** 9, torch.float32) is None  # only blocks reading tables


@pytest.mark.slow
def test_row_chunks_refused_while_streaming_and_bad_values() -> None:
    calc = _calculator(warmup=False)
    with pytest.raises(ValueError, match="chunk_rows"):
        row_chunks.set_row_chunks(calc.model, 0)
    assert calc.adapter.set_streaming(1 << 20) == 2
    assert row_chunks.row_chunk_blocks(calc.model) == []  # streaming blocks defer their radial: none to chunk
    assert not row_chunks.set_row_chunks(calc.model, None)  # off while streaming: the streaming linear stays
    assert all(isinstance(b.linear, AppliedLinear) for b in calc.model.interactions)
    _set_rows(calc, _small_chunks(5))
    calc.streaming = True
    calc.plan_rows(48)  # the calculator never chunks rows while streaming
    assert all(b.conv_tp.row_chunk is None for b in calc.model.interactions)


@pytest.mark.slow
def test_a_trained_linear_gets_its_gradient_from_whole_rows() -> None:
    """Row chunks treat the linear's weights as constants: with weights that need a gradient (training) the block
    runs whole rows, and the weights get the gradient they would without chunks."""
    rows = _small_chunks(5)
    atoms = water_box(8, seed=5)
    grads = []
    for chunked in (False, True):
        calc = _calculator(rows)
        _energy_forces(calc, atoms)  # plans the rows for this size
        if not chunked:
            calc.adapter.set_row_chunks(None)
        assert _chunked_blocks(calc) == ([5, 5] if chunked else [None, None])
        linear = calc.model.interactions[1].linear
        linear = linear.module if isinstance(linear, AppliedLinear) else linear
        linear.weight.requires_grad_(True)
        with torch.enable_grad():
            energy = _model_energy(calc, atoms)
            (g,) = torch.autograd.grad(energy, linear.weight)
        grads.append(g)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-10, atol=1e-12)
    assert grads[0].abs().max() > 0


@pytest.mark.slow
def test_unpatch_after_row_chunks_leaves_no_cgforge_module() -> None:
    from cgforge.patches import mace as pm

    calc = _calculator(_small_chunks(5))
    _energy_forces(calc, water_box(8, seed=1))
    assert _chunked_blocks(calc) == [5, 5] and isinstance(calc.model.spherical_harmonics, RecomputedHarmonics)
    pm.unpatch(calc.model)
    left = [type(m).__qualname__ for m in calc.model.modules() if type(m).__module__.startswith("cgforge")]
    assert left == []


@pytest.mark.slow
def test_the_engine_plans_rows_at_its_start(fp64_one_thread) -> None:
    from cgforge.plugin.md.engine import Engine
    from cgforge.plugin.md.integrators import VelocityVerlet

    atoms = water_box(8, seed=4)
    runs = []
    for chunked in (False, True):
        calc = _calculator(_small_chunks(5) if chunked else None)
        engine = Engine(calc, atoms.copy(), VelocityVerlet(0.5), block=2)
        engine.run(4)
        runs.append(engine.atoms.get_positions())
        assert _chunked_blocks(calc) == ([5, 5] if chunked else [None, None])
    assert np.abs(runs[1] - runs[0]).max() <= 1e-10


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_cuda_row_chunks_in_the_captured_step(dtype: str) -> None:
    """On the GPU, captured: the kernels' row ranges (a sliced CSR row pointer) give the whole rows' energy and
    forces, and the same bits on every call."""
    atoms = water_box(64, seed=12)
    e0, f0 = _energy_forces(_calculator(device="cuda", dtype=dtype), atoms)
    calc = _calculator(_small_chunks(50, 4 if dtype == "float32" else 8), device="cuda", dtype=dtype)
    e1, f1 = _energy_forces(calc, atoms)
    assert _chunked_blocks(calc) == [50, 50] and calc.step.cuda_graph
    tol = 1e-5 if dtype == "float32" else 1e-11
    assert abs(e1 - e0) <= tol * abs(e0) and np.abs(f1 - f0).max() <= tol * np.abs(f0).max()
    e2, f2 = _energy_forces(calc, atoms)
    assert e2 == e1 and np.array_equal(f2, f1)


@pytest.mark.cuda
@pytest.mark.parametrize(("dtype", "tol"), [("float64", 1e-10), ("float32", 1e-5)])
def test_cuda_receiver_backward_gives_the_sender_backwards_forces(monkeypatch, dtype: str, tol: float) -> None:
    """The bundled MACE in a calculator (parameters frozen, so the first layer's x, the species embedding, needs no
    gradient): its first convolution's backward over the receivers (no grad x; taken for rows of any width with
    the tuning at 1 byte: the bundled model's rows, 1.2 / 2.3 KB, are below the default) gives the energy and
    forces of the sender-order backward (tuning None), and is the one that ran."""
    from cgforge.kernels import KernelTuning, TPTuning
    from cgforge.kernels.convolution import table_ops

    asked = []
    real = table_ops.conv_table_backward
    monkeypatch.setattr(table_ops, "conv_table_backward", lambda *a: asked.append(a[-1]) or real(*a))  # a spy
    atoms = water_box(64, seed=13)

    def run(min_row_bytes):
        tuning = KernelTuning(tp=TPTuning(receiver_backward_min_row_bytes=min_row_bytes))
        calc = _calculator(device="cuda", dtype=dtype, tuning=tuning, cuda_graph=False)
        asked.clear()
        result = _energy_forces(calc, atoms)
        return result, list(asked)

    (e0, f0), sender = run(None)
    (e1, f1), receiver = run(1)
    assert sender and all(sender) and False in receiver  # grad x asked for by every call / not by the first layer
    assert abs(e1 - e0) <= tol * abs(e0)
    assert np.abs(f1 - f0).max() <= tol * np.abs(f0).max() and np.abs(f0).max() > 0
