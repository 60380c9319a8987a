"""Old import paths of modules and names that moved, kept working with a ``DeprecationWarning`` naming the new
place, and the class paths pickled patched models name (``PICKLED_CLASSES``). One table each, one import hook:
nothing else in the package keeps an alias.

``import cgforge.plugin.engine`` imports ``cgforge.plugin.md.engine`` and registers it under the old name too,
so ``from cgforge.plugin.engine import Engine`` and pickles that name the old module both keep working.

``PICKLED_CLASSES`` is a contract with files on users' disks: ``cgforge patch`` output (a MACE ``.model`` is a
whole-model pickle, a NequIP ``.nequip.zip`` a torch.package with cgforge as an external module) and
``torch.save`` of a patched model name these classes by module path and name, and load only while each path
imports to the object of that name. Moving or renaming one of them means keeping the old path: its module in
``MOVED_MODULES`` (a whole module moved) or the name left in its old module. ``tests/test_pickle_contract.py``
checks every path, that the pickles cgforge writes name no other cgforge path, and that files written before
the contract existed (``tests/data/*-c54a3be*``) still load.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType
from typing import Any

# old module path -> new module path (moved in 0.2, when the plugin was split by job)
MOVED_MODULES: dict[str, str] = {
    "cgforge.plugin.inputs": "cgforge.plugin.runtime.adapters",
    "cgforge.plugin.neighbours": "cgforge.plugin.runtime.neighbours",
    "cgforge.plugin.edge_layout": "cgforge.plugin.runtime.edge_layout",
    "cgforge.plugin.edge_vectors": "cgforge.plugin.runtime.edge_vectors",
    "cgforge.plugin.step_graph": "cgforge.plugin.runtime.step_graph",
    "cgforge.plugin.compiled": "cgforge.plugin.runtime.compiled",
    "cgforge.plugin.memory_plan": "cgforge.plugin.runtime.memory_plan",
    "cgforge.plugin.atom_order": "cgforge.plugin.runtime.atom_order",
    "cgforge.plugin.bundled": "cgforge.plugin.runtime.bundled",
    "cgforge.plugin.engine": "cgforge.plugin.md.engine",
    "cgforge.plugin.engine_forces": "cgforge.plugin.md.forces",
    "cgforge.plugin.engine_rng": "cgforge.plugin.md.noise",
    "cgforge.plugin.integrators": "cgforge.plugin.md.integrators",
    "cgforge.plugin.md_dynamics": "cgforge.plugin.md.dynamics",
    "cgforge.plugin.md_options": "cgforge.plugin.md.options",
    "cgforge.plugin.md_files": "cgforge.plugin.md.files",
    "cgforge.plugin.md_checks": "cgforge.plugin.md.checks",
    "cgforge.plugin.md_plot": "cgforge.plugin.md.plot",
    "cgforge.plugin.md_cli": "cgforge.cli.md",
    "cgforge.doctor": "cgforge.cli.doctor",
}

# (package, name) -> module that now defines the name: names a package re-exported from a module that moved away
MOVED_NAMES: dict[tuple[str, str], str] = {
    ("cgforge.plugin.md", name): "cgforge.cli.md"
    for name in ("add_md_arguments", "prepare_md", "run_from_args", "relax_structure", "model_banner")
}


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
        "cgforge.patches.gate.FusedGate",  # e3nn's Gate (the nonlinearity) by the gate kernels
        "cgforge.kernels.gate.GateTable",
        "cgforge.patches.harmonics.KernelHarmonics",
        "cgforge.kernels.harmonics.HarmonicsPolynomials",
    ),
    # a NequIP package written from a model that streams edges or reads radial tables
    "nequip runtime": (
        "cgforge.patches.nequip.radial_table.FactorInTable",
        "cgforge.patches.nequip.radial_table.NormLengthAsEmbedding",
        "cgforge.patches.radial_table.TabulatedRadial",
        "cgforge.patches.streaming.DeferredRadial",
    ),
}


def pickled_paths() -> frozenset[str]:
    """Every path of ``PICKLED_CLASSES``, of all families and states."""
    return frozenset(path for paths in PICKLED_CLASSES.values() for path in paths)


def _warn(old: str, new: str) -> None:
    warnings.warn(f"{old} moved to {new}; the old name will be removed in a later release",
                  DeprecationWarning, stacklevel=4)


def moved_attribute(package: str, name: str) -> Any:
    """The value of ``package.name`` for a name that moved (with a warning), or AttributeError."""
    new = MOVED_NAMES.get((package, name))
    if new is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    _warn(f"{package}.{name}", f"{new}.{name}")
    return getattr(importlib.import_module(new), name)


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        _warn(spec.name, self.new)
        return importlib.import_module(self.new)

    def exec_module(self, module: ModuleType) -> None:
        pass  # the new module ran when it was imported


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        new = MOVED_MODULES.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(new))


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (``import cgforge`` does this)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
