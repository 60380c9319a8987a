"""Edge vectors whose backward (the forces) is CSR row sums: equal to autograd's scatter, no atomics."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cgforge.kernels import edge_layout as el
from cgforge.plugin.runtime.edge_vectors import edge_differences, rows_times
from cgforge.plugin.runtime.neighbours import neighbour_list
from cgforge.plugin.water import water_box


def _layout(use_topology: bool, extra: int = 23):
    atoms = water_box(8, seed=2)
    atoms.rattle(0.05, seed=3)
    positions = torch.tensor(atoms.positions)
    cell = torch.tensor(np.array(atoms.cell))
    sender, receiver, shifts = neighbour_list(positions, cell, True, 4.0)
    n = len(atoms)
    topology = el.edge_topology(sender, receiver, shifts, n) if use_topology else None
    keep = torch.linalg.vector_norm(positions[receiver] - positions[sender] + shifts.double() @ cell, dim=1) < 3.0
    count = int((keep & keep[topology.reverse]).sum()) if topology is not None else int(keep.sum())
    pad = el.pad_offset_vector(3.0, torch.float64, torch.device("cpu"))
    layout = el.layout_edges(keep, sender, receiver, shifts.double(), n, count + extra, pad, with_graph=True,
                             topology=topology)
    return positions, layout


def test_rows_times_equals_the_matrix_product_to_second_order() -> None:
    """The strain's product (the virial is its gradient in the matrix): values, first and second derivatives
    equal those of ``rows @ matrix`` in FP64."""
    generator = torch.Generator().manual_seed(4)
    rows = torch.randn(57, 3, dtype=torch.float64, generator=generator, requires_grad=True)
    matrix = (torch.eye(3, dtype=torch.float64) + 0.1 * torch.randn(3, 3, dtype=torch.float64, generator=generator)
              ).requires_grad_(True)
    weights = torch.randn(57, 3, dtype=torch.float64, generator=generator)

    def energy(product):
        out = product(rows, matrix)
        return (weights * out).sum() + 0.5 * (out * out).sum()  # a cotangent that depends on the inputs

    for product in (rows_times, torch.matmul):
        e = energy(product)
        g_rows, g_matrix = torch.autograd.grad(e, (rows, matrix), create_graph=True)
        hess = torch.autograd.grad(g_matrix.sum() + (g_rows * weights).sum(), (rows, matrix))
        if product is rows_times:
            got = (e, g_rows, g_matrix, *hess)
        else:
            want = (e, g_rows, g_matrix, *hess)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(rows_times, (rows, matrix))
    assert torch.autograd.gradgradcheck(rows_times, (rows, matrix))


@pytest.mark.parametrize("use_topology", [True, False])
def test_forces_through_row_sums_equal_the_scatter(use_topology: bool) -> None:
    positions, layout = _layout(use_topology)
    weights = torch.randn(layout.capacity, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

    def energy(vectors: torch.Tensor) -> torch.Tensor:  # a smooth function of the vectors (padding edges: offset)
        vectors = vectors + layout.pad_offset
        return (torch.sin(vectors) * weights).sum() + vectors.square().sum(1).sqrt().sum()

    pos = positions.clone().requires_grad_()
    vectors = edge_differences(pos, layout.sender, layout.receiver, layout.graph)
    ref_pos = positions.clone().requires_grad_()
    ref = ref_pos.index_select(0, layout.receiver) - ref_pos.index_select(0, layout.sender)
    assert torch.equal(vectors, ref)
    grad, = torch.autograd.grad(energy(vectors), pos, create_graph=True)
    ref_grad, = torch.autograd.grad(energy(ref), ref_pos, create_graph=True)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-13, atol=1e-13)
    # second order too (a force-matching loss would need it)
    second, = torch.autograd.grad(grad.square().sum(), pos)
    ref_second, = torch.autograd.grad(ref_grad.square().sum(), ref_pos)
    torch.testing.assert_close(second, ref_second, rtol=1e-12, atol=1e-12)
    names = set()
    stack = [vectors.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None:
            names.add(type(node).__name__)
            stack.extend(child for child, _ in node.next_functions)
    assert "IndexSelectBackward0" not in names, "no scatter (atomics) in the forces' backward"


def test_without_a_graph_it_is_plain_autograd() -> None:
    positions, layout = _layout(True)
    pos = positions.clone().requires_grad_()
    vectors = edge_differences(pos, layout.sender, layout.receiver, None)
    assert type(vectors.grad_fn).__name__ == "SubBackward0"


@pytest.mark.cuda
@pytest.mark.parametrize("model", ["mace", "nequip"])
def test_cuda_energy_and_forces_are_bitwise_reproducible(model: str) -> None:
    """What is reproducible: energy and forces, bit for bit, for the same structure on the same GPU and software,
    in one calculator called again and in a second calculator (fixed-order edge sums, no atomics; the totals are
    plain sums of the per-atom energies)."""
    from cgforge.plugin import Calculator

    torch.set_default_dtype(torch.float32)
    atoms = water_box(216, seed=4)
    structures = [atoms.positions.copy(), atoms.positions + 0.01, atoms.positions - 0.02]
    runs = []
    for _ in range(2):
        calc = Calculator(model, device="cuda")
        a = atoms.copy()
        a.calc = calc
        run = []
        for positions in structures + structures[:1]:  # the last one again, after other structures
            a.positions = positions
            run.append((a.get_potential_energy(), a.get_forces().copy()))
            calc.results = {}  # the same structure computed again, not read from ASE's cache
            assert a.get_potential_energy() == run[-1][0] and np.array_equal(a.get_forces(), run[-1][1])
        runs.append(run)
    for (e1, f1), (e2, f2) in zip(*runs):
        assert e1 == e2 and np.array_equal(f1, f2)
    assert runs[0][0][0] == runs[0][-1][0] and np.array_equal(runs[0][0][1], runs[0][-1][1])
