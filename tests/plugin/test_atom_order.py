"""The spatial order large systems run in: a permutation that keeps neighbours together, and a calculator whose
results (energy, forces, stress, per-atom energies, in the user's order) do not depend on it."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from mace_helpers import build_model, rel_err  # noqa: E402

from cgforge.plugin import Calculator  # noqa: E402
from cgforge.plugin.runtime import atom_order  # noqa: E402
from cgforge.plugin.runtime.options import RuntimeOptions  # noqa: E402
from cgforge.plugin.water import water_box  # noqa: E402


def _median_step(positions: np.ndarray, order: np.ndarray) -> float:
    return float(np.median(np.linalg.norm(np.diff(positions[order], axis=0), axis=1)))


def test_morton_order_is_a_permutation_that_keeps_neighbours_close() -> None:
    rng = np.random.default_rng(0)
    atoms = water_box(n_side=6)
    shuffled = rng.permutation(len(atoms))
    positions = atoms.positions[shuffled]
    order = atom_order.morton_order(positions, np.asarray(atoms.cell), (True, True, True))
    assert sorted(order.tolist()) == list(range(len(atoms)))
    # consecutive atoms along the curve are several times closer than in the shuffled order (median step)
    assert _median_step(positions, order) < 0.3 * _median_step(positions, np.arange(len(atoms)))
    # periodic: whole-cell shifts of some atoms do not change the order; open axes scale to the occupied range
    shifted = positions + np.outer(rng.integers(-2, 3, len(atoms)), np.asarray(atoms.cell)[0])
    np.testing.assert_array_equal(atom_order.morton_order(shifted, np.asarray(atoms.cell), (True, True, True)),
                                  order)
    free = atom_order.morton_order(positions, np.zeros((3, 3)), (False, False, False))
    assert sorted(free.tolist()) == list(range(len(atoms)))
    assert _median_step(positions, free) < 0.3 * _median_step(positions, np.arange(len(atoms)))


def test_spatial_order_only_above_the_threshold() -> None:
    atoms = water_box(n_side=3)
    args = (atoms.positions, np.asarray(atoms.cell), (True, True, True))
    assert atom_order.spatial_order(*args, len(atoms)) is None
    assert atom_order.spatial_order(*args, len(atoms) - 1) is not None
    bad = atoms.positions.copy()
    bad[3, 1] = np.nan
    assert atom_order.spatial_order(bad, *args[1:], 0) is None  # the potential names the NaN itself
    assert atom_order.spatial_order(*args, None) is None
    assert RuntimeOptions().order_above_atoms == 100_000


def test_to_user_order_puts_per_atom_parts_back() -> None:
    rng = np.random.default_rng(1)
    n, order = 7, rng.permutation(7)
    forces, stress, energies = rng.normal(size=(n, 3)), rng.normal(size=9), rng.normal(size=n)
    host = np.concatenate([[2.5], forces[order].ravel(), stress, energies[order]])
    back = atom_order.to_user_order(host, order, forces=True, stress=True, per_atom=True)
    np.testing.assert_array_equal(back, np.concatenate([[2.5], forces.ravel(), stress, energies]))
    only_energies = atom_order.to_user_order(np.concatenate([[1.0], energies[order]]), order, forces=False,
                                             stress=False, per_atom=True)
    np.testing.assert_array_equal(only_energies[1:], energies)


@pytest.mark.slow
def test_calculator_results_do_not_depend_on_the_order_it_runs_in(fp64_one_thread) -> None:
    """The bundled-shape MACE in FP64 on a rattled, shuffled periodic box: with every system sorted (threshold 0)
    energy, forces, stress and per-atom energies equal the unsorted run's, in the user's order."""
    model = build_model(r_max=4.0)
    atoms = water_box(n_side=3, seed=2)
    atoms.rattle(0.05, seed=3)
    atoms = atoms[np.random.default_rng(4).permutation(len(atoms))]

    def results(threshold: int | None) -> tuple[dict, Calculator]:
        a = atoms.copy()
        a.calc = Calculator(copy.deepcopy(model), device="cpu", patch=True,
                            options=RuntimeOptions(order_above_atoms=threshold))
        return {"energy": np.array(a.get_potential_energy()), "forces": a.get_forces(),
                "stress": a.get_stress(), "energies": a.get_potential_energies()}, a.calc

    want, plain = results(None)
    got, ordered = results(0)
    assert plain.system.order is None
    assert ordered.system.order is not None and not np.array_equal(ordered.system.order, np.arange(len(atoms)))
    for key, value in want.items():
        assert np.linalg.norm(value) > 0
        assert rel_err(got[key], value) < 1e-10, key
