"""Everything cgforge knows about NequIP (nequip >= 0.19), one module per job.

- ``files``: recognising ``.ckpt`` / ``.nequip.zip`` (and refusing compiled models), reading them unpatched;
- ``conv``: NequIP's convolution (``TensorProductScatter``) and cgforge's ``CgforgeTensorProductScatter``;
- ``patch``: patch / unpatch a model, the ``enable_cgforge`` model modifier;
- ``verify``: a patched model against the plain one on a small structure;
- ``load``: ``load_nequip`` (files -> patch -> verify);
- ``package``: ``save_patched_nequip``, the ``.nequip.zip`` writer;
- ``streaming``: the edge MLPs inside the convolution, per chunk of edges (``set_streaming``);
- ``radial_table``: each block's weights read from a table of the edge length (``set_radial_table``);
- ``modules``: the nequip modules cgforge has read, by class name;
- ``adapter``: the calculator's ``NequipAdapter`` and the inert-edge check.

Three ways in: the ``enable_cgforge`` model modifier (registered by ``cgforge.patches.nequip_modifier``
through nequip's ``nequip.extension`` entry point), ``load_nequip(path)``, and ``save_patched_nequip``.
The names below are the package's API; the family registry (``cgforge.patches.families.NEQUIP``) calls
``load_nequip``, ``check_dtype``, ``patch``, ``unpatch``, ``is_patched`` and ``save_patched_nequip``. The class
paths patched packages name are listed, and tested, in ``cgforge._moved.PICKLED_CLASSES``. The name ``patch``
here is the function; the module is ``cgforge.patches.nequip.patch`` in ``sys.modules``.
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
