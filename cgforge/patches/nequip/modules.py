"""The nequip 0.19 graph modules cgforge has read, by class name (packaged models carry their own copies of the
classes). ``NODE_MODULES`` read and write node and graph fields, the harmonics and the normalised lengths, never
the edge embedding or cutoff; ``CUTOFF_MODULES`` compute a function of x = r / r_max times a cutoff of x.
"""

from __future__ import annotations

NODE_MODULES = ("NodeTypeEmbed", "ApplyFactor", "ScalarMLP", "AtomwiseLinear", "PerTypeScaleShift",
                "AtomwiseReduce", "AtomwiseOperation", "SphericalHarmonicEdgeAttrs", "EdgeLengthNormalizer")
CUTOFF_MODULES = ("BesselEdgeLengthEncoding", "AddRadialCutoffToData", "ZBL", "LennardJones", "SimpleLennardJones")


def class_name(module: object) -> str:
    """The class name; a TorchScript-compiled module (nequip scripts some) keeps its Python one as original_name."""
    return getattr(module, "original_name", None) or type(module).__name__
