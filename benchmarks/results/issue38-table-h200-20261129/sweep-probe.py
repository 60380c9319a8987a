"""Call 7's probe, as run (python3 sweep-probe.py bundled-mace mace-mp-medium from the repository root, one GPU):
profile_engine's ms_per_step (200 steps after 40) over engine settings and skins, two rounds each."""

import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, "benchmarks")

import bench_md  # noqa: E402
import profile_engine as pe  # noqa: E402

from cgforge.plugin.calculator import Calculator  # noqa: E402

atoms = pe.make(1728)
folder = tempfile.mkdtemp()
out = []
settings = [{}, {"block": 20}, {"block": 50}, {"steps_per_graph": 2, "block": 10}, {"steps_per_graph": 5, "block": 20},
            {"rebuild_margin": 1.2}, {"rebuild_margin": 2.5}, {"pipelined_rebuild": False}]
for model in sys.argv[1:]:
    for skin in (1.0, 0.7, 1.5):
        calc = Calculator(bench_md.fp32_source(model, Path(folder)), device="cuda",
                          dtype=None if model == "nequip-M" else "float32", skin=skin)
        for rnd in range(2):
            for s in settings if skin == 1.0 else [{}]:
                ms = pe.ms_per_step(calc, atoms, 200, **s)
                out.append({"model": model, "skin": skin, "round": rnd, **s, "ms": ms})
                print("RESULT", out[-1], flush=True)
        del calc
with open(os.environ.get("OUT", "/tmp") + "/sweep.json", "w") as f:
    json.dump(out, f, indent=1)
