"""A CG tensor product and a fused convolution on a water-box graph, checked
against e3nn, on the GPU when there is one (generated CUDA kernels) or the CPU (torch reference).

    python examples/tensor_product.py
"""

from __future__ import annotations

import time

import numpy as np
import torch
from e3nn import o3

from cgforge.kernels import ConvGraph, Convolution, TensorProduct
from cgforge.kernels.problem_set import PROBLEMS  # the benchmark problem set
from cgforge.plugin.runtime.neighbours import neighbour_list
from cgforge.plugin.water import water_box


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n_side = 12 if device == "cuda" else 3
    atoms = water_box(n_side=n_side)
    pos = torch.tensor(atoms.positions, device=device)
    cell = torch.tensor(np.array(atoms.cell), device=device)
    sender, receiver, _ = neighbour_list(pos, cell, (True, True, True), 6.0 if device == "cuda" else 4.0)
    n, e = len(atoms), sender.shape[0]
    print(f"device {device}: water box of {n} atoms, {e} edges")
    i1, i2, io, ins = PROBLEMS["mace-medium"]
    ref = o3.TensorProduct(i1, i2, io, ins, shared_weights=False, internal_weights=False).to(device)
    tp, conv = TensorProduct.from_e3nn(ref), Convolution.from_e3nn(ref)
    x = torch.randn(n, i1.dim, device=device, requires_grad=True)
    y = torch.randn(e, i2.dim, device=device)
    w = torch.randn(e, ref.weight_numel, device=device)
    graph = ConvGraph(sender, receiver, n)
    out = conv(x, y, w, graph)  # first call compiles the kernels (cached on disk afterwards)
    expected = torch.zeros_like(out).index_add(0, receiver, ref(x[sender], y, w))
    err = float((out - expected).detach().norm() / expected.detach().norm())
    print(f"fused convolution vs e3nn: relative error {err:.2e}")
    forces_like, = torch.autograd.grad(out.square().sum(), x)
    print(f"backward ok: grad norm {forces_like.norm():.3e}")
    rows = min(e, 50000)
    single = tp(x[sender[:rows]], y[:rows], w[:rows])
    print(f"tensor product of {rows} rows vs e3nn: relative error "
          f"{float((single - ref(x[sender[:rows]], y[:rows], w[:rows])).detach().norm() / single.detach().norm()):.2e}")
    if device == "cuda":
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            conv(x, y, w, graph)
        torch.cuda.synchronize()
        print(f"fused convolution forward: {(time.perf_counter() - t0) / 20 * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
