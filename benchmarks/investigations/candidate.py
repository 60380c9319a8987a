"""Run a benchmark script with a candidate change turned on, for an A/B before the change lands (``without.py`` is
the other way round: a landed change turned off):

    python3 benchmarks/investigations/candidate.py linear-map-into benchmarks/bench_md.py --systems 5k ...

``linear-map-into``: ``patches.e3nn_layers.SplitLinear`` maps every input through ``map_into`` when its weights are
frozen (one chunk of all rows: GEMMs writing the output's columns in place, no concatenation, the path weights
folded once), where today only inputs above ``CHUNKED_ABOVE_BYTES`` do. ``linear_rows.py`` measured map_into at
0.41-1.05 ms against ``_map``'s 0.59-1.46 ms on 13,107 rows of MACE-MP-medium's block linears (H100, 2026-11-26);
the eager engine step runs 186-234 of ``_map``'s ops (``kernel_sources.py``, 2026-11-27).

The commit rule as two CUDA kernels (``commit-kernels``, measured 2026-11-27 with no gain: results/
suite-ab-h100-20261127g) was removed after its A/B; it lives in git at 475f65b.
"""

from __future__ import annotations

import runpy
import sys

CANDIDATES = ("linear-map-into",)


def turn_on(name: str) -> None:
    """Turn candidate ``name`` on in this process (before the script builds its models)."""
    if name not in CANDIDATES:
        raise SystemExit(f"candidate.py: unknown candidate {name!r}; choose from {', '.join(CANDIDATES)}")
    if name == "linear-map-into":
        import torch

        from cgforge.patches.e3nn_layers import SplitLinear

        chunk_rows = SplitLinear.chunk_rows

        def all_rows_when_frozen(self: SplitLinear, x: torch.Tensor) -> int | None:
            rows = chunk_rows(self, x)
            if rows is not None or (self.weight.requires_grad and torch.is_grad_enabled()) \
                    or torch.compiler.is_compiling():
                return rows
            return max(x.shape[0], 1)

        SplitLinear.chunk_rows = all_rows_when_frozen


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(f"usage: candidate.py {{{','.join(CANDIDATES)}}} SCRIPT [ARGS...]")
    turn_on(sys.argv[1])
    script, sys.argv = sys.argv[2], sys.argv[2:]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
