"""MACE and NequIP models in LAMMPS through ``pair_style mliap unified`` (see ``unified``; docs/lammps.md).

    cgforge lammps-model mace water-mace.mliap.pkl      # writes the file LAMMPS loads
    pair_style mliap unified water-mace.mliap.pkl 1     # 1: ghost-neighbour mode, 0: exchange mode

Tests without LAMMPS use a stand-in of its data object: ``tests/lammps/lammps_standin.py`` (not part of the package).
"""

from .unified import MODES, CgforgeMLIAP, LammpsSetupError

__all__ = ["CgforgeMLIAP", "LammpsSetupError", "MODES"]
