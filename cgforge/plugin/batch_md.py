"""NVE molecular dynamics of many independent structures at once: ``run_nve_batch``.

    from cgforge.plugin import Calculator, run_nve_batch
    final = run_nve_batch(Calculator("mace"), structures, timestep_fs=0.5, steps=1000)

Every structure moves by ASE's velocity Verlet (``ase.md.verlet.VelocityVerlet.step``: half a kick, a drift,
forces, half a kick) with its own atoms' masses and momenta (the ``Atoms``' own, zero where they have none);
all structures' forces come from one model call per step (``runtime.batch.BatchStep``: one graph, each
structure's Verlet list kept while it is valid). Positions, momenta and forces stay on the model's device. This
is the batch's NVE reference, not the MD engine: the steps run eagerly (no CUDA graph), with no thermostat or
barostat; a structure that cannot be evaluated raises ``BatchStructureError`` naming it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from ase import Atoms, units
from ase.calculators.singlepoint import SinglePointCalculator

from .batch import potential_of, structures_of
from .calculator import Calculator
from .runtime.batch import BatchStructureError, check_finite
from .runtime.potential import Potential

__all__ = ["run_nve_batch"]


def run_nve_batch(model: Potential | Calculator, atoms_list: Sequence[Atoms], *, timestep_fs: float, steps: int,
                  min_distance: float | None = 0.5) -> list[Atoms]:
    """``steps`` velocity-Verlet steps of ``timestep_fs`` fs for every structure of ``atoms_list`` in one batch;
    copies of the structures at the end, with their momenta and a single-point calculator holding their energy
    and forces there. The inputs are not changed. ``min_distance``: as ``evaluate_batch``'s."""
    if not (isinstance(timestep_fs, int | float) and np.isfinite(timestep_fs) and timestep_fs > 0):
        raise ValueError(f"timestep_fs: expected a finite number > 0, got {timestep_fs!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps: expected an integer >= 0, got {steps!r}")
    structures = structures_of(atoms_list)
    step = potential_of(model).batch_step(min_distance)
    device = step.adapter.device
    sizes = [len(s.numbers) for s in structures]
    if 0 in sizes:
        raise BatchStructureError(sizes.index(0), "expected a structure with at least one atom, got none")
    ptr = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    cells = np.stack([np.asarray(s.cell, dtype=np.float64) for s in structures])
    pbcs = [tuple(s.pbc) for s in structures]
    host_positions = np.concatenate([np.asarray(s.positions, dtype=np.float64) for s in structures])
    check_finite(host_positions, cells, ptr)
    species = step.species(np.concatenate([np.asarray(s.numbers) for s in structures]), ptr)
    f64 = {"dtype": torch.float64, "device": device}
    x = torch.as_tensor(host_positions, **f64)
    p = torch.as_tensor(np.concatenate([a.get_momenta() for a in atoms_list]), **f64)
    masses = torch.as_tensor(np.concatenate([a.get_masses() for a in atoms_list]), **f64)[:, None]
    dt = timestep_fs * units.fs
    keys = list(range(len(structures)))

    def forces() -> tuple[torch.Tensor, torch.Tensor]:
        out = step.run(x, cells, pbcs, ptr, species, keys=keys)
        return out.forces.detach().to(torch.float64), out.energy.detach().to(torch.float64)

    f, energy = forces()
    for _ in range(steps):
        p += 0.5 * dt * f
        x += dt * p / masses
        f, energy = forces()
        p += 0.5 * dt * f
    energies = energy.cpu().numpy()
    x_host, p_host, f_host = (t.cpu().numpy() for t in (x, p, f))
    bad = ~np.isfinite(energies) | (np.add.reduceat((~np.isfinite(f_host)).any(1).astype(np.int64), ptr[:-1]) > 0)
    if bad.any():
        raise BatchStructureError(int(np.argmax(bad)), "the model returned NaN or inf during the run")
    final = []
    for b, atoms in enumerate(atoms_list):
        copy = atoms.copy()
        rows = slice(ptr[b], ptr[b + 1])
        copy.set_positions(x_host[rows])
        copy.set_momenta(p_host[rows], apply_constraint=False)
        copy.calc = SinglePointCalculator(copy, energy=float(energies[b]), free_energy=float(energies[b]),
                                          forces=f_host[rows].copy())
        final.append(copy)
    return final
