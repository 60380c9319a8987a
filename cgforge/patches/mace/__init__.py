"""Everything cgforge knows about MACE (mace-torch 0.3.x): ``patch`` (patch, unpatch, load ``.model`` files),
``legacy`` (e3nn 0.4 pickles), ``streaming`` and ``radial_table`` (the radial MLP per chunk of edges, or as a
table), ``adapter`` (the calculator's ``MaceAdapter``), ``symmetric_contraction`` (MACE's U tensors and layout
over cgforge's kernels). The class paths patched pickles name: ``cgforge._moved.PICKLED_CLASSES``.
"""

from .patch import (
    SUPPORTED_INTERACTIONS,
    FusedConvTP,
    FusedSymmetricContraction,
    GraphCache,
    UnsupportedModelError,
    is_mace_model,
    is_patched,
    load_mace,
    patch,
    unpatch,
    upgrade_old_attributes,
)
from .radial_table import set_radial_table
from .streaming import set_streaming
from .symmetric_contraction import SymmetricContraction

__all__ = ["SUPPORTED_INTERACTIONS", "FusedConvTP", "FusedSymmetricContraction", "GraphCache", "SymmetricContraction",
           "UnsupportedModelError", "is_mace_model", "is_patched", "load_mace", "patch", "set_radial_table",
           "set_streaming", "unpatch", "upgrade_old_attributes"]
