"""The instruction mix of the convolution kernels that MD runs, from their PTX (NVRTC on this CPU, no GPU): a
count to predict from before a kernel change goes to the GPU.

The 2026-11-26 Nsight Compute counters put the convolutions' stalls on shared-memory and shuffle results (the MIO
pipe). This prints, per model layer and kernel variant, the static counts of the PTX instructions that feed that
pipe (``ld.shared``, ``st.shared``, ``shfl``) beside global loads, atomics and FP32 arithmetic. Static counts of
the whole kernel: the edge loop's body dominates them (a chunk-pass backward holds every pass's loop, so its count
is the sum over its launches; code with a fallback path counts both paths, of which one runs). PTX is before
ptxas (registers, spills and scheduling are not in it: `explain.py` prints those); shifts of 10 % or more between
two variants are what this can see.

    python3 benchmarks/investigations/ptx_mix.py [--layers mace-mp-medium-l2,nequip-presetM]
        [--tuning '{"grad_y_reduce_scatter": false}']

Measured against it (2026-11-28): the reduce-scatter of grad y took MACE-MP-medium's second-layer fixed-point
backward from 340 to 92 shuffles (static, four chunk passes) and its engine step 10.42 -> 9.80 ms on an H100.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/

from cgforge.kernels.core import compiler  # noqa: E402
from cgforge.kernels.core.tuning import TPTuning  # noqa: E402
from cgforge.kernels.problem_set import MODEL_LAYERS, PROBLEMS  # noqa: E402
from cgforge.kernels.tensor_product import layout as layouts  # noqa: E402
from cgforge.kernels.tensor_product import plan as plans  # noqa: E402
from cgforge.kernels.tensor_product.problem import TPProblem  # noqa: E402

LAYERS = {**MODEL_LAYERS, "nequip-presetM": PROBLEMS["nequip-presetM"]}
# The table kernels MD runs (FP32): forward over receivers, the three backwards (kernels/convolution/table_ops.py)
VARIANTS = {
    "forward": (layouts.CONV_FORWARD_SORTED.with_table(), False),
    "bwd senders": (layouts.CONV_BACKWARD.with_table(), True),
    "bwd fixed point": (layouts.CONV_BACKWARD_RECEIVERS_FIXED_SORTED.with_table(), True),
    "bwd no grad x": (layouts.CONV_BACKWARD_NO_GX_SORTED.with_table(), True),
}
# column -> PTX opcode prefixes counted under it
COLUMNS = {
    "ld.shared": ("ld.shared",),
    "st.shared": ("st.shared",),
    "shfl": ("shfl",),
    "ld.global": ("ld.global",),
    "atom/red": ("atom", "red"),
    "fma.f32": ("fma.rn.f32",),
    "mul/add.f32": ("mul.rn.f32", "mul.f32", "add.rn.f32", "add.f32", "sub.f32"),
    "selp": ("selp",),
}


def ptx(source: str, name: str) -> str:
    """PTX of ``source`` for compute_90, through the NVRTC library the compiler loads (ctypes)."""
    lib = ctypes.CDLL(compiler.nvrtc_library_path())
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None):
        raise RuntimeError("nvrtcCreateProgram failed")
    try:
        options = [o.encode() for o in (*compiler.DEFAULT_OPTIONS, "--gpu-architecture=compute_90")]
        code = lib.nvrtcCompileProgram(prog, len(options), (ctypes.c_char_p * len(options))(*options))
        if code:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC failed on {name}: {log.value.decode(errors='replace')[:2000]}")
        size = ctypes.c_size_t()
        lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
        out = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetPTX(prog, out)
        return out.value.decode()
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def mix(text: str) -> dict[str, int]:
    """Counts of ``COLUMNS`` among the PTX instructions of ``text`` (predicated or not)."""
    opcodes = re.findall(r"^\s*(?:@!?%p\d+\s+)?([a-z][\w.]*)", text, flags=re.MULTILINE)
    return {col: sum(op.startswith(prefixes) for op in opcodes) for col, prefixes in COLUMNS.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default=",".join(LAYERS), help=f"from {', '.join(LAYERS)}")
    parser.add_argument("--tuning", default="{}", help="TPTuning fields as JSON")
    args = parser.parse_args(argv)
    layers = args.layers.split(",")
    unknown = [name for name in layers if name not in LAYERS]
    if unknown:
        parser.error(f"--layers: unknown {', '.join(unknown)}; choose from {', '.join(LAYERS)}")
    try:
        tuning = TPTuning(**json.loads(args.tuning))
    except (ValueError, TypeError) as error:
        parser.error(f"--tuning: {error}")
    if not compiler.nvrtc_available():
        print("ptx_mix.py: NVRTC not found (install nvidia-cuda-nvrtc)", file=sys.stderr)
        return 2
    print(f"static PTX instruction counts, FP32, compute_90; tuning {tuning.key()}")
    print(f"{'layer':<20} {'kernel':<16} " + " ".join(f"{c:>11}" for c in COLUMNS))
    for name in layers:
        plan = plans.get(plans.register(TPProblem.build(*LAYERS[name]), tuning))
        for label, (layout, backward) in VARIANTS.items():
            source, function = plan.source(torch.float32, layout, backward, None)
            counts = mix(ptx(source, f"{function}.cu"))
            print(f"{name:<20} {label:<16} " + " ".join(f"{counts[c]:>11}" for c in COLUMNS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
