"""The class paths pickled patched models name (``PICKLED_CLASSES``): a contract with files on users' disks.

Patched models (``cgforge patch``, ``torch.save``) and LAMMPS files name these classes by module path and load only
while each path imports to the object of that name: moving one means leaving its name importable from its old
module (``tests/test_pickle_contract.py`` checks). No other old import path is kept.
"""

from __future__ import annotations

# "module.qualname" of every cgforge class (or function) a pickled patched model names, by what puts it there
PICKLED_CLASSES: dict[str, tuple[str, ...]] = {
    # a patched MACE model (cgforge.patches.mace.patch), whole-model pickles (`cgforge patch IN.model OUT.model`)
    "mace": (
        "cgforge.patches.mace.patch.FusedConvTP",
        "cgforge.patches.mace.patch.FusedSymmetricContraction",
        "cgforge.patches.mace.patch.GraphCache",
        "cgforge.patches.mace.reshape.BlockReshape",
        "cgforge.patches.mace.symmetric_contraction._Contraction",
        "cgforge.patches.mace.symmetric_contraction._rebuild_after_load",  # a load_state_dict post-hook
        "cgforge.patches.e3nn_layers.FoldedMLP",
        "cgforge.patches.e3nn_layers.SplitLinear",
        "cgforge.patches.species_linear.SpeciesSelfConnection",
        "cgforge.kernels.convolution.module.Convolution",
        "cgforge.kernels.tensor_product.problem.Instruction",
        "cgforge.kernels.tensor_product.problem.TPProblem",
        "cgforge.kernels.symmetric_contraction.problem.SCProblem",
        "cgforge.kernels.core.tuning.TPTuning",  # the tuning a kernel module was built with
        "cgforge.kernels.core.tuning.SCTuning",
        "cgforge.kernels.core.tuning.RowPolicy",  # when frozen maps run in row chunks (KernelTuning.rows)
        "cgforge.patches.harmonics.KernelHarmonics",  # the edge harmonics (KernelTuning.harmonics, on by default)
        "cgforge.kernels.harmonics.HarmonicsPolynomials",
    ),
    # a MACE model saved while the runtime streams edges, reads radial tables or makes rows in chunks
    "mace runtime": (
        "cgforge.patches.mace.streaming.AppliedLinear",
        "cgforge.patches.mace.streaming.DeferredRadialEmbedding",
        "cgforge.patches.mace.streaming.DeferredSphericalHarmonics",
        "cgforge.patches.mace.radial_table.LengthsAsEdgeFeatures",
        "cgforge.patches.mace.row_chunks.RecomputedHarmonics",
        "cgforge.patches.radial_table.TabulatedRadial",
        "cgforge.patches.streaming.DeferredRadial",
    ),
    # a patched NequIP package (`cgforge patch IN.ckpt OUT.nequip.zip`; the modules are its external modules)
    "nequip": (
        "cgforge.patches.nequip.conv.CgforgeTensorProductScatter",
        "cgforge.patches.graph_cache.CallGraphCache",
        "cgforge.patches.radial_precision.RadialLinear",
        "cgforge.patches.species_linear.SpeciesSelfConnection",
        "cgforge.patches.e3nn_layers.SplitLinear",  # packages from a .ckpt (the installed e3nn's Linear swapped)
        "cgforge.kernels.core.tuning.RowPolicy",  # its row-chunk rule (KernelTuning.rows)
        "cgforge.patches.gate.FusedGate",  # e3nn's Gate (the nonlinearity) by the gate kernels
        "cgforge.kernels.gate.GateTable",
        "cgforge.patches.harmonics.KernelHarmonics",
        "cgforge.kernels.harmonics.HarmonicsPolynomials",
    ),
    # a LAMMPS ML-IAP file (`cgforge lammps-model`: the class pickled with the model inside it)
    "lammps": ("cgforge.plugin.lammps.unified.CgforgeMLIAP",),
    # a NequIP package written from a model that streams edges or reads radial tables
    "nequip runtime": (
        "cgforge.patches.nequip.radial_table.FactorInTable",
        "cgforge.patches.nequip.radial_table.NormLengthAsEmbedding",
        "cgforge.patches.radial_table.TabulatedRadial",
        "cgforge.patches.streaming.DeferredRadial",
    ),
}


# Packages the layout moved into the plugin (0.2.0): an ML-IAP file written before names cgforge.lammps.unified, and
# importing it should say what to do, not only "No module named"
MOVED_PACKAGES = {"cgforge.lammps": "cgforge.plugin.lammps", "cgforge.cli": "cgforge.plugin.cli"}


class MovedPackageFinder:
    """The last meta path finder: an import of a moved package (nothing else found it) fails naming where it went."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        for old, new in MOVED_PACKAGES.items():
            if name == old or name.startswith(f"{old}."):
                raise ModuleNotFoundError(f"No module named {name!r}: {old} moved to {new}; a LAMMPS ML-IAP file that "
                                          "names it was written by an older `cgforge lammps-model`: write it again",
                                          name=name)


def pickled_paths() -> frozenset[str]:
    """Every path of ``PICKLED_CLASSES``, of all families and states."""
    return frozenset(path for paths in PICKLED_CLASSES.values() for path in paths)

