"""A spatial order of a large system's atoms, in which the model runs: results go back in the user's order.

A Z/Morton curve of the positions, made once per system (locality, not correctness), for systems above
``RuntimeOptions.order_above_atoms`` atoms (docs/calculator.md, "Atom order").
"""

from __future__ import annotations

import numpy as np

BITS = 10  # per axis: 1024 cells a side (a 1 M-atom water box is ~220 Å: ~0.2 Å a cell)


def morton_order(positions: np.ndarray, cell: np.ndarray, pbc: tuple[bool, bool, bool], bits: int = BITS
                 ) -> np.ndarray:
    """The stable permutation (int64 [n]) sorting ``positions`` along a Z curve of ``bits`` per axis of their
    fractional coordinates (wrapped along periodic axes, scaled to the occupied range along open ones)."""
    positions = np.asarray(positions, dtype=np.float64)
    cell = np.asarray(cell, dtype=np.float64)
    has_cell = abs(np.linalg.det(cell)) > 1e-12
    frac = np.linalg.solve(cell.T, positions.T).T if has_cell else positions.copy()
    for axis in range(3):
        column = frac[:, axis]
        if pbc[axis] and has_cell:
            frac[:, axis] = column - np.floor(column)
        else:
            low, span = column.min(), np.ptp(column)
            frac[:, axis] = (column - low) / span if span > 0 else 0.0
    cells = np.minimum((frac * (1 << bits)).astype(np.int64), (1 << bits) - 1)
    code = np.zeros(len(positions), dtype=np.int64)
    for bit in range(bits):
        for axis in range(3):
            code |= ((cells[:, axis] >> bit) & 1) << (3 * bit + axis)
    return np.argsort(code, kind="stable")


def spatial_order(positions: np.ndarray, cell: np.ndarray, pbc: tuple[bool, bool, bool],
                  above_atoms: int | None) -> np.ndarray | None:
    """The Z-curve order for more than ``above_atoms`` atoms (None: never), else None: the user's order (also for
    non-finite positions, which the potential then refuses by name)."""
    if above_atoms is None or len(positions) <= above_atoms or not np.isfinite(positions).all():
        return None
    return morton_order(positions, cell, pbc)


def to_user_order(host: np.ndarray, order: np.ndarray, *, forces: bool, stress: bool, per_atom: bool
                  ) -> np.ndarray:
    """The step's host result ([energy, forces 3n if forces or stress, stress 9 if stress, energies n if
    per_atom]) computed on atoms in ``order``, with its per-atom parts put back in the user's order."""
    n = len(order)
    out = host.copy()
    at = 1
    if forces or stress:
        out[at:at + 3 * n].reshape(n, 3)[order] = host[at:at + 3 * n].reshape(n, 3)
        at += 3 * n + (9 if stress else 0)
    if per_atom:
        out[at:at + n][order] = host[at:at + n]
    return out
