"""Run a benchmark script with one cgforge stand-in turned off, for an A/B in the same process kind and run:

    python3 benchmarks/investigations/without.py reshape benchmarks/bench_md.py --systems 5k ...

``reshape``: MACE's reshape_irreps stays MACE's (``patches.mace.reshape.BlockReshape`` declines every module).
Kernel choices are not turned off here: they are ``TPTuning`` values (``single_irrep_backward_chunk``,
``backward_chunk_passes``, ...) passed to the kernels; ``bench_layer.py --tuning`` measures them side by side.
"""

from __future__ import annotations

import runpy
import sys

OFF = ("reshape",)


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(f"usage: without.py {{{','.join(OFF)}}} SCRIPT [ARGS...]")
    if sys.argv[1] not in OFF:
        sys.exit(f"without.py: unknown change {sys.argv[1]!r} to turn off; choose from {', '.join(OFF)}")
    if sys.argv[1] == "reshape":
        from cgforge.patches.mace.reshape import BlockReshape

        BlockReshape.supports = classmethod(lambda cls, module: False)
    script, sys.argv = sys.argv[2], sys.argv[2:]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
