"""The fixed-workspace evaluation (``cgforge.plugin.runtime.tiled``) against the whole-graph evaluation.

The tiles' energy is the sum of their owned atoms' energies, each computed on a cluster of the tile and its halo,
so it equals the whole system's energy, and its derivatives (forces, virial) equal the whole system's, for any
grid: tiles smaller than the receptive field (hops x cutoff) included, periodic, slab and cluster boxes. FP64
models, fresh random weights.
"""

from __future__ import annotations

import ase.build
import mace_helpers
import numpy as np
import pytest
import torch
from potentials import mace_potential, nequip_potential

from cgforge.patches.mace.patch import SUPPORTED_INTERACTIONS
from cgforge.plugin import Calculator
from cgforge.plugin.runtime import potential as runtime
from cgforge.plugin.runtime.neighbours import neighbour_list
from cgforge.plugin.runtime.options import RuntimeOptions
from cgforge.plugin.runtime.tiled import (
    Frame,
    TiledEvaluation,
    Workspace,
    check_workspace,
    plan_grid,
    sampled_edges_per_atom,
    tiles_needed,
)
from cgforge.plugin.water import water_box

PBCS = [(True, True, True), (True, False, True), (False, False, False)]


@pytest.fixture(scope="module")
def mace_model():
    torch.manual_seed(0)
    return mace_potential(num_interactions=2).model


@pytest.fixture(scope="module")
def nequip_model():
    return nequip_potential(l_max=1, num_layers=2).model


def _water(pbc: tuple[bool, bool, bool], n_side: int = 3, seed: int = 3):
    atoms = water_box(n_side=n_side, seed=seed)
    atoms.rattle(0.05, seed=seed)
    atoms.pbc = pbc
    return atoms


def _metal(pbc: tuple[bool, bool, bool], seed: int = 4):
    atoms = ase.build.bulk("Cu", "fcc", a=3.61, orthorhombic=True).repeat((3, 3, 2))
    atoms.numbers[::5] = 47
    atoms.rattle(0.08, seed=seed)
    atoms.pbc = pbc
    return atoms


def _whole(pot: runtime.Potential, atoms) -> runtime.Evaluation:
    system = pot.system(atoms.numbers, atoms.positions, atoms.cell.array, tuple(atoms.pbc))
    return pot.evaluate(atoms.positions, atoms.cell.array, tuple(atoms.pbc), system, forces=True, stress=True,
                        per_atom=True)


def _tiled(pot: runtime.Potential, atoms, tile_atoms: int) -> tuple[np.ndarray, TiledEvaluation]:
    pbc = tuple(bool(p) for p in atoms.pbc)
    system = pot.system(atoms.numbers, atoms.positions, atoms.cell.array, pbc)
    tiles = TiledEvaluation(pot.adapter)
    positions = torch.as_tensor(atoms.positions, dtype=torch.float64)
    frame = Frame.of(positions, atoms.cell.array, pbc)
    grid = plan_grid(frame, len(atoms), tiles.hops, tiles.cutoff, tile_atoms=tile_atoms)
    host = tiles.run(positions, atoms.cell.array, system.species, grid, frame, forces=True, stress=True,
                     per_atom=True)
    assert tiles.n_tiles == grid.n_tiles
    return host, tiles


def _split(host: np.ndarray, n: int) -> tuple[float, np.ndarray, np.ndarray, np.ndarray]:
    return host[0], host[1:1 + 3 * n].reshape(n, 3), host[1 + 3 * n:10 + 3 * n].reshape(3, 3), host[10 + 3 * n:]


def _assert_same(host: np.ndarray, ref: runtime.Evaluation, n: int, tol: float = 1e-12) -> None:
    energy, forces, virial, energies = _split(host, n)
    scale_f = np.abs(ref.forces).max()
    assert abs(energy - ref.energy) <= tol * max(1.0, abs(ref.energy))
    np.testing.assert_allclose(forces, ref.forces, rtol=0, atol=tol * 10 * scale_f)
    np.testing.assert_allclose(virial, ref.virial, rtol=0, atol=tol * 10 * np.abs(ref.virial).max())
    np.testing.assert_allclose(energies, ref.energies, rtol=0, atol=tol * 10 * np.abs(ref.energies).max())


@pytest.mark.parametrize("patch", [False, True], ids=["plain", "patched"])
@pytest.mark.parametrize("pbc", PBCS, ids=["periodic", "slab", "cluster"])
def test_mace_tiles_equal_whole(mace_model, fp64_one_thread, patch, pbc):
    pot = runtime.load(mace_model, "cpu", patch=patch, warmup=False)
    atoms = _water(pbc)
    ref = _whole(pot, atoms)
    for tile_atoms in (40, 9):  # 9: tiles far smaller than the receptive field (2 x r_max)
        host, tiles = _tiled(pot, atoms, tile_atoms)
        assert tiles.n_tiles > 1
        _assert_same(host, ref, len(atoms))


@pytest.mark.slow  # 6-16 s a block on 2 cores
@pytest.mark.parametrize("interaction", SUPPORTED_INTERACTIONS)
def test_every_supported_mace_block_in_three_layers(fp64_one_thread, interaction):
    """hops = 3 layers: the halo and the pruning reach three cutoffs; each block kind MACE's patch supports."""
    model = mace_helpers.build_model(interaction=interaction, num_interactions=3)
    pot = runtime.load(model, "cpu", patch=False, warmup=False)
    assert pot.adapter.hops == 3
    atoms = _water((True, True, True))
    host, tiles = _tiled(pot, atoms, 20)
    assert tiles.n_tiles > 1
    _assert_same(host, _whole(pot, atoms), len(atoms), tol=1e-11)


@pytest.mark.parametrize("pbc", PBCS, ids=["periodic", "slab", "cluster"])
def test_nequip_tiles_equal_whole(nequip_model, fp64_one_thread, pbc):
    pot = runtime.load(nequip_model, "cpu", patch=True, warmup=False)
    assert pot.adapter.hops == 2
    atoms = _metal(pbc)
    ref = _whole(pot, atoms)
    host, tiles = _tiled(pot, atoms, 12)
    assert tiles.n_tiles >= 3
    _assert_same(host, ref, len(atoms))


def test_result_does_not_depend_on_the_grid(mace_model, fp64_one_thread):
    pot = runtime.load(mace_model, "cpu", patch=False, warmup=False)
    atoms = _water((True, True, True), n_side=4)
    results = [_tiled(pot, atoms, t)[0] for t in (1000, 50, 20)]
    for host in results[1:]:
        np.testing.assert_allclose(host, results[0], rtol=1e-12, atol=1e-12)


@pytest.mark.slow
def test_tiled_forces_are_minus_the_energy_gradient(mace_model, fp64_one_thread):
    pot = runtime.load(mace_model, "cpu", patch=False, warmup=False)
    atoms = _water((True, True, True))
    n, h = len(atoms), 1e-5
    host, _ = _tiled(pot, atoms, 15)
    forces = _split(host, n)[1]
    for atom, axis in ((0, 0), (7, 2), (40, 1)):
        energies = []
        for sign in (1, -1):
            moved = atoms.copy()
            moved.positions[atom, axis] += sign * h
            energies.append(_tiled(pot, moved, 15)[0][0])
        assert abs(-(energies[0] - energies[1]) / (2 * h) - forces[atom, axis]) < 1e-7 * max(1.0, abs(forces).max())


def test_potential_workspace_tiled_equals_whole(mace_model, fp64_one_thread):
    """Through ``Potential.evaluate`` (atom order, species, results in the order given)."""
    atoms = _water((True, True, True))
    whole = runtime.load(mace_model, "cpu", patch=False, warmup=False, workspace="whole")
    tiled = runtime.load(mace_model, "cpu", patch=False, warmup=False, workspace="tiled",
                         options=RuntimeOptions(tile_atoms=20, order_above_atoms=0))
    ref = _whole(whole, atoms)
    got = _whole(tiled, atoms)
    assert tiled.workspace.grid.n_tiles > 1
    assert tiled.n_edges > whole.n_edges  # halo receivers are evaluated again by the tiles beside them
    assert abs(got.energy - ref.energy) < 1e-12 * abs(ref.energy)
    np.testing.assert_allclose(got.forces, ref.forces, rtol=0, atol=1e-12)
    np.testing.assert_allclose(got.virial, ref.virial, rtol=0, atol=1e-11)
    np.testing.assert_allclose(got.energies, ref.energies, rtol=0, atol=1e-12)


def test_plan_grid_meets_its_bounds():
    rng = np.random.default_rng(0)
    cell = np.diag([60.0, 30.0, 30.0])
    positions = torch.as_tensor(rng.uniform(0, 1, (5400, 3)) @ cell)
    frame = Frame.of(positions, cell, (True, True, True))
    grid = plan_grid(frame, 5400, 2, 5.0, tile_atoms=1000)
    assert 5400 / grid.n_tiles <= 1000
    assert grid.counts[0] >= grid.counts[1]  # split where the tiles are thickest first
    assert grid.halo >= 10.0
    per_atom = 0.1 * 4 / 3 * np.pi * 5.0**3  # the uniform density (0.1 / Å^3) times the cutoff sphere
    one = plan_grid(frame, 5400, 2, 5.0, budget_bytes=10**12, edge_bytes=1000, edges_per_atom=per_atom)
    assert one.n_tiles == 1
    budgeted = plan_grid(frame, 5400, 2, 5.0, budget_bytes=2 * 10**8, edge_bytes=1000, edges_per_atom=per_atom)
    assert budgeted.n_tiles > 1
    with pytest.raises(MemoryError, match="halo alone does not fit"):
        plan_grid(frame, 5400, 2, 5.0, budget_bytes=10**5, edge_bytes=1000, edges_per_atom=per_atom)
    with pytest.raises(ValueError, match="edges_per_atom"):
        plan_grid(frame, 5400, 2, 5.0, budget_bytes=10**5, edge_bytes=1000)
    with pytest.raises(ValueError, match="tile_atoms"):
        plan_grid(frame, 5400, 2, 5.0, tile_atoms=0)


def test_auto_picks_tiles_only_where_the_whole_graph_would_not_fit():
    assert not tiles_needed(6400, 52.0, edge_bytes=1000, free_bytes=10**9, fraction=0.9)
    assert tiles_needed(6400, 52.0, edge_bytes=1000, free_bytes=10**8, fraction=0.9)


@pytest.mark.parametrize("pbc", PBCS, ids=["periodic", "slab", "cluster"])
def test_sampled_edges_per_atom_counts_the_systems_own_neighbours(pbc):
    atoms = _water(pbc, n_side=8)  # 1536 atoms
    cutoff = 4.0
    positions = torch.as_tensor(atoms.positions)
    frame = Frame.of(positions, atoms.cell.array, pbc)
    cell = torch.as_tensor(atoms.cell.array)
    wrapped = positions + frame.image.to(positions.dtype) @ cell
    sampled = sampled_edges_per_atom(frame, wrapped, cell, cutoff, torch.float64, sample_atoms=300)
    exact = neighbour_list(positions, cell, pbc, cutoff)[0].shape[0] / len(atoms)
    if all(pbc):
        assert abs(sampled - exact) < 0.15 * exact  # one tile of a uniform liquid: its mean, within sampling noise
    else:
        assert 0.7 * exact < sampled < 1.6 * exact  # the fullest tile of a slab or cluster: its inside, denser


def test_workspace_values_are_checked(mace_model, tmp_path):
    assert check_workspace("tiled") == "tiled"
    with pytest.raises(ValueError, match="workspace: expected one of"):
        check_workspace("fixed-ish")
    with pytest.raises(ValueError, match="workspace"):
        runtime.load(mace_model, "cpu", patch=False, warmup=False, workspace="huge")
    # checked before any model loads: a missing file would otherwise be the error
    for make in (runtime.load, Calculator):
        with pytest.raises(ValueError, match="workspace: expected one of"):
            make(str(tmp_path / "missing.model"), "cpu", workspace="huge")
    pot = runtime.load(mace_model, "cpu", patch=False, warmup=False)
    assert isinstance(pot.workspace, Workspace) and pot.workspace.mode == "auto"
    atoms = _water((True, True, True))
    assert not pot.workspace.uses_tiles(atoms.positions, atoms.cell.array, (True, True, True))  # CPU: whole
    with pytest.raises(ValueError, match="tile_atoms"):
        RuntimeOptions(tile_atoms=0)
    with pytest.raises(ValueError, match="tile_memory_fraction"):
        RuntimeOptions(tile_memory_fraction=1.5)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cuda_tiles_equal_whole_and_repeat_bitwise(dtype):
    model = mace_potential(num_interactions=2).model.to(dtype)
    whole = runtime.load(model, "cuda", warmup=False, workspace="whole")
    atoms = _water((True, True, True), n_side=4)
    ref = _whole(whole, atoms)
    tiled = runtime.load(model, "cuda", warmup=False, workspace="tiled", options=RuntimeOptions(tile_atoms=30))
    first, second = _whole(tiled, atoms), _whole(tiled, atoms)
    assert tiled.workspace.grid.n_tiles > 1
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    assert abs(first.energy - ref.energy) <= tol * abs(ref.energy)
    np.testing.assert_allclose(first.forces, ref.forces, rtol=0, atol=tol * 10 * np.abs(ref.forces).max())
    np.testing.assert_allclose(first.virial, ref.virial, rtol=0, atol=tol * 10 * np.abs(ref.virial).max())
    assert first.energy == second.energy
    assert np.array_equal(first.forces, second.forces) and np.array_equal(first.virial, second.virial)
