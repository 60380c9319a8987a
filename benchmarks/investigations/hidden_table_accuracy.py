"""How accurate is W(r) = h(r) A, the radial MLP's last hidden layer tabulated and its last linear layer applied per
edge, against today's table of W itself, in the arithmetic a kernel would use (issue 62, docs/convolution-bytes.md,
candidate (c)). CPU only, FP64 reference.

    python3 benchmarks/investigations/hidden_table_accuracy.py [--width 1280] [--points 200000] [--seed 0]

The radial MLP is MACE's shape with random weights (``bench_radial_table.mlp_of_r``: an 8-function Bessel basis
times the polynomial cutoff, 8 -> 64 -> 64 -> 64 -> width, SiLU). Both tables are fitted to 1e-7 by
``fit_radial_table`` (FP64 fit, stored in FP32 as the kernels read them). Per variant, at ``--points`` random lengths
in (0, r_max]: the largest |error| of the weights W and of their slopes dW/dr over the largest |W| and |dW/dr|
(``fit_radial_table``'s measure, relative to the function's scale), each against the FP64 MLP:

- ``W table, FP32``: today's table of W evaluated in FP32 (what the convolution kernels do);
- ``h table, FP32 h A``: the hidden table evaluated in FP32, then h A in FP32 (CUDA cores);
- ``h table, 1xTF32``: h and A rounded to TF32 (10-bit mantissa) before the product, FP32 sums (one tensor-core MMA);
- ``h table, 3xTF32``: h_hi A_hi + h_hi A_lo + h_lo A_hi with hi = TF32(x), lo = TF32(x - hi) (three MMAs).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_radial_table import R_MAX, mlp_of_r  # noqa: E402

from cgforge.kernels.radial_table import fit_radial_table  # noqa: E402
from cgforge.kernels.radial_table.ops import radial_table_reference  # noqa: E402


def tf32(x: torch.Tensor) -> torch.Tensor:
    """FP32 values rounded to nearest (ties away) at TF32's 10 mantissa bits, as FP32."""
    bits = x.to(torch.float32).contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


def relative(err: torch.Tensor, scale: torch.Tensor) -> float:
    return float(err.abs().max() / scale.abs().max())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=1280, help="weights an edge (MACE-MP-medium layer 2: 1,280)")
    parser.add_argument("--points", type=int, default=200_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.width < 1 or args.points < 1:
        parser.error("--width and --points must be positive")
    g = torch.Generator().manual_seed(args.seed)
    mlp = mlp_of_r(args.width, g).double()
    a = mlp.weights[-1].detach()  # the last linear layer [64, width]
    w_table = fit_radial_table(mlp, R_MAX, tol=1e-7)
    h_table = fit_radial_table(mlp.hidden, R_MAX, tol=1e-7)
    r = (torch.rand(args.points, generator=g, dtype=torch.float64) * 0.999 + 0.001) * R_MAX

    exact_w, exact_s = torch.func.jvp(mlp, (r,), (torch.ones_like(r),))
    r32 = r.float()

    def table(coeffs: torch.Tensor, order: int) -> torch.Tensor:  # the table's FP32 coefficients in FP32 arithmetic
        return radial_table_reference(r32, coeffs.float(), R_MAX, order)

    h, hs = table(h_table.coeffs, 0), table(h_table.coeffs, 1)
    a32 = a.float()
    hi_h, hi_hs, hi_a = tf32(h), tf32(hs), tf32(a32)
    lo_h, lo_hs, lo_a = tf32(h - hi_h), tf32(hs - hi_hs), tf32(a32 - hi_a)
    variants = {
        "W table, FP32": (table(w_table.coeffs, 0), table(w_table.coeffs, 1)),
        "h table, FP32 h A": (h @ a32, hs @ a32),
        "h table, 1xTF32": (hi_h @ hi_a, hi_hs @ hi_a),
        "h table, 3xTF32": (hi_h @ hi_a + hi_h @ lo_a + lo_h @ hi_a, hi_hs @ hi_a + hi_hs @ lo_a + lo_hs @ hi_a),
    }
    print(f"width {args.width}; W table {w_table.intervals} intervals x {w_table.columns} columns "
          f"({w_table.coeffs.numel() * 4 / 2**20:.1f} MB FP32, fit error {w_table.value_error:.1e} / "
          f"{w_table.slope_error:.1e}); h table {h_table.intervals} x {h_table.columns} "
          f"({h_table.coeffs.numel() * 4 / 2**20:.2f} MB, fit error {h_table.value_error:.1e} / "
          f"{h_table.slope_error:.1e}); {args.points} lengths")
    print(f"{'variant':<22} {'values':>9} {'slopes':>9}   (largest |error| / largest |exact|, against the FP64 MLP)")
    for name, (w, s) in variants.items():
        print(f"{name:<22} {relative(w.double() - exact_w, exact_w):>9.2e} {relative(s.double() - exact_s, exact_s):>9.2e}")


if __name__ == "__main__":
    main()
