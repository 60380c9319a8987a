"""The engine's state on the host: written into an ``Atoms`` (with the calculator's results) and read back from
a restart (a ``state_dict``, a .npz written by ``Engine.save``, or an Atoms the engine wrote)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from ase import Atoms
from ase.stress import full_3x3_to_voigt_6_stress, voigt_6_to_full_3x3_stress

ENGINE_INFO_KEY = "cgforge_engine"  # the engine's step, seed, integrator and its scalars in ``atoms.info``


def write_atoms(atoms: Atoms, flat: np.ndarray, extra_names: list[str], info: dict, stress: bool) -> None:
    """Write the engine's flat state ``flat`` (positions, momenta, forces [n, 3] each, energy, virial [3, 3], cell
    [3, 3], then the integrator's scalars ``extra_names``) into ``atoms``: positions, momenta and cell; ``info``
    plus the scalars under ``atoms.info[ENGINE_INFO_KEY]``; energy, forces (and the ``stress`` from the virial)
    as the results of its calculator (an ASE calculator's cache, else a SinglePointCalculator)."""
    n = len(atoms)
    at = 0

    def take(size: int) -> np.ndarray:
        nonlocal at
        at += size
        return flat[at - size:at].copy()

    positions, momenta, forces = take(3 * n).reshape(n, 3), take(3 * n).reshape(n, 3), take(3 * n).reshape(n, 3)
    energy, virial, cell = float(take(1)[0]), take(9).reshape(3, 3), take(9).reshape(3, 3)
    extra = {k: float(take(1)[0]) for k in extra_names}
    atoms.set_cell(cell, scale_atoms=False)
    atoms.set_positions(positions, apply_constraint=False)
    atoms.set_momenta(momenta, apply_constraint=False)
    atoms.info[ENGINE_INFO_KEY] = {**info, "extra": extra}
    results = {"energy": energy, "free_energy": energy, "forces": forces}
    if stress:
        results["stress"] = full_3x3_to_voigt_6_stress(virial / abs(np.linalg.det(cell)))
    calc = atoms.calc
    if calc is not None and hasattr(calc, "results") and hasattr(calc, "check_state"):
        calc.atoms = atoms.copy()  # ASE's cache: these results belong to exactly this structure
        calc.results = results
    else:
        from ase.calculators.singlepoint import SinglePointCalculator

        atoms.calc = SinglePointCalculator(atoms, **results)


def read_state(source: dict | str | os.PathLike | Atoms, needs_virial: bool) -> dict:
    """A restart's values as a dict (``Engine.state_dict``'s keys, some possibly missing): ``source`` as it is
    when a dict, read from an Atoms (forces and energy from its calculator's results; without a stored stress
    and ``needs_virial``, no forces: everything is computed again), or from a .npz file."""
    if isinstance(source, dict):
        return source
    if isinstance(source, Atoms):
        info = source.info.get(ENGINE_INFO_KEY, {})
        d = {"positions": source.get_positions(), "momenta": source.get_momenta(),
             "cell": np.array(source.cell), "numbers": source.numbers, "step": info.get("step", 0),
             "seed": info.get("seed"), "integrator": info.get("integrator"), "extra": info.get("extra", {})}
        results = getattr(source.calc, "results", {}) if source.calc is not None else {}
        if "forces" in results and "energy" in results:
            d["forces"], d["energy"] = results["forces"], results["energy"]
            if "stress" in results:
                d["virial"] = voigt_6_to_full_3x3_stress(results["stress"]) * abs(source.get_volume())
            elif needs_virial:
                d["forces"] = None  # no virial stored: compute everything again
        return d
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"restart: {path} not found")
    with np.load(path) as z:
        d = json.loads(str(z["meta"]))
        d.update({k: z[k] for k in ("numbers", "positions", "momenta", "forces", "virial", "cell")})
    return d
