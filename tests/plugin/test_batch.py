"""Batched evaluation (``plugin.batch``, ``runtime.batch``): many structures of different sizes, cells,
periodicities and species in one graph give each structure's own results, and a bad structure is named."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ase import Atoms
from ase.build import bulk, molecule

from cgforge.plugin import BatchStructureError, Calculator, evaluate_batch
from cgforge.plugin.batch import as_structure
from cgforge.plugin.runtime.batch import batch_neighbour_list
from cgforge.plugin.runtime.neighbours import neighbour_list
from cgforge.plugin.water import water_box


def batch_structures() -> list[Atoms]:
    """A periodic water box, a molecule without pbc, a skewed small cell, a slab-like cell (pbc in two
    directions) and a hydrogen molecule: mixed sizes, cells, periodicities and compositions."""
    box = water_box(8, seed=1)
    box.rattle(0.05, seed=2)
    free = molecule("H2O")
    free.positions += 30.0  # far from the origin, no cell
    skewed = water_box(2, seed=3)
    skewed.set_cell(np.asarray(skewed.cell) + [[0, 0, 0], [1.0, 0, 0], [0.5, 0.7, 0]], scale_atoms=True)
    slab = molecule("H2O", cell=[[6, 0, 0], [2, 5, 0], [1, 1, 7]], pbc=(True, False, True))
    slab.positions -= 3.0  # outside the cell: nothing needs wrapping by the caller
    hydrogen = molecule("H2")
    return [box, free, skewed, slab, hydrogen]


@pytest.fixture(scope="module")
def mace_calc():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield Calculator("mace", device="cpu", dtype="float64", warmup=False, skin=0.5)
    torch.set_default_dtype(previous)


@pytest.fixture(scope="module")
def mace_patched_calc(mace_calc):
    """cgforge's kernels on the CPU: the batch graph through the patched layers (pinned graph, species groups)."""
    return Calculator("mace", device="cpu", dtype="float64", patch=True, warmup=False, skin=0.5)


@pytest.fixture(scope="module")
def nequip_calc(nequip_state):
    from nequip_helpers import nequip_model

    return Calculator(nequip_model("float64"), device="cpu", warmup=False, skin=0.5)


def alone(calc: Calculator, atoms: Atoms) -> dict:
    atoms = atoms.copy()
    atoms.calc = calc
    out = {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces(),
           "energies": atoms.get_potential_energies()}
    out["stress"] = atoms.get_stress() if atoms.cell.volume > 0 else None
    return out


@pytest.mark.parametrize("kind", ["mace", "mace_patched", "nequip"])
def test_a_batch_gives_each_structure_its_own_results(kind, request) -> None:
    calc = request.getfixturevalue(f"{kind}_calc")
    structures = batch_structures()
    results = evaluate_batch(calc, structures, energies=True)
    assert len(results) == len(structures)
    for atoms, got in zip(structures, results, strict=True):
        want = alone(calc, atoms)
        scale = max(abs(want["energy"]), 1.0)
        assert got.energy == pytest.approx(want["energy"], rel=1e-10, abs=1e-10 * scale)
        force_scale = np.abs(want["forces"]).max()
        np.testing.assert_allclose(got.forces, want["forces"], rtol=1e-10, atol=1e-10 * force_scale)
        np.testing.assert_allclose(got.energies, want["energies"], rtol=1e-10, atol=1e-10 * scale)
        if want["stress"] is None:
            assert got.stress is None and got.virial is not None
        else:
            np.testing.assert_allclose(got.stress, want["stress"], rtol=1e-10,
                                       atol=1e-10 * np.abs(want["stress"]).max())
    # The structures really differ: a batch that mixed them up could not match every one.
    assert len({round(r.energy, 6) for r in results}) >= 4


def test_the_batch_search_finds_each_structures_own_pairs() -> None:
    tiny = bulk("Cu", "fcc", a=3.6)  # one atom in a cell thinner than the cutoff: its own images, several deep
    tiny.rattle(0.05, seed=1)
    structures = [*batch_structures(), tiny]
    positions = torch.tensor(np.concatenate([a.positions for a in structures]))
    cells = torch.tensor(np.stack([np.asarray(a.cell) for a in structures]))
    ptr = np.concatenate([[0], np.cumsum([len(a) for a in structures])])
    cutoff = 4.5
    sender, receiver, shifts = batch_neighbour_list(positions, cells, [tuple(a.pbc) for a in structures], ptr,
                                                    cutoff)
    assert bool((receiver[1:] >= receiver[:-1]).all())
    for b, atoms in enumerate(structures):
        mine = (receiver >= ptr[b]) & (receiver < ptr[b + 1])
        assert bool(((sender[mine] >= ptr[b]) & (sender[mine] < ptr[b + 1])).all()), "a pair joins two structures"
        alone_lists = neighbour_list(torch.tensor(atoms.positions), torch.tensor(np.asarray(atoms.cell)),
                                     tuple(atoms.pbc), cutoff)
        got = sorted(zip((sender[mine] - ptr[b]).tolist(), (receiver[mine] - ptr[b]).tolist(),
                         map(tuple, shifts[mine].tolist())))
        want = sorted(zip(alone_lists[0].tolist(), alone_lists[1].tolist(), map(tuple, alone_lists[2].tolist())))
        assert got == want and len(got) > 0


def test_only_new_or_moved_structures_are_searched_again(mace_calc) -> None:
    box, free, skewed = batch_structures()[:3]
    potential = mace_calc.potential
    potential.evaluate_batch([as_structure(a) for a in (box, free, skewed)], keys=["box", "free", "skewed"])
    nl = potential._batch_step.neighbours
    searched = nl.n_searched
    skewed.positions[0] += 0.1  # within skin / 2: its list stands, at its new place in the batch
    cluster = molecule("H2O")
    out = potential.evaluate_batch([as_structure(a) for a in (skewed, box, cluster)], keys=["skewed", "box", "new"])
    assert nl.n_searched == searched + 1  # the new one only; "free" left at no cost
    for atoms, got in zip((skewed, box, cluster), out, strict=True):
        want = alone(mace_calc, atoms)
        assert got.energy == pytest.approx(want["energy"], rel=1e-10, abs=1e-10)
        np.testing.assert_allclose(got.forces, want["forces"], atol=1e-10 * np.abs(want["forces"]).max())
    skewed.positions[0] += 0.2  # now 0.3 Å from where it was searched
    potential.evaluate_batch([as_structure(a) for a in (skewed, box)], keys=["skewed", "box"])
    assert nl.n_searched == searched + 2
    with pytest.raises(ValueError, match="keys: expected 2 distinct keys"):
        potential.evaluate_batch([as_structure(a) for a in (skewed, box)], keys=["x", "x"])


def test_a_few_new_lists_spliced_into_the_batch_equal_the_whole_list_joined_again() -> None:
    """Batched MD's case: the same batch, a few structures searched again; their lists are spliced into the last
    one (``BatchNeighbours._splice``), which must equal every kept list joined end to end (``_join``)."""
    from cgforge.plugin.runtime.batch import BatchNeighbours

    structures = batch_structures()
    positions = torch.tensor(np.concatenate([a.positions for a in structures]))
    cells = np.stack([np.asarray(a.cell) for a in structures])
    pbcs = [tuple(bool(p) for p in a.pbc) for a in structures]
    ptr = np.concatenate([[0], np.cumsum([len(a) for a in structures])]).tolist()
    nl = BatchNeighbours(4.0, 0.5)
    assert nl.update(positions, cells, pbcs, ptr) == len(structures)
    rng = np.random.default_rng(4)
    for stale in ([0], [2, 4], [1, 3]):  # atoms of these structures moved past skin/2, the others a little
        for b in range(len(structures)):
            step = 0.3 if b in stale else 0.02
            positions[ptr[b]:ptr[b + 1]] += torch.tensor(rng.uniform(-step, step, (ptr[b + 1] - ptr[b], 3)))
        for b in stale:
            positions[ptr[b]] += torch.tensor([0.3, 0.0, 0.0])  # one atom past skin / 2 for certain
        assert nl.update(positions, cells, pbcs, ptr) == len(stale)
        joined = nl._join(nl._order, ptr)
        for got, want in zip((nl.sender, nl.receiver, nl.shifts, nl.built_at()), joined, strict=True):
            assert torch.equal(got, want)
    searched = nl.n_searched
    assert nl.update(positions, cells, pbcs, ptr, search={3}) == 1 and nl.n_searched == searched + 1
    assert all(torch.equal(a, b) for a, b in zip((nl.sender, nl.receiver, nl.shifts), nl._join(nl._order, ptr)))


def _bad(kind: str) -> Atoms:
    atoms = molecule("H2O")
    if kind == "unknown element":
        atoms.numbers[0] = 29
    elif kind == "NaN":
        atoms.positions[1, 2] = np.nan
    elif kind == "overlap":
        atoms.positions[2] = atoms.positions[1] + 0.1
    elif kind == "singular cell":
        atoms.cell, atoms.pbc = [[4, 0, 0], [8, 0, 0], [0, 0, 4]], True
    elif kind == "NaN cell":
        atoms.cell, atoms.pbc = [[4, 0, 0], [0, np.nan, 0], [0, 0, 4]], True
    return atoms


@pytest.mark.parametrize(("kind", "message"), [("unknown element", "structure 2: .*Cu"),
                                               ("NaN", "structure 2: positions contain NaN .*atoms \\[1\\]"),
                                               ("overlap", "structure 2: atoms 1 and 2 are 0.173 Å apart"),
                                               ("empty", "structure 2: expected a structure with at least one"),
                                               ("singular cell", "structure 2: cell is singular"),
                                               ("NaN cell", "structure 2: cell contains NaN")])
def test_a_bad_structure_is_named_by_its_index(mace_calc, kind, message) -> None:
    structures = batch_structures()[:2] + [Atoms() if kind == "empty" else _bad(kind)]
    with pytest.raises(BatchStructureError, match=message) as info:
        evaluate_batch(mace_calc, structures)
    assert info.value.index == 2
    evaluate_batch(mace_calc, structures[:2])  # the potential still works


@pytest.mark.cuda
@pytest.mark.parametrize("patch", [False, True])
def test_a_batch_on_cuda_gives_each_structure_its_own_results(patch) -> None:
    calc = Calculator("mace", device="cuda", dtype="float64", patch=patch, skin=0.5)
    structures = batch_structures() * 3
    results = evaluate_batch(calc, structures)
    for atoms, got in zip(structures, results, strict=True):
        want = alone(calc, atoms)
        assert got.energy == pytest.approx(want["energy"], rel=1e-10, abs=1e-10)
        np.testing.assert_allclose(got.forces, want["forces"], rtol=1e-10, atol=1e-10 * np.abs(want["forces"]).max())
