"""Hashes of the generated CUDA source of every symmetric-contraction problem cgforge's tests and benchmarks use.

A refactoring check that needs no GPU: run it before and after a change and diff the output; equal lines
mean the generated kernels are byte-identical (the kernel names hash the U tensors' bytes, so a change in
how U is built shows too). Problems: the MACE-MP shapes of tests/test_symmetric_contraction.py and
benchmarks/bench_symmetric_contraction.py, built by cgforge (default dtype float64 and float32) and
adopted from MACE's module (float64 and float32), a non-default tuning, and the contractions of the
bundled MACE water model once patched.

    python scripts/sc_source_hashes.py [--no-mace] > hashes.txt
"""

from __future__ import annotations

import argparse
import hashlib
import sys

import torch
from e3nn import o3

from cgforge.kernels import SCTuning
from cgforge.kernels.symmetric_contraction import ops as sc_ops
from cgforge.patches.mace import SymmetricContraction

HIDDEN = "0e+1o+2e+3o"
# (channels, hidden, outputs, correlation, species): tests' and benchmarks' problems
PROBLEMS = [(c, HIDDEN, out, corr, e) for c, e in ((4, 2), (8, 5)) for out in ("0e", "0e+1o", "0e+1o+2e")
            for corr in (1, 2, 3)]
PROBLEMS += [(128, HIDDEN, out, 3, 89) for out in ("0e", "0e+1o", "0e+1o+2e")]
PROBLEMS += [(4, HIDDEN, "1e+0o+1o", 3, 2), (3, "0e+1o", "0e+1o", 4, 2)]


def irreps(channels: int, irs: str) -> o3.Irreps:
    return o3.Irreps("+".join(f"{channels}x{ir}" for ir in irs.split("+")))


def sources(label: str, module: SymmetricContraction) -> list[str]:
    plan = sc_ops.get(module.key)
    lines = []
    for dtype in (torch.float32, torch.float64):
        for which in sc_ops.KERNELS:
            source, name = plan.source(dtype, which)
            lines.append(f"{label} {str(dtype)[6:]} {which} {name} {hashlib.sha256(source.encode()).hexdigest()}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-mace", action="store_true", help="skip the problems that need mace-torch")
    args = parser.parse_args(argv)
    previous = torch.get_default_dtype()
    out: list[str] = []
    try:
        for c, hidden, outs, corr, e in PROBLEMS:
            base = f"{c}x({hidden})->{outs} corr={corr} E={e}"
            for dtype in (torch.float64, torch.float32):
                torch.set_default_dtype(dtype)
                torch.manual_seed(0)
                module = SymmetricContraction(irreps(c, hidden), irreps(c, outs), corr, e)
                out += sources(f"{base} built-{str(dtype)[6:]}", module)
                if not args.no_mace:
                    from mace.modules.symmetric_contraction import SymmetricContraction as MaceSC

                    mace = MaceSC(irreps(c, hidden), irreps(c, outs), correlation=corr, num_elements=e)
                    out += sources(f"{base} mace-{str(dtype)[6:]}", SymmetricContraction.from_mace(mace))
        torch.set_default_dtype(torch.float64)
        tuned = SymmetricContraction(irreps(8, HIDDEN), irreps(8, "0e+1o"), 3, 5,
                                     tuning=SCTuning(block=64, chunk=8, pairings=("pq", "pd", "qd")))
        out += sources("8x(hidden)->0e+1o corr=3 E=5 tuned", tuned)
        if not args.no_mace:
            from cgforge.patches import load
            from cgforge.plugin.runtime.bundled import model_path

            model = load(model_path("mace"), dtype="float64")
            found = [m for m in model.modules() if isinstance(m, SymmetricContraction)]
            assert found, "the bundled MACE model has no cgforge SymmetricContraction once patched"
            for i, module in enumerate(found):
                out += sources(f"bundled-water-mace[{i}]", module)
    finally:
        torch.set_default_dtype(previous)
    print("\n".join(out))
    total = hashlib.sha256("\n".join(out).encode()).hexdigest()
    print(f"# {len(out)} sources, all: {total}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
