"""A captured engine block reads the force provider's tensors at the addresses it was captured with: a neighbour-list
rebuild must update them in place (or change ``generation``, so the engine captures again). On the GPU a fresh
tensor here made every block after the first rebuild compare positions with stale references (and stop)."""

from __future__ import annotations

import torch

from cgforge.plugin import Calculator, water_box
from cgforge.plugin.md.forces import ModelForces


def test_rebuild_keeps_the_reference_buffers_or_changes_the_generation() -> None:
    torch.set_default_dtype(torch.float32)
    atoms = water_box(8, seed=0)
    calc = Calculator("mace", device="cpu", dtype="float64", warmup=False)
    provider = ModelForces(calc.potential)
    positions = torch.as_tensor(atoms.positions, dtype=torch.float64)
    cell = torch.as_tensor(atoms.cell.array, dtype=torch.float64)
    for changes_cell in (False, True):
        provider.start(positions, cell, (True, True, True), atoms.numbers, changes_cell=changes_cell)
        held, generation = provider._ref_positions.data_ptr(), provider.generation
        inverse = None if provider._ref_cell_inverse is None else provider._ref_cell_inverse.data_ptr()
        moved = positions + 0.05
        provider.rebuild(moved, cell * 1.01)
        assert provider.generation[1] == generation[1]  # ours kept; the step's may move (its buffers can grow)
        assert provider._ref_positions.data_ptr() == held
        assert torch.equal(provider._ref_positions, moved)
        if changes_cell:
            assert provider._ref_cell_inverse.data_ptr() == inverse
            torch.testing.assert_close(provider._ref_cell_inverse, torch.linalg.inv(cell * 1.01))
        result = provider.compute(moved, cell * 1.01, virial=False)
        assert not bool(result.stale), "just rebuilt at these positions: not stale"
