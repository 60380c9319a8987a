"""Patch and unpatch NequIP models (nequip >= 0.19), and the ``enable_cgforge`` model modifier.

Each ``TensorProductScatter`` becomes a ``conv.CgforgeTensorProductScatter`` (one ``ConvGraph`` per call for the
model), each self-connection ``sc`` a ``species_linear`` stand-in, e3nn ``Linear`` a ``SplitLinear``, ``Gate`` a
``FusedGate`` and the radial MLPs' linears ``RadialLinear``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from .. import e3nn_layers, gate, radial_precision, species_linear, stand_in
from ..common import UnsupportedModelError
from ..graph_cache import CallGraphCache
from ..harmonics import KernelHarmonics, is_e3nn_harmonics
from ..harmonics import stand_in_for as harmonics_stand_in
from ..stand_in import StandIn
from ..torch_internals import remove_forward_pre_hooks
from .conv import CgforgeTensorProductScatter, scatter_sites
from .files import SUPPORTED_ROUTE, CompiledModelError
from .radial_table import set_radial_table
from .streaming import set_streaming

if TYPE_CHECKING:  # the kernels load when a model is patched, not when this module is imported
    from cgforge.kernels.core.tuning import KernelTuning, TPTuning

log = logging.getLogger(__name__)


def _roots(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The models that get called: each entry of nequip's ModuleDict, or the model itself."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a NequIP model (torch.nn.Module), got {type(model).__name__}")
    if isinstance(model, torch.nn.ModuleDict):
        return list(model.values())
    return [model]


def patch(model: torch.nn.Module, *, tuning: KernelTuning | None = None) -> torch.nn.Module:
    """Swap every NequIP convolution (of a GraphModel or a ModuleDict of them) for cgforge's fused one, in place,
    idempotent; returns ``model``. ``UnsupportedModelError`` names the first module it cannot take (model unchanged)."""
    plans = []
    for root in _roots(model):
        sites = scatter_sites(root)  # checks every convolution first: raises with the model unchanged
        if not sites:
            cls = type(root)
            raise UnsupportedModelError(f"model: no NequIP convolution (nequip.nn TensorProductScatter) found in "
                                        f"{cls.__module__}.{cls.__qualname__}; cgforge patches NequIP GNN models")
        graphs = _graph_cache(root) or CallGraphCache()
        plans.append((root, graphs, {where for where, *_ in sites}))
    from cgforge.kernels.core.tuning import KernelTuning as Defaults  # the kernels load when a model is patched

    given = tuning if tuning is not None else Defaults()  # None means the defaults, the harmonics kernel included
    for root, graphs, wheres in plans:
        new = stand_in.swap_in(root, _scatter_maker(graphs, wheres, tuning.tp if tuning is not None else None))
        if given.harmonics:
            stand_in.swap_in(root, _harmonics_maker)
        swapped = species_linear.swap_in(root, "sc", graphs, given.linear_kernel_max_channels)
        e3nn_layers.swap_in(root, given.linear_kernel_max_channels, given.rows)
        gate.swap_in(root)
        radial_precision.swap_in(root, "edge_mlp")
        graphs.install(root)
        if new:
            log.info("cgforge: patched %d NequIP convolutions and %d self-connections", len(new), swapped)
    return model


def _scatter_maker(graphs: CallGraphCache, wheres: set[str], tuning: TPTuning | None = None) -> stand_in.Maker:
    """The walker's maker of ``CgforgeTensorProductScatter`` at the (checked) convolution sites ``wheres``."""

    def make(where: str, child: torch.nn.Module) -> StandIn | None:
        if where not in wheres:
            return None
        if isinstance(child, CgforgeTensorProductScatter):
            child.graphs = graphs  # patched before: the model's cache now
            return None
        try:
            return CgforgeTensorProductScatter(child, graphs, tuning)
        except (ValueError, TypeError, NotImplementedError) as err:
            raise UnsupportedModelError(f"{where} ({child.tp}): cgforge cannot build this convolution: {err}") from err

    return make


def _harmonics_maker(where: str, child: torch.nn.Module) -> StandIn | None:
    """``KernelHarmonics`` for the e3nn ``SphericalHarmonics`` of nequip's ``SphericalHarmonicEdgeAttrs`` (``.sh``)."""
    if (where != "sh" and not where.endswith(".sh")) or not is_e3nn_harmonics(child):
        return None
    return harmonics_stand_in(where, child)


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Put the original convolutions back (no cgforge objects left). In place; returns ``model``."""
    for root in _roots(model):
        set_streaming(root, None)
        set_radial_table(root, False)
        stand_in.swap_out(root, (CgforgeTensorProductScatter, KernelHarmonics))
        species_linear.swap_out(root)
        e3nn_layers.swap_out(root)
        gate.swap_out(root)
        radial_precision.swap_out(root)
        remove_forward_pre_hooks(root, CallGraphCache)
    return model


def is_patched(model: torch.nn.Module) -> bool:
    return any(isinstance(m, CgforgeTensorProductScatter) for m in model.modules())


def enable_cgforge(model: torch.nn.Module) -> torch.nn.Module:
    """The body of the ``enable_cgforge`` model modifier: refuse compile workflows, then ``patch``."""
    from nequip.scripts._workflow_utils import get_workflow_state

    if get_workflow_state() == "compile":
        raise CompiledModelError(f"enable_cgforge cannot be used in nequip-compile: {SUPPORTED_ROUTE}")
    if any(getattr(m, "is_compile_graph_model", False) for m in model.modules()):
        raise CompiledModelError("enable_cgforge: this model is built for train-time torch.compile (compile_mode: "
                                 "compile); cgforge patches eager models, use compile_mode: eager")
    return patch(model)


def _graph_cache(root: torch.nn.Module) -> CallGraphCache | None:
    for m in root.modules():
        if isinstance(m, CgforgeTensorProductScatter):
            return m.graphs
    return None
