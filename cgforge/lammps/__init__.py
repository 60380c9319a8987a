"""MACE and NequIP models in LAMMPS through ``pair_style mliap unified`` (see ``unified``).

    cgforge lammps-model mace water-mace.mliap.pkl      # writes the file LAMMPS loads

    pair_style mliap unified water-mace.mliap.pkl 1     # 1: ghost-neighbour mode
    pair_coeff * * O H
    comm_modify cutoff 11.0                             # layers x cutoff + skin

``standin`` builds LAMMPS's data object from an ASE structure, for tests without LAMMPS.
"""

from .unified import MODES, CgforgeMLIAP, LammpsSetupError

__all__ = ["CgforgeMLIAP", "LammpsSetupError", "MODES"]
