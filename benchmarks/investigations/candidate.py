"""Run a benchmark script with a candidate change turned on, for an A/B before the change lands (``without.py`` is
the other way round: a landed change turned off):

    python3 benchmarks/investigations/candidate.py linear-map-into benchmarks/bench_md.py --systems 5k ...

``linear-map-into-all``: ``patches.e3nn_layers.SplitLinear`` maps every frozen input through ``map_into``
(``MAP_INTO_ABOVE_BYTES`` 0), where the landed rule (2026-11-27) does so from 32 MB of input on. Measured with every
input so (H100, 5,184-atom engine step, four interleaved rounds): MACE-MP-medium 11.43 -> 11.01 ms, NequIP M
8.52 -> 8.46, the bundled MACE 2.98 -> 3.16 (its inputs are 6-17 MB), hence the size rule.

``linear-bmm``: ``SplitLinear`` maps each vector irrep ([rows, mul, 2l+1] rows) with one batched GEMM of the
[mul_out, mul_in] block against every row's [mul_in, 2l+1] block (``torch.bmm``, the block broadcast), where the
landed code moves the irrep to [rows * (2l+1), mul] and back around one GEMM (two transposing copies forward, two
backward: most of the step's direct copies in the profiles of results/engine-profile-h100-20261127j).

The commit rule as two CUDA kernels (``commit-kernels``, measured 2026-11-27 with no gain: results/
suite-ab-h100-20261127g) was removed after its A/B; it lives in git at 475f65b.
"""

from __future__ import annotations

import runpy
import sys
from collections.abc import Callable

CANDIDATES = ("linear-map-into-all", "linear-bmm")


def set_map_into_above(least: Callable[[int], int]) -> Callable[[], None]:
    """``patches.e3nn_layers.MAP_INTO_ABOVE_BYTES`` set to ``least(CHUNKED_ABOVE_BYTES)``; returns the undo."""
    import cgforge.patches.e3nn_layers as layers

    before = layers.MAP_INTO_ABOVE_BYTES
    layers.MAP_INTO_ABOVE_BYTES = least(layers.CHUNKED_ABOVE_BYTES)

    def undo() -> None:
        layers.MAP_INTO_ABOVE_BYTES = before

    return undo


def _bmm_map(block, xi):
    """[rows, mul_in, dim] -> [rows, mul_out, dim]: ``block`` [mul_in, mul_out] against every row, one batched GEMM
    (the block broadcast over the rows: stride 0, no copy; bmm, not matmul, which would fold the rows into one
    GEMM through a transposing copy when xi needs a gradient)."""
    import torch

    rows, mul_in, _ = xi.shape
    return torch.bmm(block.t().unsqueeze(0).expand(rows, block.shape[1], mul_in), xi)


def use_bmm_linears() -> Callable[[], None]:
    """``SplitLinear._map`` and ``map_into`` with ``_bmm_map`` for the vector irreps; returns the undo."""
    import torch

    from cgforge.patches.e3nn_layers import SplitLinear

    before = SplitLinear._map, SplitLinear.map_into

    def _map(self, x, transpose=False):
        in_dims, out_dims = (self.out_dims, self.in_dims) if transpose else (self.in_dims, self.out_dims)
        pieces = x.split(in_dims, dim=-1) if len(in_dims) > 1 else (x,)
        outs = [None] * len(out_dims)
        for i_in, i_out, offset, mul_in, mul_out, path_weight in self.paths:
            w = self.weight.narrow(0, offset, mul_in * mul_out).view(mul_in, mul_out) * path_weight
            if transpose:
                i_in, i_out, mul_in, mul_out, w = i_out, i_in, mul_out, mul_in, w.t()
            xi = pieces[i_in].reshape(x.shape[0], mul_in, -1)
            if xi.shape[2] == 1:
                y = xi.reshape(x.shape[0], mul_in) @ w
            else:
                y = _bmm_map(w, xi).reshape(x.shape[0], -1)
            outs[i_out] = y if outs[i_out] is None else outs[i_out] + y
        return torch.cat([o if o is not None else x.new_zeros(x.shape[0], d) for o, d in zip(outs, out_dims)],
                         dim=-1)

    def map_into(self, x, out, transpose=False):
        in_dims, out_dims = (self.out_dims, self.in_dims) if transpose else (self.in_dims, self.out_dims)
        rows = x.shape[0]
        in_starts = [sum(in_dims[:i]) for i in range(len(in_dims))]
        out_starts = [sum(out_dims[:i]) for i in range(len(out_dims))]
        written = set()
        with torch.no_grad():
            for (i_in, i_out, _, mul_in, mul_out, _), w in zip(self.paths, self._scaled_blocks(), strict=True):
                if transpose:
                    i_in, i_out, mul_in, mul_out, w = i_out, i_in, mul_out, mul_in, w.t()
                dim = in_dims[i_in] // mul_in
                xi = x.narrow(1, in_starts[i_in], in_dims[i_in])
                target = out.narrow(1, out_starts[i_out], out_dims[i_out])
                if dim == 1:
                    target.addmm_(xi, w, beta=1 if i_out in written else 0)
                else:
                    y = _bmm_map(w, xi.view(rows, mul_in, dim)).view(rows, -1)
                    target.add_(y) if i_out in written else target.copy_(y)
                written.add(i_out)
            for i_out, width in enumerate(out_dims):
                if i_out not in written:
                    out.narrow(1, out_starts[i_out], width).zero_()

    SplitLinear._map, SplitLinear.map_into = _map, map_into

    def undo() -> None:
        SplitLinear._map, SplitLinear.map_into = before

    return undo


def turn_on(name: str) -> Callable[[], None]:
    """Turn candidate ``name`` on in this process (before the script builds its models); returns what turns it
    off again (``tuning_ab.py`` interleaves a candidate with the code as it is)."""
    if name not in CANDIDATES:
        raise SystemExit(f"candidate.py: unknown candidate {name!r}; choose from {', '.join(CANDIDATES)}")
    if name == "linear-bmm":
        return use_bmm_linears()
    return set_map_into_above(lambda chunked: 0)


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(f"usage: candidate.py {{{','.join(CANDIDATES)}}} SCRIPT [ARGS...]")
    turn_on(sys.argv[1])
    script, sys.argv = sys.argv[2], sys.argv[2:]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
