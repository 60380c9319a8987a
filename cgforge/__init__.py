"""cgforge: JIT CUDA kernels for Clebsch-Gordan tensor products, patches for MACE and NequIP, an ASE
calculator and MD."""

__version__ = "0.2.0"  # keep equal to pyproject.toml's version (tests/test_cli_md.py checks)
