"""The nequip 0.19 graph modules cgforge has read, by class name (packaged models carry their own copies of
nequip's classes, which ``isinstance`` against the installed nequip misses). Imports no nequip code.

- ``NODE_MODULES`` read and write node (and graph) fields, the spherical harmonics and the normalised edge
  lengths: none of them reads the edge embedding or the edge cutoff.
- ``CUTOFF_MODULES`` compute something of an edge's normalised length x times a cutoff of x: the edge
  embedding (``BesselEdgeLengthEncoding``), the edge cutoff, the pair potentials.
"""

from __future__ import annotations

__all__ = ["CUTOFF_MODULES", "NODE_MODULES", "class_name"]

NODE_MODULES = ("NodeTypeEmbed", "ApplyFactor", "ScalarMLP", "AtomwiseLinear", "PerTypeScaleShift",
                "AtomwiseReduce", "AtomwiseOperation", "SphericalHarmonicEdgeAttrs", "EdgeLengthNormalizer")
CUTOFF_MODULES = ("BesselEdgeLengthEncoding", "AddRadialCutoffToData", "ZBL", "LennardJones",
                  "SimpleLennardJones")


def class_name(module: object) -> str:
    """The class name; a TorchScript-compiled module (nequip scripts some) keeps its Python one as original_name."""
    return getattr(module, "original_name", None) or type(module).__name__
