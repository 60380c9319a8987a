"""Run a benchmark script with a candidate change turned on, for an A/B before the change lands (``without.py`` is
the other way round: a landed change turned off):

    python3 benchmarks/investigations/candidate.py linear-map-into benchmarks/bench_md.py --systems 5k ...

``linear-map-into-all``: ``patches.e3nn_layers.SplitLinear`` maps every frozen input through ``map_into``
(``MAP_INTO_ABOVE_BYTES`` 0), where the landed rule (2026-11-27) does so from 32 MB of input on. Measured with every
input so (H100, 5,184-atom engine step, four interleaved rounds): MACE-MP-medium 11.43 -> 11.01 ms, NequIP M
8.52 -> 8.46, the bundled MACE 2.98 -> 3.16 (its inputs are 6-17 MB), hence the size rule.

``table-tol-1e-6``: the radial tables fitted to a relative error of 1e-6 instead of ``DEFAULT_TOL`` (1e-7): half the
intervals, half the table's bytes (MACE-MP-medium's second layer: 2048 -> 1024 intervals, 42 -> 21 MB), the same
bytes read per edge. Not a change to land as it is (the error passes FP32's resolution); it asks whether the
tables' footprint in the L2 costs time, which a table of knots (values and slopes, half the bytes at the same
error) would then win back.

Measured with no gain and removed (their code lives in git at 7e81869; results/prefetch-bmm-ab-h100-20261128a):
``TPTuning.prefetch_next_edge`` (each CSR kernel read the next edge's ids ahead and asked its table columns, y, x
and grad-out lines into L1 with ``prefetch.global.L1`` while computing one edge) took the engine step from 10.99
to 14.44 ms on MACE-MP-medium, 8.37 to 9.75 on NequIP M, 2.65 to 2.83 on the bundled MACE; ``linear-bmm``
(``SplitLinear``'s vector irreps as one ``torch.bmm`` of the broadcast block against every row's [mul, 2l+1]
block, no transposing copies) 13.98, 9.52 and 2.79 ms.

The commit rule as two CUDA kernels (``commit-kernels``, measured 2026-11-27 with no gain: results/
suite-ab-h100-20261127g) was removed after its A/B; it lives in git at 475f65b.
"""

from __future__ import annotations

import runpy
import sys
from collections.abc import Callable

CANDIDATES = ("linear-map-into-all", "table-tol-1e-6")


def set_map_into_above(least: Callable[[int], int]) -> Callable[[], None]:
    """``patches.e3nn_layers.MAP_INTO_ABOVE_BYTES`` set to ``least(CHUNKED_ABOVE_BYTES)``; returns the undo."""
    import cgforge.patches.e3nn_layers as layers

    before = layers.MAP_INTO_ABOVE_BYTES
    layers.MAP_INTO_ABOVE_BYTES = least(layers.CHUNKED_ABOVE_BYTES)

    def undo() -> None:
        layers.MAP_INTO_ABOVE_BYTES = before

    return undo


def set_table_tolerance(tol: float) -> Callable[[], None]:
    """Both families' ``set_radial_table`` fitting their tables to ``tol``; returns the undo."""
    import functools

    from cgforge.patches.mace import radial_table as mace_tables
    from cgforge.patches.nequip import radial_table as nequip_tables

    before = [(module, module.set_radial_table) for module in (mace_tables, nequip_tables)]
    for module, fit in before:
        module.set_radial_table = functools.partial(fit, tol=tol)

    def undo() -> None:
        for module, fit in before:
            module.set_radial_table = fit

    return undo


def turn_on(name: str) -> Callable[[], None]:
    """Turn candidate ``name`` on in this process (before the script builds its models); returns what turns it
    off again (``tuning_ab.py`` interleaves a candidate with the code as it is)."""
    if name not in CANDIDATES:
        raise SystemExit(f"candidate.py: unknown candidate {name!r}; choose from {', '.join(CANDIDATES)}")
    if name == "table-tol-1e-6":
        return set_table_tolerance(1e-6)
    return set_map_into_above(lambda chunked: 0)


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(f"usage: candidate.py {{{','.join(CANDIDATES)}}} SCRIPT [ARGS...]")
    turn_on(sys.argv[1])
    script, sys.argv = sys.argv[2], sys.argv[2:]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
