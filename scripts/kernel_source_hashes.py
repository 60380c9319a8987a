"""SHA-256 of every generated CUDA source of cgforge's problem set: a refactoring check that needs no GPU.

Run it before and after a change and diff the output: equal lines mean byte-identical kernels (each line names
the kernel function, whose name hashes the problem, launch shape, loop orders and passes). Covered:

- the tensor product / convolution: every problem of ``cgforge.kernels.problem_set`` (``PROBLEMS`` and
  ``MODEL_LAYERS``) x FP32/FP64 x every layout (rows = batch rows or edges: the tensor product and the atomic
  convolution; rows = nodes: the CSR convolution, receiver-major with and without a permutation, sender-major
  backward) x plain weights / radial table x forward / backward (the CSR backward also with an explicit launch
  bound), for the default tuning and four others (loop orders, 32-channel chunks); shared weights (default tuning,
  plain layouts);
- the fixed sources (segment sum, radial table, MD noise);
- the symmetric contraction: ``scripts/sc_source_hashes.py``'s problems (``--no-mace``: only those built by cgforge).

    python scripts/kernel_source_hashes.py [--no-mace] > hashes.txt
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import io
import sys
from pathlib import Path

import torch

from cgforge.kernels.core.tuning import TPTuning
from cgforge.kernels.problem_set import MODEL_LAYERS, PROBLEMS
from cgforge.kernels.tensor_product import layout as layouts
from cgforge.kernels.tensor_product import plan as plans
from cgforge.kernels.tensor_product.problem import TPProblem

FORWARD = ("TP_LAYOUT", "CONV_FORWARD", "CONV_FORWARD_SORTED", "ATOMIC_FORWARD")
BACKWARD = ("TP_LAYOUT", "CONV_BACKWARD", "ATOMIC_BACKWARD")
TUNINGS = {"default": TPTuning(), "edges": TPTuning(loop_order="edges"), "segments": TPTuning(loop_order="segments"),
           "chunks": TPTuning(loop_order="chunks"), "chunk32": TPTuning(forward_chunk=32, backward_chunk=32)}
EXPLICIT_BOUND = 2  # a CSR backward's __launch_bounds__ blocks, rendered besides the unbounded source


def _sha(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()


def tp_lines() -> list[str]:
    lines = []
    for label, args in {**PROBLEMS, **MODEL_LAYERS}.items():
        for shared in (False, True):
            problem = TPProblem.build(*args, shared_weights=shared)
            for tuning_label, tuning in TUNINGS.items():
                if shared and tuning_label != "default":
                    continue
                plan = plans.get(plans.register(problem, tuning))
                for dtype in (torch.float32, torch.float64):
                    for backward, names in ((False, FORWARD), (True, BACKWARD)):
                        for layout_name in names:
                            base = getattr(layouts, layout_name)
                            for layout in (base,) if shared else (base, base.with_table()):
                                bounds = (None, EXPLICIT_BOUND) if backward and layout.csr else (None,)
                                for bound in bounds:
                                    source, name = plan.source(dtype, layout, backward, bound)
                                    what = (f"{label} shared={int(shared)} {tuning_label} {str(dtype)[6:]} "
                                            f"{layout_name}{'+table' if layout.table else ''} "
                                            f"{'backward' if backward else 'forward'} bound={bound}")
                                    lines.append(f"{what} {name} {_sha(source)}")
    return lines


def fixed_lines() -> list[str]:
    try:
        from cgforge.kernels.noise import NORMAL_NOISE_SOURCE
    except ImportError:  # before issue 36 the noise kernel lived in the MD engine
        from cgforge.plugin.md.noise import NORMAL_NOISE_SOURCE
    from cgforge.kernels.radial_table.ops import RADIAL_TABLE_SOURCE
    from cgforge.kernels.segment_sum import SEGMENT_SUM_SOURCE

    sources = {"segment_sum": SEGMENT_SUM_SOURCE, "radial_table": RADIAL_TABLE_SOURCE,
               "normal_noise": NORMAL_NOISE_SOURCE}
    return [f"fixed {label} {_sha(source)}" for label, source in sources.items()]


def sc_lines(no_mace: bool) -> list[str]:
    path = Path(__file__).with_name("sc_source_hashes.py")
    spec = importlib.util.spec_from_file_location("sc_source_hashes", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        module.main(["--no-mace"] if no_mace else [])
    return [f"sc {line}" for line in out.getvalue().splitlines() if not line.startswith("#")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-mace", action="store_true", help="symmetric contraction: skip what needs mace-torch")
    parser.add_argument("--no-sc", action="store_true", help="skip the symmetric contraction")
    args = parser.parse_args(argv)
    lines = tp_lines() + fixed_lines() + ([] if args.no_sc else sc_lines(args.no_mace))
    print("\n".join(lines))
    print(f"# {len(lines)} sources, all: {_sha(chr(10).join(lines))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
