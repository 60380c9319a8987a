"""Do edges at or beyond the cutoff contribute exactly nothing to a model's energy?

When they do not (the energy and its derivative are exactly unchanged by such an edge), the calculator may
feed the model its whole Verlet list (pairs within cutoff + skin) and pad its edge arrays with self-edges
longer than the cutoff, which a CUDA graph of fixed shapes needs. Otherwise it must cut the list to the
cutoff exactly and cannot pad.

What makes an edge inert, read from the model code (mace-torch 0.3.16, nequip 0.19):

- MACE: ``PolynomialCutoff`` returns ``envelope * (r < r_max)``: exactly 0 at and beyond r_max, and so is its
  derivative (the mask's derivative is 0, the envelope stays finite). ``RadialEmbeddingBlock`` either
  multiplies the radial basis by it (``apply_cutoff`` True, the default: edge features 0) or hands it to the
  interaction blocks, which multiply the convolution weights (and edge densities) by it. With zero edge
  features the weights are ``MLP(0)``: zero only for a bias-free MLP whose activation vanishes at 0 (e3nn's
  ``FullyConnectedNet`` with SiLU), checked here by evaluating the MLP at 0. Blocks whose radial MLP also
  reads node features (attention, non-linear) are inert only with ``apply_cutoff`` False. ZBL pair repulsion
  carries the same polynomial envelope (at the covalent-radii sum). A zero weight makes the convolution's
  message and its derivative with respect to the spherical harmonics exactly zero.
- NequIP: ``BesselEdgeLengthEncoding`` multiplies the basis by nequip's ``PolynomialCutoff``
  (``out * (x < 1)``, x = r / r_max per edge type); each ``InteractionBlock`` weights its convolution with
  ``edge_mlp(edge embedding)``, a bias-free MLP (checked at 0 here); ZBL and Lennard-Jones terms multiply by
  the same cutoff. The energy model is checked module by module against this list; anything else is
  "not known", and the calculator filters.
"""

from __future__ import annotations

import torch

__all__ = ["mace_inert_beyond_cutoff", "nequip_inert_beyond_cutoff"]

_MACE_MODELS = ("MACE", "ScaleShiftMACE")
_MACE_BLOCKS = (
    "RealAgnosticInteractionBlock",
    "RealAgnosticResidualInteractionBlock",
    "RealAgnosticDensityInteractionBlock",
    "RealAgnosticDensityResidualInteractionBlock",
    "RealAgnosticAttResidualInteractionBlock",
    "RealAgnosticResidualNonLinearInteractionBlock",
)
# Their radial MLP input mixes in node features: not zero for an edge with zero edge features.
_MACE_BLOCKS_NEEDING_CUTOFF_WEIGHTS = ("RealAgnosticAttResidualInteractionBlock",
                                       "RealAgnosticResidualNonLinearInteractionBlock")

_NEQUIP_NODE_MODULES = ("NodeTypeEmbed", "ApplyFactor", "ScalarMLP", "AtomwiseLinear", "PerTypeScaleShift",
                        "AtomwiseReduce", "AtomwiseOperation", "SphericalHarmonicEdgeAttrs", "EdgeLengthNormalizer")
_NEQUIP_CUTOFF_MODULES = ("BesselEdgeLengthEncoding", "AddRadialCutoffToData", "ZBL", "LennardJones",
                          "SimpleLennardJones")


def _class_name(module: object) -> str:
    # a TorchScript-compiled module (nequip scripts some) keeps its Python class name as original_name
    return getattr(module, "original_name", None) or type(module).__name__


def _vanishes_at_zero(mlp: torch.nn.Module, in_dim: int) -> bool:
    """MLP(0) == 0 exactly (then an edge with zero features gets zero weights)."""
    param = next(mlp.parameters(), None)
    if param is None:
        return False
    with torch.no_grad():
        out = mlp(torch.zeros(2, in_dim, dtype=param.dtype, device=param.device))
    return bool((out == 0).all())


def mace_inert_beyond_cutoff(model: torch.nn.Module) -> str | None:
    """None if every edge at or beyond ``model.r_max`` contributes exactly zero, else the reason it may not."""
    cls = type(model)
    if cls.__module__ != "mace.modules.models" or cls.__name__ not in _MACE_MODELS:
        return f"MACE model class {cls.__name__} is not one cgforge has checked ({', '.join(_MACE_MODELS)})"
    radial = getattr(model, "radial_embedding", None)
    if type(radial).__name__ != "RadialEmbeddingBlock":
        return f"radial embedding {type(radial).__name__} is not mace's RadialEmbeddingBlock"
    cutoff_fn = getattr(radial, "cutoff_fn", None)
    if type(cutoff_fn).__name__ != "PolynomialCutoff":
        return f"radial cutoff {type(cutoff_fn).__name__} is not mace's PolynomialCutoff"
    if float(cutoff_fn.r_max) > float(model.r_max):
        return f"radial cutoff r_max {float(cutoff_fn.r_max)} exceeds the model's r_max {float(model.r_max)}"
    weights_cut = not getattr(radial, "apply_cutoff", True)  # the blocks multiply their weights by the cutoff
    for i, block in enumerate(model.interactions):
        name = type(block).__name__
        if name not in _MACE_BLOCKS:
            return f"interactions.{i}: {name} is not a block cgforge has checked"
        if weights_cut:
            continue
        if name in _MACE_BLOCKS_NEEDING_CUTOFF_WEIGHTS:
            return (f"interactions.{i}: {name} feeds node features to its radial MLP; with apply_cutoff=True an "
                    "edge beyond the cutoff still gets nonzero weights")
        for attr in ("conv_tp_weights", "density_fn"):
            mlp = getattr(block, attr, None)
            if mlp is not None and not _vanishes_at_zero(mlp, int(mlp.hs[0])):
                return f"interactions.{i}.{attr} is not zero for zero edge features (bias or activation)"
    if hasattr(model, "pair_repulsion"):
        if type(getattr(model, "pair_repulsion_fn", None)).__name__ != "ZBLBasis":
            return "pair repulsion is not mace's ZBLBasis"
    return None


def nequip_inert_beyond_cutoff(energy_model: torch.nn.Module) -> str | None:
    """The same for a NequIP energy model (the SequentialGraphNetwork inside ForceStressOutput)."""
    if type(energy_model).__name__ != "SequentialGraphNetwork":
        return f"energy model {type(energy_model).__name__} is not a nequip SequentialGraphNetwork"
    for name, module in energy_model._modules.items():
        cls = type(module).__name__
        if cls in _NEQUIP_NODE_MODULES:
            continue
        if cls in _NEQUIP_CUTOFF_MODULES:
            if _class_name(getattr(module, "cutoff", None)) != "PolynomialCutoff":
                return f"{name} ({cls}): its cutoff is not nequip's PolynomialCutoff"
            continue
        if cls == "ConvNetLayer":
            conv = getattr(module, "conv", None)
            if type(conv).__name__ != "InteractionBlock":
                return f"{name}.conv ({type(conv).__name__}) is not nequip's InteractionBlock"
            mlp = conv.edge_mlp
            if not _vanishes_at_zero(mlp, int(mlp.dims[0])):
                return f"{name}.conv.edge_mlp is not zero for zero edge features (bias or activation)"
            continue
        return f"{name} ({cls}) is not a module cgforge has checked"
    return None
