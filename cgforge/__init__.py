"""cgforge: JIT CUDA kernels for Clebsch-Gordan tensor products, patches for MACE and NequIP, an ASE
calculator and MD."""

import sys as _sys

from ._moved import MovedPackageFinder as _MovedPackageFinder

__version__ = "0.2.0"  # keep equal to pyproject.toml's version (tests/test_cli_md.py checks)

if not any(isinstance(f, _MovedPackageFinder) for f in _sys.meta_path):
    _sys.meta_path.append(_MovedPackageFinder())
