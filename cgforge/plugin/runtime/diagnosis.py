"""What went wrong when a model returned NaN or inf: ``NonFiniteOutputError`` and the message that names it."""

from __future__ import annotations

import numpy as np
import torch

_SHOWN_ATOMS = 8  # atom indices named in a message


class NonFiniteOutputError(ValueError):
    """The model returned NaN or inf for a structure; the message names the outputs, the first atoms and the
    closest pair (``non_finite_message``)."""


def non_finite_message(host: np.ndarray, positions: np.ndarray, cell: np.ndarray, pbc: tuple[bool, bool, bool],
                       model: torch.nn.Module, cutoff: float, *, patched: bool, forces: bool, stress: bool,
                       per_atom: bool, what: str = "this structure") -> str:
    """Which parts of ``host`` (a step's result: energy, forces if ``forces or stress``, virial if ``stress``,
    per-atom energies if ``per_atom``) are NaN/inf, on which atoms, the closest pair of ``positions`` within
    ``cutoff``, and any non-finite parameters of ``model`` (``patched``: run by cgforge's kernels). Computed
    only after a failure."""
    n = positions.shape[0]
    parts, atoms = [], np.zeros(n, dtype=bool)
    if not np.isfinite(host[0]):
        parts.append(f"energy {host[0]}")
    at = 1
    if forces or stress:
        bad = ~np.isfinite(host[at:at + 3 * n].reshape(n, 3)).all(axis=1)
        at += 3 * n
        if bad.any():
            parts.append(f"forces on {int(bad.sum())} of {n} atoms")
            atoms |= bad
        if stress:
            if not np.isfinite(host[at:at + 9]).all():
                parts.append("stress")
            at += 9
    if per_atom:
        bad = ~np.isfinite(host[at:at + n])
        if bad.any():
            parts.append(f"per-atom energies of {int(bad.sum())} of {n} atoms")
            atoms |= bad
    lines = [f"model output is not finite for {what}: {', '.join(parts)}"]
    if atoms.any():
        index = np.nonzero(atoms)[0]
        more = ", ..." if index.size > _SHOWN_ATOMS else ""
        lines.append(f"atoms {', '.join(map(str, index[:_SHOWN_ATOMS]))}{more}")
    lines.append(_closest_pair(positions, cell, pbc, cutoff))
    broken = [name for name, t in (*model.named_parameters(), *model.named_buffers())
              if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if broken:
        shown = ", ".join(broken[:3]) + (f" and {len(broken) - 3} more" if len(broken) > 3 else "")
        lines.append(f"the model's own parameters hold NaN/inf ({shown}): the model file is broken; "
                     "re-download or re-train it")
    else:
        lines.append("usual causes: atoms on top of each other (or an MD run that blew up before this step), "
                     "or a damaged model file" + ("; if patch=False gives finite numbers here, report it to "
                                                  "cgforge" if patched else ""))
    return "; ".join(lines)


def _closest_pair(positions: np.ndarray, cell: np.ndarray, pbc: tuple[bool, bool, bool], within: float) -> str:
    """'closest pair: atoms i and j at d Å' (minimum image, within the model's cutoff)."""
    from ase.neighborlist import primitive_neighbor_list

    if not np.isfinite(positions).all():
        return "positions hold NaN/inf"
    try:
        i, j, d = primitive_neighbor_list("ijd", pbc, cell, positions, within, self_interaction=False)
    except Exception as err:  # noqa: BLE001 - a diagnosis only: never hide the error it is part of
        return f"closest pair not found ({type(err).__name__}: {err})"
    if d.size == 0:
        return f"no two atoms closer than the cutoff, {within:g} Å"
    k = int(np.argmin(d))
    image = " (with its own periodic image)" if i[k] == j[k] else ""
    periodic = " (minimum image)" if any(pbc) else ""
    return f"closest pair: atoms {i[k]} and {j[k]}{image} at {d[k]:.3g} Å{periodic}"
