"""MACE and NequIP models in LAMMPS through ``pair_style mliap unified`` (see ``unified``).

    cgforge lammps-model mace water-mace.mliap.pkl      # writes the file LAMMPS loads

    pair_style mliap unified water-mace.mliap.pkl 1     # 1: ghost-neighbour mode
    pair_coeff * * O H
    comm_modify cutoff 11.0                             # layers x cutoff + skin

    pair_style mliap unified water-mace.mliap.pkl 0     # 0: exchange mode (Kokkos ML-IAP, LAMMPS 22 Jul 2025+;
    comm_modify cutoff 6.0                              #    `-k on ... -sf kk`): one cutoff + skin of ghosts

Tests without LAMMPS use a stand-in of its data object: ``tests/lammps/lammps_standin.py`` (not part of the package).
"""

from .unified import MODES, CgforgeMLIAP, LammpsSetupError

__all__ = ["CgforgeMLIAP", "LammpsSetupError", "MODES"]
