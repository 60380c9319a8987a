"""Everything cgforge knows about MACE (mace-torch 0.3.x).

- ``patch``: swapping cgforge's kernels into a MACE model, unpatching, loading ``.model`` files.
- ``legacy``: reading ``.model`` files pickled with e3nn 0.4 under the installed e3nn.
- ``streaming``: the radial MLP inside the convolution, per chunk of edges (``set_streaming``).
- ``radial_table``: each block's weights read from a table of the edge length (``set_radial_table``).
- ``adapter``: the calculator's ``MaceAdapter`` and the check that edges beyond the cutoff are inert.
- ``symmetric_contraction``: ``SymmetricContraction`` (MACE's U tensors and state-dict layout over
  cgforge's symmetric-contraction kernels; ``cgforge.patches.mace.SymmetricContraction`` is its public name:
  kernels/ names nothing of the patches).

The names below are this package's public API; the family registry (``cgforge.patches.families.MACE``)
calls ``load_mace``, ``upgrade_old_attributes``, ``patch``, ``unpatch`` and ``is_patched``. The class paths
patched pickles name are listed, and tested, in ``cgforge._moved.PICKLED_CLASSES``. Note that the name
``patch`` here is the function; the module is ``cgforge.patches.mace.patch`` in ``sys.modules``.
"""

from .patch import (
    SUPPORTED_INTERACTIONS,
    FusedConvTP,
    FusedSymmetricContraction,
    GraphCache,
    UnsupportedModelError,
    interaction_blocks,
    is_mace_model,
    is_patched,
    load_mace,
    parse_device,
    parse_dtype,
    patch,
    unpatch,
    upgrade_old_attributes,
)
from .radial_table import set_radial_table
from .streaming import set_streaming
from .symmetric_contraction import SymmetricContraction, mace_problem, mace_u_matrices

__all__ = [
    "SUPPORTED_INTERACTIONS", "FusedConvTP", "FusedSymmetricContraction", "GraphCache", "SymmetricContraction",
    "UnsupportedModelError", "interaction_blocks", "is_mace_model", "is_patched", "load_mace", "mace_problem",
    "mace_u_matrices", "parse_device", "parse_dtype", "patch", "set_radial_table", "set_streaming", "unpatch",
    "upgrade_old_attributes",
]
