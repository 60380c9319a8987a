"""Many ASE structures in one model call: ``evaluate_batch`` (docs/batch.md)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from ase import Atoms
from ase.stress import full_3x3_to_voigt_6_stress

from .calculator import Calculator
from .runtime.batch import BatchStructure, BatchStructureError
from .runtime.potential import Potential

__all__ = ["BatchResult", "BatchStructureError", "as_structure", "evaluate_batch", "potential_of", "structures_of"]


@dataclass
class BatchResult:
    """One structure's results (float64, its atoms' order): energy (eV), forces (eV/Å), virial (eV), stress (Voigt,
    eV/Å^3; None for a cell of zero volume or without stress), per-atom energies (None unless asked for)."""

    energy: float
    forces: np.ndarray | None
    virial: np.ndarray | None
    stress: np.ndarray | None
    energies: np.ndarray | None


def potential_of(model: Potential | Calculator) -> Potential:
    """The runtime ``Potential`` of a cgforge ``Calculator`` (or the potential itself)."""
    if isinstance(model, Calculator):
        return model.potential
    if isinstance(model, Potential):
        return model
    raise TypeError(f"model: expected a cgforge Calculator or Potential, got {type(model).__name__}")


def as_structure(atoms: Atoms) -> BatchStructure:
    """The batch's view of an ``ase.Atoms``."""
    if not isinstance(atoms, Atoms):
        raise TypeError(f"expected an ase.Atoms, got {type(atoms).__name__}")
    return BatchStructure(atoms.numbers, atoms.positions, np.asarray(atoms.cell), tuple(bool(p) for p in atoms.pbc))


def structures_of(atoms_list: Sequence[Atoms]) -> list[BatchStructure]:
    """``as_structure`` of each; not an Atoms, or constraints: ``BatchStructureError`` naming its index."""
    structures = []
    for index, atoms in enumerate(atoms_list):
        try:
            structures.append(as_structure(atoms))
        except TypeError as err:
            raise BatchStructureError(index, str(err)) from None
        if atoms.constraints:
            raise BatchStructureError(index, f"constraints ({', '.join(type(c).__name__ for c in atoms.constraints)}) "
                                             "are not supported in a batch")
    return structures


def evaluate_batch(model: Potential | Calculator, atoms_list: Sequence[Atoms], *, forces: bool = True,
                   stress: bool = True, energies: bool = False, min_distance: float | None = 0.5,
                   keys: Sequence | None = None) -> list[BatchResult]:
    """Energy, forces, stress and per-atom ``energies`` of every structure in one model call; one ``BatchResult``
    each, in order. min_distance: two atoms closer than this (Å) make a structure bad (None: no check); a bad
    structure raises ``BatchStructureError`` (a ValueError) with its ``index``. keys: as ``Potential``'s."""
    outs = potential_of(model).evaluate_batch(structures_of(atoms_list), forces=forces or stress, stress=stress,
                                              per_atom=energies, min_distance=min_distance, keys=keys)
    results = []
    for atoms, out in zip(atoms_list, outs, strict=True):
        volume = abs(float(atoms.cell.volume))
        voigt = full_3x3_to_voigt_6_stress(out.virial / volume) if out.virial is not None and volume > 0 else None
        results.append(BatchResult(out.energy, out.forces, out.virial, voigt, out.energies))
    return results
