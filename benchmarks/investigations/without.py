"""Run a benchmark script with one cgforge stand-in turned off, for an A/B in the same process kind and run:

    python3 benchmarks/investigations/without.py reshape benchmarks/bench_md.py --systems 5k ...

``reshape``: MACE's reshape_irreps stays MACE's (``patches.mace.reshape.BlockReshape`` declines every module).
``linear-map-into``: ``SplitLinear`` maps frozen inputs through ``map_into`` only above ``CHUNKED_ABOVE_BYTES``, as
before 2026-11-27 (``MAP_INTO_ABOVE_BYTES`` out of reach).
``gate``: e3nn's ``Gate`` stays e3nn's (``patches.gate.swap_in`` replaces none), as before 2026-11-28.
``md-step``: the engine's Langevin halves and commit check run as torch operations (``kernels.md_step``'s
references: its ``_on_step_kernels`` says no), as before 2026-11-28.
``edge-layout``: a step's edges are cut and laid out by torch operations (``edges_within`` and ``layout_edges``;
``kernels.edge_layout._on_layout_kernels`` says no), as before 2026-11-28.
``cell-search``: the neighbour search's candidate loop runs as torch operations on the GPU
(``kernels.cell_search``'s reference: its ``_on_search_kernels`` says no), as before 2026-11-29.
``pair-reverse``: a rebuild's edge topology finds the reverse pairs by a sort of int64 keys (``kernels.pair_reverse``'s
reference: its ``_on_reverse_kernel`` says no), as before (branch next/pair-reverse).
``lean-forward``: the MACE adapter calls MACE's own forward (``patches.mace.lean_forward.why_not_lean`` declines
every model), as before 2026-11-28.
``linear-scaled``: ``SplitLinear._map`` multiplies each path's weight block by its path weight in every call, as
before 2026-11-28 (the blocks of frozen weights are not reused).
``irreps-layout``: the layout moves of ``kernels.irreps_layout`` run as torch copies (``_on_layout_kernel`` says
no): ``SplitLinear.map_into`` one copy per l > 0 irrep block and side, not one launch (each input block still once,
before 2026-12-02 once per path), MACE's ``reshape_irreps`` a concatenation forward and a copy per irrep backward,
not one launch each way.
Kernel choices are not turned off here: they are ``KernelTuning`` values (``linear_kernel_max_channels`` 0: every
linear map on GEMMs, as before 2026-11-28), ``TPTuning`` values (``single_irrep_backward_chunk``,
``backward_chunk_passes``, ...) passed to the kernels; ``bench_layer.py --tuning`` measures them side by side.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # candidate.py beside it

OFF = ("reshape", "linear-map-into", "gate", "linear-scaled", "md-step", "edge-layout", "lean-forward",
       "cell-search", "pair-reverse", "irreps-layout")


def turn_off(name: str) -> Callable[[], None]:
    """Turn the landed change ``name`` off in this process (before the script builds its models); returns what
    turns it on again (``tuning_ab.py`` interleaves the two)."""
    if name not in OFF:
        raise SystemExit(f"without.py: unknown change {name!r} to turn off; choose from {', '.join(OFF)}")
    if name == "reshape":
        from cgforge.patches.mace.reshape import BlockReshape

        supports = BlockReshape.__dict__["supports"]
        BlockReshape.supports = classmethod(lambda cls, module: False)

        def undo() -> None:
            BlockReshape.supports = supports
    elif name == "gate":
        from cgforge.patches import gate

        swap_in = gate.swap_in
        gate.swap_in = lambda model: 0

        def undo() -> None:
            gate.swap_in = swap_in
    elif name == "md-step":
        from cgforge.kernels import md_step

        on_kernels = md_step._on_step_kernels
        md_step._on_step_kernels = lambda *tensors, dtypes=None: False

        def undo() -> None:
            md_step._on_step_kernels = on_kernels
    elif name == "edge-layout":
        from cgforge.kernels import edge_layout

        on_kernels = edge_layout._on_layout_kernels
        edge_layout._on_layout_kernels = lambda positions, topology: False

        def undo() -> None:
            edge_layout._on_layout_kernels = on_kernels
    elif name == "cell-search":
        from cgforge.kernels import cell_search

        on_kernels = cell_search._on_search_kernels
        cell_search._on_search_kernels = lambda positions: False

        def undo() -> None:
            cell_search._on_search_kernels = on_kernels
    elif name == "pair-reverse":
        from cgforge.kernels import pair_reverse

        on_kernel = pair_reverse._on_reverse_kernel
        pair_reverse._on_reverse_kernel = lambda sender: False

        def undo() -> None:
            pair_reverse._on_reverse_kernel = on_kernel
    elif name == "lean-forward":
        from cgforge.patches.mace import lean_forward

        why_not = lean_forward.why_not_lean
        lean_forward.why_not_lean = lambda model: "turned off by without.py"

        def undo() -> None:
            lean_forward.why_not_lean = why_not
    elif name == "linear-scaled":
        from cgforge.patches.e3nn_layers import SplitLinear

        blocks = SplitLinear._path_blocks
        SplitLinear._path_blocks = lambda self: [None] * len(self.paths)  # None: _map multiplies in the call

        def undo() -> None:
            SplitLinear._path_blocks = blocks
    elif name == "irreps-layout":
        from cgforge.kernels import irreps_layout

        on_kernel = irreps_layout._on_layout_kernel
        irreps_layout._on_layout_kernel = lambda t, run: False

        def undo() -> None:
            irreps_layout._on_layout_kernel = on_kernel
    else:  # the size rule out of reach: map_into only where rows are chunked
        from candidate import set_map_into_above

        undo = set_map_into_above(lambda chunked: chunked + 1)
    return undo


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(f"usage: without.py {{{','.join(OFF)}}} SCRIPT [ARGS...]")
    turn_off(sys.argv[1])
    script, sys.argv = sys.argv[2], sys.argv[2:]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
