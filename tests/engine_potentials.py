"""Torch test potentials for the MD engine's tests, and an ASE calculator over the same functions (so ASE's
integrators and the engine see bit-identical forces)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from ase import Atoms
from ase.calculators.calculator import Calculator, all_changes
from ase.md.velocitydistribution import MaxwellBoltzmannDistribution


def lennard_jones(epsilon: float = 0.0104, sigma: float = 3.4, cutoff: float = 8.0) -> Callable:
    """LJ (argon) over all minimum-image pairs, switched smoothly to zero between 0.8 and 1.0 cutoff."""

    def energy(positions: torch.Tensor, cell: torch.Tensor) -> torch.Tensor:
        n = positions.shape[0]
        frac = (positions[None, :, :] - positions[:, None, :]) @ torch.linalg.inv(cell)
        d = (frac - torch.round(frac)) @ cell
        i, j = torch.triu_indices(n, n, 1)
        r2 = d[i, j].square().sum(-1)
        sr6 = (sigma * sigma / r2) ** 3
        x = ((r2.sqrt() - 0.8 * cutoff) / (0.2 * cutoff)).clamp(0, 1)
        switch = 1 - x * x * x * (10 - 15 * x + 6 * x * x)
        return (4 * epsilon * (sr6 * sr6 - sr6) * switch).sum()

    return energy


def harmonic_tethers(sites: np.ndarray, k: float = 1.0) -> Callable:
    """Independent 3-D oscillators: E = k/2 sum |r - site|^2 (no periodicity)."""
    anchor = torch.as_tensor(sites, dtype=torch.float64)

    def energy(positions: torch.Tensor, cell: torch.Tensor) -> torch.Tensor:
        return 0.5 * k * (positions - anchor.to(positions.device)).square().sum()

    return energy


def zero_energy(positions: torch.Tensor, cell: torch.Tensor) -> torch.Tensor:
    """An ideal gas: no forces, no virial (kept differentiable)."""
    return 0.0 * positions.sum()


class TorchCalculator(Calculator):
    """ASE calculator over a torch energy function (float64, CPU)."""

    implemented_properties = ["energy", "forces"]

    def __init__(self, energy_fn: Callable) -> None:
        super().__init__()
        self.energy_fn = energy_fn

    def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes) -> None:
        super().calculate(atoms, properties, system_changes)
        pos = torch.tensor(self.atoms.positions, requires_grad=True)
        energy = self.energy_fn(pos, torch.tensor(np.array(self.atoms.cell)))
        (grad,) = torch.autograd.grad(energy, pos)
        self.results = {"energy": float(energy.detach()), "forces": -grad.numpy()}


def argon_box(n_side: int = 3, spacing: float = 5.6, temperature_K: float = 100.0, seed: int = 0) -> Atoms:
    """A simple-cubic argon crystal (jittered) with Maxwell-Boltzmann momenta."""
    rng = np.random.default_rng(seed)
    grid = np.stack(np.meshgrid(*[np.arange(n_side)] * 3, indexing="ij"), -1).reshape(-1, 3) * spacing
    atoms = Atoms(f"Ar{len(grid)}", positions=grid + rng.normal(scale=0.1, size=grid.shape),
                  cell=np.eye(3) * spacing * n_side, pbc=True)
    MaxwellBoltzmannDistribution(atoms, temperature_K=temperature_K, rng=rng)
    return atoms


def oscillators(n: int = 64, temperature_K: float = 300.0, seed: int = 0) -> Atoms:
    """``n`` tethered atoms of mixed masses (H, C, O) at rest on their sites, in a non-periodic box."""
    rng = np.random.default_rng(seed)
    symbols = rng.choice(["H", "C", "O"], size=n)
    sites = rng.uniform(0, 20, size=(n, 3))
    atoms = Atoms(list(symbols), positions=sites, cell=np.eye(3) * 20, pbc=False)
    MaxwellBoltzmannDistribution(atoms, temperature_K=temperature_K, rng=rng)
    return atoms


class ReplayNoise:
    """Noise from a numpy Generator in call order (the order in which ASE's Langevin draws xi, then eta)."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def __call__(self, stream: int, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.as_tensor(self.rng.standard_normal(size=shape))
