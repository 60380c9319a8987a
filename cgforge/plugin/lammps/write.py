"""``cgforge lammps-model IN OUT``: write the file ``pair_style mliap unified OUT`` loads.

LAMMPS reads a ``.pt`` / ``.pth`` file with ``torch.load`` (since torch 2.6 it then needs
``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``) and any other with ``pickle.load``, the default here.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import torch

from cgforge.atomic import atomic_save

from .unified import CgforgeMLIAP

__all__ = ["TORCH_SUFFIXES", "usage_lines", "write_lammps_model"]

TORCH_SUFFIXES = (".pt", ".pth")


def write_lammps_model(obj: CgforgeMLIAP, path: str | os.PathLike, *, force: bool = False) -> Path:
    """Write ``obj`` to ``path`` (pickle, or torch.save for .pt/.pth) through a temporary file and a rename."""
    torch_file = Path(path).name.lower().endswith(TORCH_SUFFIXES)
    return atomic_save(obj, path, force=force, what="OUT", dump=torch.save if torch_file else
                       lambda o, f: pickle.dump(o, f, protocol=pickle.HIGHEST_PROTOCOL))


def usage_lines(obj: CgforgeMLIAP, path: str | os.PathLike, skin: float = 1.0) -> list[str]:
    """The LAMMPS input lines for ``obj`` written at ``path``: those of its mode as the active lines (``auto``:
    ghost-neighbour mode, which any ML-IAP build runs, with exchange mode's lines as comments)."""
    elements = " ".join(obj.element_types)
    ghost = [
        "# ghost-neighbour mode (any LAMMPS with ML-IAP + PYTHON): a ghost shell of layers x cutoff + skin",
        f"pair_style mliap unified {path} 1",
        f"comm_modify cutoff {obj.ghost_cutoff + skin:g}   # {obj.layers} x {obj.cutoff:g} + skin {skin:g}",
    ]
    exchange = [
        "# exchange mode (Kokkos ML-IAP with forward_exchange, LAMMPS 22 Jul 2025+; run with -k on ... -sf kk): "
        "one cutoff of ghosts",
        f"pair_style mliap unified {path} 0",
        f"comm_modify cutoff {obj.cutoff + skin:g}   # cutoff {obj.cutoff:g} + skin {skin:g}",
    ]
    active, other = (exchange, ghost) if obj.mode == "exchange" else (ghost, exchange)
    lines = [f"# {obj.kind} model, {obj.layers} message-passing layers, cutoff {obj.cutoff:g} A; elements {elements}",
             *active[:2],
             f"pair_coeff * * {elements}   # LAMMPS atom types 1, 2, ... in this element order (or your own)",
             active[2]]
    if obj.mode == "auto":  # the file runs either way: the other mode's lines as comments
        lines += [other[0], *(f"# {line}" for line in other[1:])]
    if obj.timers:
        lines += ["# timers on: after each run, their table into LAMMPS's screen and log (every rank's)",
                  'python cgforge_timers input 1 SELF format p here '
                  '"from cgforge.plugin.lammps.timers import report as cgforge_timers"',
                  "# run N", "python cgforge_timers invoke"]
    if str(path).lower().endswith(TORCH_SUFFIXES):
        lines.append("# a .pt file: run LAMMPS with TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 (torch >= 2.6 loads weights "
                     "only); a .pkl name avoids that")
    return lines
