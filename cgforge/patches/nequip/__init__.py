"""Everything cgforge knows about NequIP (nequip >= 0.19), one module per job: ``files`` (recognise and read
checkpoints), ``conv`` (the convolution stand-in), ``patch`` (and the ``enable_cgforge`` modifier), ``verify``,
``load``, ``package`` (the ``.nequip.zip`` writer), ``streaming``, ``radial_table``, ``modules`` (the classes read,
by name), ``adapter`` (the calculator's). The class paths patched packages name: ``cgforge._moved.PICKLED_CLASSES``.
"""

from ..common import UnsupportedModelError
from .conv import CgforgeTensorProductScatter
from .files import CompiledModelError, check_dtype, load_models
from .load import load_nequip
from .package import save_patched_nequip
from .patch import enable_cgforge, is_patched, patch, unpatch
from .radial_table import set_radial_table
from .verify import verify_patch

__all__ = ["CgforgeTensorProductScatter", "CompiledModelError", "UnsupportedModelError", "check_dtype",
           "enable_cgforge", "is_patched", "load_models", "load_nequip", "patch", "save_patched_nequip",
           "set_radial_table", "unpatch", "verify_patch"]
