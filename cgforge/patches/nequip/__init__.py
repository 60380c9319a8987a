"""Everything cgforge knows about NequIP (nequip >= 0.19), one module per job: ``files`` (recognise and read
checkpoints), ``conv`` (the convolution stand-in), ``patch`` (and the ``enable_cgforge`` modifier), ``verify``,
``load``, ``package`` (the ``.nequip.zip`` writer), ``streaming``, ``radial_table``, ``modules`` (the classes read,
by name), ``adapter`` (the calculator's). The class paths patched packages name: ``cgforge._moved.PICKLED_CLASSES``.
"""

from ..common import UnsupportedModelError
from .conv import CgforgeTensorProductScatter
from .files import (
    CHECKPOINT_SUFFIX,
    COMPILED_SUFFIXES,
    PACKAGE_SUFFIX,
    SOLE_MODEL,
    CompiledModelError,
    check_dtype,
    is_compiled_nequip_file,
    is_nequip_file,
    load_models,
)
from .load import load_nequip
from .package import save_patched_nequip
from .patch import enable_cgforge, is_patched, patch, unpatch
from .radial_table import set_radial_table
from .verify import probe_structure, verify_patch

__all__ = [
    "CHECKPOINT_SUFFIX", "COMPILED_SUFFIXES", "PACKAGE_SUFFIX", "SOLE_MODEL",
    "CgforgeTensorProductScatter", "CompiledModelError", "UnsupportedModelError", "check_dtype", "enable_cgforge",
    "is_compiled_nequip_file", "is_nequip_file", "is_patched", "load_models", "load_nequip", "patch",
    "probe_structure", "save_patched_nequip", "set_radial_table", "unpatch", "verify_patch",
]
