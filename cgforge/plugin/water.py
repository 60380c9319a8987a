"""Water boxes and the q-SPC/Fw flexible water model: cheap, smooth reference labels for our water models.

q-SPC/Fw (Paesani et al., J. Chem. Phys. 125, 184507 (2006)): harmonic bonds and angle, point charges, O-O
Lennard-Jones, nothing within a molecule; Coulomb as Fennell & Gezelter's damped shifted force (J. Chem. Phys.
124, 234104 (2006)) and shifted-force LJ, so energy and force go to zero at the cutoff. Atoms: (O, H, H) per molecule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from ase import Atoms, units
from ase.calculators.calculator import Calculator, PropertyNotImplementedError, all_changes
from ase.stress import full_3x3_to_voigt_6_stress
from torch import Tensor

from cgforge.kernels.edge_layout import edges_within
from cgforge.plugin.runtime.neighbours import VerletNeighbourList, _as_pbc, _check_cutoff

# The anchors' constants (g/mol, 10^24 / mol): water_box(n_side=12) is the box the benchmarks quote.
_WATER_MOLAR_MASS = 18.015
_AVOGADRO_E24 = 0.6022
_GRID_ORIGIN = 0.3  # Å: shifts the grid off the cell faces, as the anchors do


def water_box(n_molecules: int | None = None, *, n_side: int | None = None, density: float = 1.0, seed: int = 0,
              oh_length: float = 0.9572, hoh_angle: float = 104.52) -> Atoms:
    """A cubic periodic box of randomly oriented (``seed``) rigid water molecules (O, H, H; TIP3P's geometry by
    default) with O on a simple cubic grid: ``n_side``^3 molecules, or ``n_molecules`` on a random subset of the
    smallest grid with enough sites. The cell edge follows from ``density`` (g/cm^3)."""
    if (n_molecules is None) == (n_side is None):
        raise ValueError("give exactly one of n_molecules and n_side")
    name, value = ("n_side", n_side) if n_side is not None else ("n_molecules", n_molecules)
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    n_molecules = int(n_side) ** 3 if n_side is not None else int(n_molecules)
    n_side = int(n_side) if n_side is not None else round(n_molecules ** (1 / 3))
    while n_side**3 < n_molecules:
        n_side += 1
    if not (math.isfinite(density) and density > 0):
        raise ValueError(f"density must be a finite number > 0 (g/cm^3), got {density!r}")

    rng = np.random.default_rng(seed)
    # Uniform random rotations from normalised Gaussian quaternions (w, x, y, z); drawn first, one
    # molecule at a time in grid order, the same sequence as the anchors' builder.
    w, x, y, z = rng.normal(size=(n_molecules, 4)).T
    norm = np.sqrt(w * w + x * x + y * y + z * z)
    w, x, y, z = w / norm, x / norm, y / norm, z / norm
    rotation = np.stack([
        np.stack([1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w)], -1),
        np.stack([2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w)], -1),
        np.stack([2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)], -1),
    ], -2)
    angle = np.deg2rad(hoh_angle)
    molecule = np.array([[0.0, 0.0, 0.0], [oh_length, 0.0, 0.0],
                         [oh_length * np.cos(angle), oh_length * np.sin(angle), 0.0]])

    edge = (n_molecules * _WATER_MOLAR_MASS / (_AVOGADRO_E24 * density)) ** (1 / 3)
    sites = np.stack(np.meshgrid(*[np.arange(n_side)] * 3, indexing="ij"), -1).reshape(-1, 3)
    if len(sites) > n_molecules:
        sites = sites[np.sort(rng.choice(len(sites), n_molecules, replace=False))]
    centres = sites * (edge / n_side) + _GRID_ORIGIN
    positions = np.einsum("mij,aj->mai", rotation, molecule) + centres[:, None, :]
    # numbers, not the formula "OH2" * n: ase parses a formula string in time that grows faster than its length
    return Atoms(numbers=np.tile([8, 1, 1], n_molecules), positions=positions.reshape(-1, 3), cell=[edge] * 3,
                 pbc=True)


@dataclass(frozen=True)
class QSPCFw:
    """Force-field constants in the paper's units (kcal/mol, Å, degrees, elementary charges).

    Energies: bonds (k_b / 2)(r - r0)^2, angle (k_a / 2)(theta - theta0)^2, LJ 4 eps ((s/r)^12 - (s/r)^6).
    """

    bond_k: float = 1059.162  # kcal/mol/Å^2
    bond_r0: float = 1.0  # Å
    angle_k: float = 75.90  # kcal/mol/rad^2
    angle_theta0: float = 112.0  # degrees
    lj_epsilon: float = 0.1554  # kcal/mol, O-O only
    lj_sigma: float = 3.1655  # Å
    charge_o: float = -0.84  # e
    charge_h: float = 0.42  # e


Q_SPC_FW = QSPCFw()
_KCAL_PER_MOL = units.kcal / units.mol  # eV
_COULOMB = units.Hartree * units.Bohr  # e^2 / (4 pi eps0) in eV Å


def check_water_order(numbers: np.ndarray | Tensor) -> None:
    """Raise ValueError unless the atoms are molecules (O, H, H), (O, H, H), ..."""
    numbers = np.asarray(numbers.tolist() if isinstance(numbers, Tensor) else numbers).reshape(-1)
    if len(numbers) % 3:
        raise ValueError(f"water needs 3 atoms per molecule (O, H, H), got {len(numbers)} atoms")
    bad = np.nonzero((numbers.reshape(-1, 3) != (8, 1, 1)).any(1))[0]
    if len(bad):
        m = int(bad[0])
        raise ValueError(f"atoms must be ordered O, H, H per molecule; molecule {m} (atoms {3 * m}..{3 * m + 2}) "
                         f"has atomic numbers {numbers[3 * m:3 * m + 3].tolist()}")


def _check_molecules(positions: Tensor) -> None:
    if positions.ndim != 2 or positions.shape[1] != 3 or positions.shape[0] % 3:
        raise ValueError(f"positions must be [3 M, 3] for M water molecules, got {tuple(positions.shape)}")


def whole_molecule_shifts(positions: Tensor, cell: Tensor, pbc: tuple[bool, bool, bool]) -> Tensor:
    """Integer lattice shifts [N, 3] moving each H to the periodic image nearest its O: molecules split by the
    cell boundary become whole (needs molecules < half the cell)."""
    _check_molecules(positions)
    shifts = torch.zeros(positions.shape, dtype=torch.int64, device=positions.device)
    periodic = [d for d in range(3) if pbc[d]]
    if not periodic:
        return shifts
    with torch.no_grad():
        oxygen = positions[0::3].repeat_interleave(3, dim=0)
        lattice = cell[periodic]
        coefficients = (positions - oxygen) @ torch.linalg.pinv(lattice)  # in units of periodic vectors
        shifts[:, periodic] = -torch.round(coefficients).long()
    return shifts


def qspcfw_energy(positions: Tensor, cell: Tensor, sender: Tensor, receiver: Tensor, shifts: Tensor, *,
                  cutoff: float = 9.0, alpha: float = 0.2, params: QSPCFw = Q_SPC_FW) -> Tensor:
    """Total q-SPC/Fw energy (eV) of whole molecules (O, H, H), differentiable in positions and cell, over the
    edges of a neighbour list at a cutoff >= ``cutoff`` (both directions); pairs beyond ``cutoff`` and within a
    molecule are dropped. DSF's constant self-energy is left out: an isolated relaxed molecule has energy zero."""
    _check_molecules(positions)
    dtype, device = positions.dtype, positions.device
    kcal = _KCAL_PER_MOL
    oxygen, hydrogen_1, hydrogen_2 = positions[0::3], positions[1::3], positions[2::3]
    bond_1, bond_2 = hydrogen_1 - oxygen, hydrogen_2 - oxygen
    length_1 = torch.linalg.vector_norm(bond_1, dim=-1)
    length_2 = torch.linalg.vector_norm(bond_2, dim=-1)
    # atan2(|a x b|, a.b): well conditioned near 104-112 degrees, unlike acos near its ends.
    theta = torch.atan2(torch.linalg.vector_norm(torch.cross(bond_1, bond_2, dim=-1), dim=-1),
                        (bond_1 * bond_2).sum(-1))
    intramolecular = (0.5 * params.bond_k * kcal * ((length_1 - params.bond_r0).square()
                                                    + (length_2 - params.bond_r0).square())
                      + 0.5 * params.angle_k * kcal * (theta - math.radians(params.angle_theta0)).square())

    _, lengths, within = edges_within(positions, cell, sender, receiver, shifts, cutoff)
    same_molecule = sender.div(3, rounding_mode="floor") == receiver.div(3, rounding_mode="floor")
    active = within & ~(same_molecule & (shifts == 0).all(-1))
    # Inactive edges get r = cutoff, where both terms and their derivatives vanish: no inf/NaN anywhere.
    r = torch.where(active, lengths, torch.full_like(lengths, cutoff))

    charge = torch.tensor([params.charge_o, params.charge_h, params.charge_h], dtype=dtype, device=device)
    charge_product = charge[sender % 3] * charge[receiver % 3]
    # DSF: erfc(a r)/r shifted so that value and slope vanish at the cutoff.
    erfc_c = math.erfc(alpha * cutoff)
    gauss_c = 2 * alpha / math.sqrt(math.pi) * math.exp(-((alpha * cutoff) ** 2))
    slope_c = erfc_c / cutoff**2 + gauss_c / cutoff
    coulomb = torch.erfc(alpha * r) / r - erfc_c / cutoff + slope_c * (r - cutoff)
    coulomb = _COULOMB * charge_product * coulomb

    eps, sigma = params.lj_epsilon * kcal, params.lj_sigma
    s6_c = (sigma / cutoff) ** 6
    lj_c = 4 * eps * (s6_c * s6_c - s6_c)
    dlj_c = 4 * eps * (-12 * s6_c * s6_c + 6 * s6_c) / cutoff
    s6 = (sigma / r) ** 6
    lennard_jones = 4 * eps * (s6 * s6 - s6) - lj_c - (r - cutoff) * dlj_c
    both_oxygen = (sender % 3 == 0) & (receiver % 3 == 0)

    pair = torch.where(active, coulomb + torch.where(both_oxygen, lennard_jones, 0.0), 0.0)
    return intramolecular.sum() + 0.5 * pair.sum()  # every pair is listed in both directions


class QSPCFwCalculator(Calculator):
    """ASE calculator for q-SPC/Fw water, atoms ordered O, H, H (torch, float64, autograd forces; stress, asked
    for, needs a 3-D periodic cell), over a Verlet list at ``cutoff + skin``."""

    implemented_properties = ["energy", "free_energy", "forces", "stress"]

    def __init__(self, cutoff: float = 9.0, alpha: float = 0.2, skin: float = 1.0,
                 device: str | torch.device = "cpu", params: QSPCFw = Q_SPC_FW, **kwargs) -> None:
        super().__init__(**kwargs)
        self.cutoff = _check_cutoff(cutoff)
        self.alpha = _check_cutoff(alpha, "alpha")
        if not isinstance(params, QSPCFw):
            raise TypeError(f"params must be a QSPCFw, got {type(params).__name__}")
        self.params = params
        self.device = torch.device(device)
        self.neighbours = VerletNeighbourList(self.cutoff, skin)

    def calculate(self, atoms: Atoms | None = None, properties=("energy",),
                  system_changes=all_changes) -> None:
        super().calculate(atoms, properties, system_changes)
        atoms = self.atoms
        check_water_order(atoms.numbers)
        pbc = _as_pbc(atoms.pbc)
        want_stress = "stress" in properties
        if want_stress and not all(pbc):
            raise PropertyNotImplementedError("stress needs a cell periodic in all three directions")

        positions = torch.tensor(atoms.positions, dtype=torch.float64, device=self.device, requires_grad=True)
        cell = torch.tensor(atoms.cell.array, dtype=torch.float64, device=self.device)
        image = whole_molecule_shifts(positions.detach(), cell, pbc).to(torch.float64)
        with torch.no_grad():
            self.neighbours.update(positions + image @ cell, cell, pbc)

        strain = torch.zeros(3, 3, dtype=torch.float64, device=self.device, requires_grad=want_stress)
        deformation = torch.eye(3, dtype=torch.float64, device=self.device) + strain
        strained_cell = cell @ deformation
        whole = (positions @ deformation) + image @ strained_cell
        edges = self.neighbours.sender, self.neighbours.receiver, self.neighbours.shifts
        energy = qspcfw_energy(whole, strained_cell, *edges, cutoff=self.cutoff, alpha=self.alpha,
                               params=self.params)
        inputs = [positions, strain] if want_stress else [positions]
        gradients = torch.autograd.grad(energy, inputs)

        self.results["energy"] = self.results["free_energy"] = float(energy.detach())
        self.results["forces"] = (-gradients[0]).cpu().numpy()
        if want_stress:
            virial = 0.5 * (gradients[1] + gradients[1].T) / abs(float(torch.linalg.det(cell)))
            self.results["stress"] = full_3x3_to_voigt_6_stress(virial.cpu().numpy())
