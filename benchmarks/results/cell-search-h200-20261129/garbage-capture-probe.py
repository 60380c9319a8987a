"""Does an old engine (or a bare CUDA graph) collected inside a capture invalidate it? argv[1]: case."""
import gc
import sys
import warnings

import torch

warnings.filterwarnings("ignore")
from cgforge.plugin.runtime.capture import capture_graph

case = sys.argv[1]
gc.disable()
if case == "graph":
    x0 = torch.ones(1000, device="cuda")
    g0 = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _ = x0 * 3
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g0):
        y0 = x0 * 3
    g0.replay()
    holder = [g0, y0]
    holder.append(holder)
    del g0, y0, holder
else:
    from cgforge.plugin import Calculator
    from cgforge.plugin.md.engine import Engine
    from cgforge.plugin.md.integrators import Langevin
    from cgforge.plugin.water import water_box
    calc = Calculator("mace", device="cuda", dtype="float32", skin=1.0)
    atoms = water_box(216)
    atoms.calc = calc
    e = Engine(calc, atoms, Langevin(0.5, 300.0, 0.02), seed=1)
    e.run(200)
    print("old engine:", e.stats, e.capture_error)
    e.me = e
    if case == "engine+calc":
        e.calc_ref = calc
        del calc, atoms
    del e
torch.cuda.synchronize()
x = torch.arange(4096, dtype=torch.float32, device="cuda")
def compute():
    n = gc.collect()
    print("collected inside the capture:", n)
    return x * 2 + 1
try:
    g, out = capture_graph(compute, torch.device("cuda"), torch.cuda.graph_pool_handle(), warmups=0)
    g.replay()
    torch.cuda.synchronize()
    print(case, "OK", bool(torch.equal(out, x * 2 + 1)))
except Exception as err:
    print(case, "FAIL", type(err).__name__, str(err).splitlines()[0])
