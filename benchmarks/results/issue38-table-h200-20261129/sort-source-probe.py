"""Call 5b's probe, as run (python3 sort-source-probe.py from the repository root, one GPU): every op of one eager
engine step whose kernels include a CUB radix sort or an 8-byte gather, with its parents, stack and (for a
backward op) the forward op's stack."""

import sys

sys.path[:0] = ["benchmarks", "benchmarks/investigations"]

import torch  # noqa: E402
from kernel_sources import _backward_node  # noqa: E402

from cgforge.plugin.calculator import Calculator  # noqa: E402
from cgforge.plugin.md.engine import Engine  # noqa: E402
from cgforge.plugin.md.integrators import Langevin  # noqa: E402
from cgforge.plugin.water import water_box  # noqa: E402

OWN = ("cgforge/", "mace/", "e3nn/", "nequip/")
ACTIVITIES = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]

for model in ("mace", "nequip"):
    calc = Calculator(model, device="cuda", dtype="float32", patch=True)
    engine = Engine(calc, water_box(1728, seed=0), Langevin(0.5, 300.0, 0.01), seed=1,
                    max_temperature_K=float("inf"), cuda_graph=False)
    engine.run(3)
    torch.cuda.synchronize()
    config = torch._C._profiler._ExperimentalConfig(verbose=True)
    with torch.profiler.profile(activities=ACTIVITIES, with_stack=True, experimental_config=config) as prof:
        engine.run(1)
        torch.cuda.synchronize()
    events = list(prof.events())
    forward = {}
    for e in events:
        if e.name.startswith("aten::") and _backward_node(e) is None and e.sequence_nr >= 0 and e.stack:
            forward.setdefault(e.sequence_nr, [f for f in e.stack if any(o in f for o in OWN)][:6])
    print("=====", model)
    for e in events:
        hits = [k.name for k in getattr(e, "kernels", []) if "adix" in k.name
                or ("scatter_gather" in k.name and "<128, 8" in k.name) or "Opaque<8" in k.name]
        if not hits:
            continue
        chain, parent = [], e
        while parent is not None:
            chain.append(parent.name)
            parent = parent.cpu_parent
        node = _backward_node(e)
        print("--", e.name, "| kernels:", [h[:90] for h in hits])
        print("   chain:", " < ".join(chain[:8]))
        if node is not None:
            print("   bwd of seq", node.sequence_nr, node.name, "fwd stack:", forward.get(node.sequence_nr))
        print("   stack:", [f for f in (e.stack or []) if "/torch/" not in f][:6])
