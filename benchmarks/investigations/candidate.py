"""Run a benchmark script with a candidate change turned on, for an A/B before the change lands (``without.py`` is
the other way round: a landed change turned off):

    python3 benchmarks/investigations/candidate.py linear-map-into benchmarks/bench_md.py --systems 5k ...

``linear-map-into-all``: ``patches.e3nn_layers.SplitLinear`` maps every frozen input through ``map_into``
(``MAP_INTO_ABOVE_BYTES`` 0), where the landed rule (2026-11-27) does so from 32 MB of input on. Measured with every
input so (H100, 5,184-atom engine step, four interleaved rounds): MACE-MP-medium 11.43 -> 11.01 ms, NequIP M
8.52 -> 8.46, the bundled MACE 2.98 -> 3.16 (its inputs are 6-17 MB), hence the size rule.
Which linear maps take the irreps_linear kernel is a tuning value, not a candidate: ``tuning_ab.py --tuning
gemms='{"linear_kernel_max_channels": 0}' --tuning all='{"linear_kernel_max_channels": 1048576}'``
(``KernelTuning.linear_kernel_max_channels``; 32 landed 2026-11-28). Measured and not kept: maps of at most 4,096
multiply-adds a row on the kernel (H200: MACE-MP-medium 9.08 ms, bundled MACE 2.81, NequIP M 7.21, where all GEMMs
gave 9.03, 2.84, 7.18 and maps up to 32,768 on the kernel 9.24, 2.68, 7.32; results/irreps-linear-ab-h200-20261128).
The kernel with 4 output channels a thread (branch ``candidate/linear-tiles``, its patch in
results/linear-tiles-ab-h200-20261128) on every map: MACE-MP-medium 10.92 ms, NequIP M 8.17, where GEMMs gave 8.53
and 6.80 (H200, 2026-11-28); not kept.

Measured with no gain and removed (their code lives in git at 7e81869; results/prefetch-bmm-ab-h100-20261128a):
``TPTuning.prefetch_next_edge`` (each CSR kernel read the next edge's ids ahead and asked its table columns, y, x
and grad-out lines into L1 with ``prefetch.global.L1`` while computing one edge) took the engine step from 10.99
to 14.44 ms on MACE-MP-medium, 8.37 to 9.75 on NequIP M, 2.65 to 2.83 on the bundled MACE; ``linear-bmm``
(``SplitLinear``'s vector irreps as one ``torch.bmm`` of the broadcast block against every row's [mul, 2l+1]
block, no transposing copies) 13.98, 9.52 and 2.79 ms. ``table-tol-1e-6`` (the radial tables fitted to 1e-6: half
the intervals and bytes) answered whether their footprint costs time: 2-6 % (results/table-tol-ab-h100-20261128b;
its code at 82930d7), not enough to give up an error below FP32's resolution. ``y-in-registers`` (an edge's in2
row read into registers once per staging, not from shared memory per term; its patch in
results/y-registers-ab-h200-20261128) raised the forward's registers and made MACE-MP-medium's step 9.12 -> 9.60
ms, NequIP M 7.89 -> 7.96 (H200, 2026-11-28).

The commit rule as two CUDA kernels (``commit-kernels``, measured 2026-11-27 with no gain in runs of their own:
results/suite-ab-h100-20261127g) was removed after that A/B (git 475f65b). Rewritten with the Langevin halves
(``kernels/md_step.py``) and measured interleaved with the torch expressions in one process (``without.py md-step``,
results/step-glue-ab-h200-20261128): 0.04-0.14 ms a step in every model and both calls, landed 2026-11-28.
"""

from __future__ import annotations

import runpy
import sys
from collections.abc import Callable

CANDIDATES = ("linear-map-into-all",)


def set_map_into_above(least: Callable[[int], int]) -> Callable[[], None]:
    """``patches.e3nn_layers.MAP_INTO_ABOVE_BYTES`` set to ``least(CHUNKED_ABOVE_BYTES)``; returns the undo."""
    import cgforge.patches.e3nn_layers as layers

    before = layers.MAP_INTO_ABOVE_BYTES
    layers.MAP_INTO_ABOVE_BYTES = least(layers.CHUNKED_ABOVE_BYTES)

    def undo() -> None:
        layers.MAP_INTO_ABOVE_BYTES = before

    return undo


def turn_on(name: str) -> Callable[[], None]:
    """Turn candidate ``name`` on in this process (before the script builds its models); returns what turns it
    off again (``tuning_ab.py`` interleaves a candidate with the code as it is)."""
    if name not in CANDIDATES:
        raise SystemExit(f"candidate.py: unknown candidate {name!r}; choose from {', '.join(CANDIDATES)}")
    return set_map_into_above(lambda chunked: 0)


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(f"usage: candidate.py {{{','.join(CANDIDATES)}}} SCRIPT [ARGS...]")
    turn_on(sys.argv[1])
    script, sys.argv = sys.argv[2], sys.argv[2:]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
