"""Where do two identical force calls differ? (GPU diagnostic for bitwise-reproducible forces, issue 16)

    python3 benchmarks/investigations/diagnose_determinism.py nequip [mace ...]

For each model: two eager force calls of the same water box, with a forward hook on every module (its output)
and a full backward hook (its input gradient); prints the first modules whose tensors differ in any bit, the
ops torch itself calls non-deterministic (``use_deterministic_algorithms(warn_only=True)``), and whether the
forces are reproducible with torch's deterministic algorithms switched on.
"""

from __future__ import annotations

import sys
import warnings

import numpy as np
import torch

from cgforge.plugin import Calculator, water_box


def _first_tensor(value):
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, list | tuple):
        for item in value:
            found = _first_tensor(item)
            if found is not None:
                return found
    if isinstance(value, dict):
        for item in value.values():
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


def _recorded_call(calc: Calculator, atoms) -> tuple[np.ndarray, list, list]:
    forward, backward, handles = [], [], []
    for name, module in calc.model.named_modules():
        def fwd(mod, args, out, name=name):
            t = _first_tensor(out)
            if t is not None:
                forward.append((name, type(mod).__name__, t.detach().clone()))

        def bwd(mod, grad_in, grad_out, name=name):
            t = _first_tensor(grad_in)
            if t is not None:
                backward.append((name, type(mod).__name__, t.detach().clone()))

        handles.append(module.register_forward_hook(fwd))
        try:
            handles.append(module.register_full_backward_hook(bwd))
        except Exception:  # noqa: BLE001 - some modules refuse backward hooks; the forward ones still tell
            pass
    try:
        calc.results = {}
        forces = calc.get_forces(atoms).copy()
    finally:
        for h in handles:
            h.remove()
    return forces, forward, backward


def _diff(first: list, second: list, what: str) -> None:
    shown = 0
    for (name, cls, a), (_, _, b) in zip(first, second):
        if a.shape != b.shape or not torch.equal(a, b):
            scale = float(a.abs().max()) if a.numel() else 0.0
            delta = float((a - b).abs().max()) if a.shape == b.shape else float("nan")
            print(f"  {what} differs: {name or '<root>'} ({cls}) max|diff| {delta:.3e} of max {scale:.3e}")
            shown += 1
            if shown >= 6:
                break
    if not shown:
        print(f"  {what}: all {len(first)} recorded tensors equal")


def diagnose(model: str, device: str = "cuda") -> None:
    print(f"== {model}")
    atoms = water_box(216, seed=4)
    calc = Calculator(model, device=device, cuda_graph=False)
    atoms.calc = calc
    f1, fw1, bw1 = _recorded_call(calc, atoms)
    f2, fw2, bw2 = _recorded_call(calc, atoms)
    print(f"  forces equal bitwise: {np.array_equal(f1, f2)} (max diff {np.abs(f1 - f2).max():.3e})")
    _diff(fw1, fw2, "forward")
    _diff(bw1, bw2, "backward")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            calc.results = {}
            calc.get_forces(atoms)
        finally:
            torch.use_deterministic_algorithms(False)
    ops = sorted({str(w.message).split("\n")[0][:160] for w in caught if "deterministic" in str(w.message)})
    print(f"  ops torch calls non-deterministic: {len(ops)}")
    for line in ops:
        print(f"    {line}")
    if device != "cuda":
        return
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        calc.results = {}
        calc.get_forces(atoms)
        torch.cuda.synchronize()
    names = sorted({e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})
    suspicious = [n for n in names if any(k in n.lower() for k in ("atomic", "index", "scatter", "put"))]
    print(f"  CUDA kernels with index/scatter/atomic in the name: {suspicious}")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--cpu"]
    for name in args or ["nequip", "mace"]:
        diagnose(name, "cpu" if "--cpu" in sys.argv else "cuda")
