"""What ``--compile auto`` decides for each model on this GPU, and what its trial costs.

    python3 benchmarks/investigations/compile_auto.py --model bundled-mace [--steps 1000000] [--ensemble nvt]

Builds the model and the box as ``profile_engine.py`` does (FP32, bench_md's skin, the 5,184-atom box relaxed by
``bench_md.md_atoms``),
plans a ``run_md`` of ``--steps`` steps on the device engine and runs ``compile_trial.auto_compile`` with the run's
engine trial, as ``cgforge md`` does before its first step: prints the line it prints (the plain and the compiled
step it measured, the compilation's seconds), the decision and the trial's wall time. Set ``--steps`` high enough
that the run passes ``COMPILE_AUTO_MIN_SECONDS`` (the default does for every model), then compare the trial's
two steps with ``tuning_ab.py --compile`` of the same model. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
import profile_engine  # noqa: E402

from cgforge.plugin.md.compile_trial import auto_compile, engine_trial  # noqa: E402
from cgforge.plugin.md.run import plan_md  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bundled-mace", choices=profile_engine.MODELS)
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--ensemble", default="nvt", choices=("nvt", "npt"))
    parser.add_argument("--molecules", type=int, default=1728)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("compile_auto.py needs a CUDA GPU")
    with tempfile.TemporaryDirectory() as tmp:
        calc = profile_engine.calculator(args.model, tmp, None)
        atoms = profile_engine.make(args.molecules)
        atoms.calc = calc
        plan = plan_md(atoms, calc, steps=args.steps, engine="device", ensemble=args.ensemble, log=None,
                       trajectory=Path(tmp) / "run.traj")
        start = time.perf_counter()
        line = auto_compile(calc, atoms, args.steps, lambda: engine_trial(calc, atoms, plan.o, plan.engine_options))
        seconds = time.perf_counter() - start
        plan.close()
    print(f"{args.model}, {len(atoms)} atoms, {args.ensemble}, {args.steps:,} steps on {torch.cuda.get_device_name()}:")
    print(f"  {line}")
    print(f"  decision: compile={calc.compile or 'off'}; the trial took {seconds:.1f} s")


if __name__ == "__main__":
    main()
