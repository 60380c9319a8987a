"""Each patched model's table backward compiled with NVRTC (sm_90, CPU) without and with __launch_bounds__(128, B):
registers and spilled bytes (run from the repository root: python benchmarks/results/step-5k-h100-20261126/backward_registers.py)."""
import sys
import warnings

import torch

warnings.filterwarnings("ignore")
sys.path.insert(0, "benchmarks")
from shapes import mace_mp_shape, nequip_shape

from cgforge import patches
from cgforge.kernels import Convolution
from cgforge.kernels.core.compiler import compile_cubin
from cgforge.kernels.tensor_product import layout as L
from cgforge.kernels.tensor_product import plan as plans
from cgforge.kernels.tensor_product.codegen import render


def convs(model):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, Convolution)]

for name, model in (("mace", mace_mp_shape(torch.float32)), ("nequip", nequip_shape("M"))):
    patched = patches.patch(model)
    for mname, conv in convs(patched if patched is not None else model):
        s = plans.get(conv.key).schedule(torch.float32, rows_are_nodes=True)
        src, base = render(s, "float", L.CONV_BACKWARD.with_table(), False, True)
        fn = base + "_backward"
        out = []
        for mb in (None, 4, 5, 6):
            code = src if mb is None else src.replace(f"__launch_bounds__({s.backward_launch.warps_per_block} * 32)", f"__launch_bounds__({s.backward_launch.warps_per_block} * 32, {mb})")
            r = compile_cubin(code, arch="sm_90", name=f"{fn}{mb}.cu").resources(fn)
            out.append(f"mb{mb}: {r.registers}r sp{r.spill_stores}/{r.spill_loads}")
        print(name, mname, conv.key[:12], base, " | ".join(out), "smem/warp", s.backward_launch.smem_per_warp * 4, flush=True)
