"""cgforge.plugin.runtime.neighbours against matscipy's neighbour_list("ijS"), and brute force beyond matscipy."""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest
import torch
from ase import Atoms

from cgforge.kernels.edge_layout import edges_within
from cgforge.plugin.runtime.neighbours import VerletNeighbourList, neighbour_list
from cgforge.plugin.water import water_box

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def matscipy_edges(atoms: Atoms, cutoff: float) -> np.ndarray:
    from matscipy.neighbours import neighbour_list as matscipy_list

    i, j, shifts = matscipy_list("ijS", atoms, cutoff)
    return _canonical(i, j, shifts)


def ours(atoms: Atoms, cutoff: float, dtype=torch.float64, cell=None, **kwargs):
    cell = atoms.cell.array if cell is None else cell
    return neighbour_list(torch.tensor(atoms.positions, dtype=dtype), torch.tensor(cell, dtype=dtype),
                          tuple(atoms.pbc), cutoff, **kwargs)


def _canonical(i, j, shifts) -> np.ndarray:
    """Rows (i, j, S0, S1, S2) sorted lexicographically: equal arrays <=> equal sets (no duplicates)."""
    rows = np.column_stack([np.asarray(i), np.asarray(j), np.asarray(shifts).reshape(-1, 3)]).astype(np.int64)
    return rows[np.lexsort(rows.T[::-1])]


def our_edges(atoms: Atoms, cutoff: float, **kwargs) -> np.ndarray:
    sender, receiver, shifts = ours(atoms, cutoff, **kwargs)[:3]
    return _canonical(sender.numpy(), receiver.numpy(), shifts.numpy())


def brute_force_edges(positions: np.ndarray, cell: np.ndarray, pbc, cutoff: float, reach: int) -> np.ndarray:
    """Every pair and every image within `reach` cells per periodic direction, checked directly."""
    ranges = [range(-reach, reach + 1) if p else range(1) for p in pbc]
    rows = []
    for shift in itertools.product(*ranges):
        vectors = positions[None, :, :] - positions[:, None, :] + np.asarray(shift) @ cell
        i, j = np.nonzero(np.linalg.norm(vectors, axis=-1) < cutoff)
        keep = (i != j) | (np.asarray(shift) != 0).any()
        rows.append(np.column_stack([i[keep], j[keep], np.tile(shift, (keep.sum(), 1))]))
    return _canonical(*np.split(np.concatenate(rows), [1, 2], axis=1))


def assert_same_edges(got: np.ndarray, expected: np.ndarray) -> None:
    assert len(np.unique(got, axis=0)) == len(got), "duplicate edges"
    assert got.shape == expected.shape, f"{len(got)} edges, expected {len(expected)}"
    np.testing.assert_array_equal(got, expected)


def random_atoms(n, cell, pbc, seed, low=0.0, high=1.0) -> Atoms:
    rng = np.random.default_rng(seed)
    cell = np.asarray(cell, dtype=float)
    cell = np.diag(cell) if cell.ndim == 1 else cell
    fractional = rng.uniform(low, high, (n, 3))
    return Atoms(f"H{n}", positions=fractional @ cell, cell=cell, pbc=pbc)


SKEWED = [[6.0, 0.0, 0.0], [2.5, 5.5, 0.0], [-1.8, 1.2, 6.3]]
VERY_SKEWED = [[4.0, 0.0, 0.0], [3.6, 1.9, 0.0], [3.1, 1.2, 2.2]]


@pytest.mark.parametrize(
    "n, cell, cutoff, seed",
    [
        (60, [10.0, 11.0, 12.0], 3.0, 0),  # several bins per direction
        (200, [14.0, 9.0, 20.0], 4.5, 1),
        (40, [7.0, 7.0, 7.0], 5.0, 2),  # cell < 2 cutoff: one bin, images on both sides
        (30, SKEWED, 3.5, 3),
        (30, VERY_SKEWED, 3.0, 4),
    ],
)
def test_periodic_matches_matscipy(n, cell, cutoff, seed):
    atoms = random_atoms(n, cell, True, seed)
    assert_same_edges(our_edges(atoms, cutoff), matscipy_edges(atoms, cutoff))


@pytest.mark.parametrize("cell", [[1.5, 2.0, 1.7], SKEWED, VERY_SKEWED])
def test_cells_smaller_than_cutoff_give_many_images(cell):
    atoms = random_atoms(4, np.asarray(cell) * (0.35 if len(np.shape(cell)) == 2 else 1.0), True, 5)
    cutoff = 4.0
    expected = matscipy_edges(atoms, cutoff)
    assert np.abs(expected[:, 2:]).max() >= 2  # really several images per direction
    assert (expected[:, 0] == expected[:, 1]).any()  # and self-images
    assert_same_edges(our_edges(atoms, cutoff), expected)


def test_single_atom_sees_only_its_images():
    atoms = Atoms("H", positions=[[0.3, 0.2, 0.1]], cell=[1.0, 1.3, 1.6], pbc=True)
    got = our_edges(atoms, 2.5)
    assert_same_edges(got, matscipy_edges(atoms, 2.5))
    assert (got[:, :2] == 0).all() and len(got) > 20


@pytest.mark.parametrize("pbc", [(True, False, True), (False, True, False), (False, False, True)])
def test_mixed_pbc_with_atoms_outside_the_cell(pbc):
    # Atoms spread far beyond the cell, in periodic and non-periodic directions alike.
    atoms = random_atoms(50, SKEWED, pbc, 6, low=-1.5, high=2.5)
    assert_same_edges(our_edges(atoms, 3.2), matscipy_edges(atoms, 3.2))


def test_no_pbc_matches_matscipy_and_ignores_the_cell():
    atoms = random_atoms(80, [9.0, 8.0, 10.0], False, 7, low=-0.5, high=1.5)
    expected = matscipy_edges(atoms, 3.0)
    assert_same_edges(our_edges(atoms, 3.0), expected)
    # Non-periodic: the cell plays no part, and may be zero (matscipy can't take that).
    assert_same_edges(our_edges(atoms, 3.0, cell=np.zeros((3, 3))), expected)
    assert_same_edges(brute_force_edges(atoms.positions, atoms.cell.array, (False,) * 3, 3.0, 0), expected)


def test_non_periodic_cell_vectors_may_be_degenerate():
    # A periodic chain along x: the y and z cell vectors are zero, binning must not need them.
    atoms = random_atoms(25, [3.0, 8.0, 8.0], (True, False, False), 8)
    cell = np.diag([3.0, 0.0, 0.0])
    expected = brute_force_edges(atoms.positions, cell, (True, False, False), 4.0, reach=3)
    assert_same_edges(our_edges(atoms, 4.0, cell=cell), expected)
    assert_same_edges(expected, matscipy_edges(atoms, 4.0))


def test_isolated_and_empty_systems():
    far = Atoms("H3", positions=[[0, 0, 0], [50, 0, 0], [0, -70, 1e4]], cell=np.zeros((3, 3)), pbc=False)
    assert len(our_edges(far, 5.0)) == 0
    empty = Atoms(cell=[5.0, 5.0, 5.0], pbc=True)
    sender, receiver, shifts = ours(empty, 3.0)
    assert sender.shape == receiver.shape == (0,) and shifts.shape == (0, 3)
    one = Atoms("H", positions=[[1.0, 2.0, 3.0]], pbc=False)
    assert len(our_edges(one, 3.0)) == 0
    big_cell = Atoms("H", positions=[[1.0, 2.0, 3.0]], cell=[10.0, 10.0, 10.0], pbc=True)
    assert len(our_edges(big_cell, 3.0)) == 0
    # A few pairs inside a huge, mostly empty periodic box (bins coarsened to keep memory O(N)).
    sparse = Atoms("H4", positions=[[0, 0, 0], [1.0, 0, 0], [500, 500, 500], [500, 501.5, 500]],
                   cell=[1000.0, 1000.0, 1000.0], pbc=True)
    assert_same_edges(our_edges(sparse, 2.0), matscipy_edges(sparse, 2.0))


def test_water_box_graph_and_edge_order():
    atoms = water_box(n_side=12)
    sender, receiver, shifts, vectors, lengths = ours(atoms, 6.0, return_vectors=True)
    assert len(sender) == 436_566
    assert sender.dtype == receiver.dtype == shifts.dtype == torch.int64
    got = _canonical(sender.numpy(), receiver.numpy(), shifts.numpy())
    assert_same_edges(got, matscipy_edges(atoms, 6.0))
    # Sorted by (receiver, sender): CSR order for the convolution.
    key = receiver * len(atoms) + sender
    assert bool((key[1:] >= key[:-1]).all())
    positions, cell = torch.tensor(atoms.positions), torch.tensor(atoms.cell.array)
    expected = positions[receiver] - positions[sender] + shifts.double() @ cell
    torch.testing.assert_close(vectors, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(lengths, expected.norm(dim=-1), rtol=0, atol=1e-12)
    assert float(lengths.max()) < 6.0


def test_chunked_search_is_identical():
    atoms = random_atoms(150, SKEWED, (True, True, False), 9, low=-0.5, high=1.5)
    whole = ours(atoms, 3.0)
    for chunk in (1, 37, 1000):
        for a, b in zip(whole, ours(atoms, 3.0, candidates_per_chunk=chunk), strict=True):
            assert torch.equal(a, b)


def test_float32_and_vectors_match_matscipy_distances():
    from matscipy.neighbours import neighbour_list as matscipy_list

    atoms = random_atoms(100, SKEWED, True, 10, low=-1.0, high=2.0)
    i, j, shifts, distances = matscipy_list("ijSd", atoms, 3.3)
    sender, receiver, our_shifts, _, lengths = ours(atoms, 3.3, dtype=torch.float32, return_vectors=True)
    got = _canonical(sender.numpy(), receiver.numpy(), our_shifts.numpy())
    assert_same_edges(got, _canonical(i, j, shifts))
    assert lengths.dtype == torch.float32
    np.testing.assert_allclose(np.sort(lengths.numpy()), np.sort(distances), rtol=0, atol=1e-5)


def test_vectors_are_differentiable():
    atoms = random_atoms(20, SKEWED, True, 11)
    positions = torch.tensor(atoms.positions, requires_grad=True)
    cell = torch.tensor(atoms.cell.array, requires_grad=True)
    *_, lengths = neighbour_list(positions, cell, (True, True, True), 3.0, return_vectors=True)
    lengths.sum().backward()
    assert positions.grad is not None and cell.grad is not None
    assert float(positions.grad.sum(0).abs().max()) < 1e-10  # pair forces cancel
    assert float(cell.grad.abs().max()) > 0


def _f64(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(positions=_f64([[0.0, 0.0, float("nan")], [1.0, 1.0, 1.0]])), "NaN or inf"),
        (dict(positions=_f64([[0.0, 0.0, float("inf")], [1.0, 1.0, 1.0]])), "NaN or inf"),
        (dict(cutoff=0.0), "cutoff"),
        (dict(cutoff=-1.0), "cutoff"),
        (dict(cutoff=float("nan")), "cutoff"),
        (dict(cell=torch.zeros(3, 3, dtype=torch.float64)), "singular"),
        (dict(cell=_f64([[2.0, 0, 0], [4.0, 0, 0], [0, 0, 2.0]])), "singular"),
        (dict(cell=_f64([[2.0, 0, 0], [0, 2.0, 0], [0, 0, float("nan")]])), "cell contains NaN"),
        (dict(positions=torch.zeros(3, 2, dtype=torch.float64)), r"shape \[N, 3\]"),
        (dict(cell=_f64(np.eye(3)[:2])), r"shape \[3, 3\]"),
        (dict(cell=torch.eye(3, dtype=torch.float32)), "dtype"),
        (dict(positions=torch.zeros(2, 3, dtype=torch.int64)), "float32 or float64"),
        (dict(cell=torch.eye(3, device="meta", dtype=torch.float64)), "on meta"),
        (dict(pbc=(True, False)), "pbc"),
    ],
)
def test_bad_inputs_raise(change, message):
    arguments = dict(positions=_f64([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]), cell=_f64(np.eye(3) * 5.0),
                     pbc=(True, True, True), cutoff=2.0)
    arguments.update(change)
    with pytest.raises(ValueError, match=message):
        neighbour_list(**arguments)


def test_non_tensor_inputs_raise_type_error():
    with pytest.raises(TypeError, match="positions"):
        neighbour_list(np.zeros((2, 3)), torch.eye(3, dtype=torch.float64), True, 2.0)


def test_singular_cell_is_fine_without_pbc_in_the_degenerate_direction():
    positions = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 1.0]], dtype=torch.float64)
    cell = torch.tensor([[3.0, 0, 0], [0, 3.0, 0], [0, 0, 0.0]], dtype=torch.float64)
    sender, _, shifts = neighbour_list(positions, cell, (True, True, False), 1.5)
    assert len(sender) == 2 and (shifts == 0).all()


class TestVerlet:
    cutoff, skin = 3.0, 0.6

    def _atoms(self):
        return random_atoms(120, SKEWED, (True, False, True), 12, low=-0.2, high=1.2)

    def _masked(self, verlet, atoms):
        positions, cell = torch.tensor(atoms.positions), torch.tensor(atoms.cell.array)
        _, lengths, mask = verlet.edges(positions, cell)
        assert torch.equal(mask, lengths < self.cutoff)
        return _canonical(*(edge[mask].numpy() for edge in (verlet.sender, verlet.receiver, verlet.shifts)))

    def _update(self, verlet, atoms):
        return verlet.update(torch.tensor(atoms.positions), torch.tensor(atoms.cell.array), tuple(atoms.pbc))

    def test_reuse_after_small_moves_and_rebuild_after_large(self):
        atoms = self._atoms()
        verlet = VerletNeighbourList(self.cutoff, self.skin)
        assert self._update(verlet, atoms) and verlet.n_builds == 1
        assert len(verlet.sender) > len(matscipy_edges(atoms, self.cutoff))  # built at cutoff + skin
        rng = np.random.default_rng(13)
        for _ in range(3):
            step = rng.normal(size=atoms.positions.shape)
            step *= 0.099 * self.skin / np.linalg.norm(step, axis=1).max()  # total < skin / 2 after 3 steps
            atoms.positions += step
            assert not self._update(verlet, atoms)
            assert_same_edges(self._masked(verlet, atoms), matscipy_edges(atoms, self.cutoff))
        assert verlet.n_builds == 1
        atoms.positions[7] += [0.0, 0.0, 0.6 * self.skin]  # one atom beyond skin / 2
        assert self._update(verlet, atoms) and verlet.n_builds == 2
        assert_same_edges(self._masked(verlet, atoms), matscipy_edges(atoms, self.cutoff))

    def test_rebuilds_on_cell_pbc_and_size_changes(self):
        atoms = self._atoms()
        verlet = VerletNeighbourList(self.cutoff, self.skin)
        self._update(verlet, atoms)
        assert not self._update(verlet, atoms)
        atoms.set_cell(atoms.cell.array * 1.001, scale_atoms=False)
        assert self._update(verlet, atoms)
        atoms.pbc = True
        assert self._update(verlet, atoms)
        assert_same_edges(self._masked(verlet, atoms), matscipy_edges(atoms, self.cutoff))
        del atoms[-1]
        assert self._update(verlet, atoms)
        assert verlet.n_builds == 4

    def test_nan_positions_raise(self):
        atoms = self._atoms()
        verlet = VerletNeighbourList(self.cutoff, self.skin)
        self._update(verlet, atoms)
        atoms.positions[3, 1] = np.nan
        with pytest.raises(ValueError, match="NaN"):
            self._update(verlet, atoms)

    def test_bad_arguments(self):
        with pytest.raises(ValueError, match="skin"):
            VerletNeighbourList(3.0, skin=-0.1)
        with pytest.raises(ValueError, match="cutoff"):
            VerletNeighbourList(0.0)
        with pytest.raises(RuntimeError, match="before update"):
            VerletNeighbourList(3.0).edges(torch.zeros(1, 3), torch.eye(3))


def test_edges_within_masks_by_true_cutoff():
    atoms = random_atoms(40, [8.0, 8.0, 8.0], True, 14)
    sender, receiver, shifts = ours(atoms, 3.5)
    positions, cell = torch.tensor(atoms.positions), torch.tensor(atoms.cell.array)
    vectors, lengths, mask = edges_within(positions, cell, sender, receiver, shifts, 2.5)
    inner = _canonical(sender[mask].numpy(), receiver[mask].numpy(), shifts[mask].numpy())
    assert_same_edges(inner, matscipy_edges(atoms, 2.5))
    assert 0 < int(mask.sum()) < len(mask)


@pytest.mark.cuda
@CUDA
def test_cuda_matches_cpu():
    atoms = random_atoms(3000, [30.0, 31.0, 29.0], (True, True, False), 15, low=-0.1, high=1.1)
    for dtype in (torch.float64, torch.float32):
        positions = torch.tensor(atoms.positions, dtype=dtype)
        cell = torch.tensor(atoms.cell.array, dtype=dtype)
        cpu = neighbour_list(positions, cell, tuple(atoms.pbc), 5.0)
        gpu = neighbour_list(positions.cuda(), cell.cuda(), tuple(atoms.pbc), 5.0)
        for a, b in zip(cpu, gpu, strict=True):
            assert b.is_cuda and torch.equal(a, b.cpu())


@pytest.mark.cuda
@CUDA
def test_cuda_verlet_check_syncs_once():
    atoms = random_atoms(2000, [25.0, 25.0, 25.0], True, 16)
    positions = torch.tensor(atoms.positions, device="cuda")
    cell = torch.tensor(atoms.cell.array, device="cuda")
    verlet = VerletNeighbourList(4.0, 0.5)
    verlet.update(positions, cell, (True, True, True))
    moved = positions + 0.01
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rebuilt = verlet.update(moved, cell, (True, True, True))
            verlet.edges(moved, cell)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not rebuilt
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    assert len(syncs) == 1, [str(w.message) for w in syncs]
