"""The benchmark and test problem set (as e3nn TensorProduct arguments).

``PROBLEMS``: the tensor products the tests check against e3nn and the benchmarks time; ``MODEL_LAYERS``: real
models' convolutions (bench_layer.py). Each value is ``(irreps_in1, irreps_in2, irreps_out, instructions)``.
"""

from __future__ import annotations

from e3nn import o3


def channelwise(irreps_in1: str, irreps_in2: str, irreps_out: str) -> tuple:
    """uvu with every allowed path into a filtered, sorted output (OpenEquivariance's convention)."""
    i1, i2, io_filter = o3.Irreps(irreps_in1), o3.Irreps(irreps_in2), o3.Irreps(irreps_out)
    out, instructions = [], []
    for a, (mul, ir1) in enumerate(i1):
        for b, (_, ir2) in enumerate(i2):
            for ir in ir1 * ir2:
                if ir in io_filter:
                    instructions.append((a, b, len(out), "uvu", True))
                    out.append((mul, ir))
    out_irreps, perm, _ = o3.Irreps(out).sort()
    instructions = [(a, b, perm[c], m, t) for a, b, c, m, t in instructions]
    return i1, i2, out_irreps, instructions


def fully_connected(irreps_in1: str, irreps_in2: str, irreps_out: str) -> tuple:
    """uvw with every allowed path (as o3.FullyConnectedTensorProduct builds them)."""
    i1, i2, io = o3.Irreps(irreps_in1), o3.Irreps(irreps_in2), o3.Irreps(irreps_out)
    instructions = [(a, b, c, "uvw", True) for a, (_, r1) in enumerate(i1) for b, (_, r2) in enumerate(i2)
                    for c, (_, r3) in enumerate(io) if r3 in r1 * r2]
    return i1, i2, io, instructions


PROBLEMS = {
    "mace-large": channelwise("128x0e+128x1o+128x2e", "1x0e+1x1o+1x2e+1x3o", "128x0e+128x1o+128x2e+128x3o"),
    "mace-medium": channelwise("128x0e+128x1o", "1x0e+1x1o+1x2e+1x3o", "128x0e+128x1o+128x2e"),
    "nequip-water": channelwise("32x0o+32x0e+32x1o+32x1e", "0e+1o", "32x0o+32x0e+32x1o+32x1e"),
    "nequip-benzene": channelwise("64x0o+64x0e+64x1o+64x1e+64x2o+64x2e+64x3o+64x3e", "0e+1o+2e+3o",
                                  "64x0o+64x0e+64x1o+64x1e+64x2o+64x2e+64x3o+64x3e"),
    "nequip-lmax2": channelwise("64x0e+64x1o+64x2e", "0e+1o+2e", "64x0e+64x1o+64x2e"),
    "nequip-presetM": channelwise("128x0e+64x1o+32x2e", "0e+1o+2e", "128x0e+64x1o+32x2e"),
    "nequip-lmax1-parity": channelwise("32x0e+32x0o+32x1e+32x1o", "0e+1o", "32x0e+32x0o+32x1e+32x1o"),
    "diffdock-L1": fully_connected("10x1o+10x1e+48x0e+48x0o", "1x0e+1x1o", "10x1o+10x1e+48x0e+48x0o"),
    "diffdock-L2": fully_connected("10x1o+10x1e+48x0e+48x0o+10x2e+10x2o", "1x0e+1x1o+1x2e",
                                   "10x1o+10x1e+48x0e+48x0o+10x2e+10x2o"),
    "tetris-poly": fully_connected("1x0e+1x1o+1x2e+1x3o", "1x0e+1x1o+1x2e+1x3o", "16x0e+8x1o+4x2e+2x3o"),
}

# Convolutions of real models as they build them, for the per-layer benchmark (not in the test matrix: the
# model tests run them): MACE-MP-medium's two interactions, every path into 0e+1o+2e+3o; the bundled water MACE's
# second (cgforge/models/water-mace.model).
MODEL_LAYERS = {"mace-water-l2": channelwise("32x0e+32x1o", "1x0e+1x1o+1x2e", "32x0e+32x1o+32x2e"),
                "mace-mp-medium-l1": channelwise("128x0e", "1x0e+1x1o+1x2e+1x3o", "128x0e+128x1o+128x2e+128x3o"),
                "mace-mp-medium-l2": channelwise("128x0e+128x1o", "1x0e+1x1o+1x2e+1x3o", "128x0e+128x1o+128x2e+128x3o")}
