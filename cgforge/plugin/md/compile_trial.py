"""``--compile auto``: compile a long run only when a trial on the run's own system says the compiled step is faster.

Whether torch.compile shortens the engine's step depends on the model and on the device: the same 5,184-atom
water step of the bundled MACE is faster compiled on one GPU and slower on another, and the first compiled step
spends tens of seconds compiling (docs/measured-constants.md). So ``auto`` does not guess from the step count alone:

1. off the GPU, for a structure evaluated in tiles, a model cgforge did not patch or a box that leaves the compiled
   model too little memory: off, said why;
2. a run shorter than ``min_steps`` (``COMPILE_AUTO_MIN_STEPS``): off, no trial;
3. the plain engine step timed on a copy of the structure (``engine_trial``: ``TRIAL_WARMUP`` steps, then
   ``TRIAL_STEPS`` timed, each cut to ``TRIAL_SECONDS`` for a large system); a run whose plain steps take less
   than ``min_seconds`` in all (``COMPILE_AUTO_MIN_SECONDS``: a tenth off its step would not repay the
   compilation) stays plain;
4. the compiled step timed the same way; kept only when it is ``KEEP_BELOW`` of the plain step or faster.

The trial steps a copy of the structure (the run's integrator, options and seed; momenta drawn at the run's
temperature when the structure is at rest): the run itself starts from the structure as given.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from ase import Atoms

from .commit import MDBlowUp
from .dynamics import engine_dynamics, thermalize
from .options import COMPILE_AUTO_MIN_SECONDS, COMPILE_AUTO_MIN_STEPS, EngineOptions

__all__ = ["KEEP_BELOW", "PROBE_STEPS", "TRIAL_SECONDS", "TRIAL_STEPS", "TRIAL_WARMUP", "auto_compile", "engine_trial",
           "trial_steps"]

TRIAL_WARMUP = 100  # steps before the timed ones: graph capture, the first rebuilds, the capacity refits (bench_md's)
TRIAL_STEPS = 100  # timed steps per variant: two of the engine's blocks on CUDA
# ... each at most this many seconds of steps (a large system's step is stable after a few; its trial stays short),
# judged from a probe after the first steps (capture, compilation), and at least the probe's steps
TRIAL_SECONDS = 5.0
PROBE_STEPS = 10
KEEP_BELOW = 0.97  # the compiled step is kept only 3 % faster or more: closer, the trial's own spread decides

# () -> (ms a step, seconds of the warm-up): the step of whatever the calculator is set to (plain or compiled)
Trial = Callable[[], tuple[float, float]]


def trial_steps(probe_ms: float, warmup: int, steps: int, seconds: float = TRIAL_SECONDS,
                probe: int = PROBE_STEPS) -> tuple[int, int]:
    """(warm-up steps after the two probes, timed steps) for a step of ``probe_ms``: ``warmup`` and ``steps`` each
    cut to what fits ``seconds``, never below ``probe`` (the two probes count towards the warm-up)."""
    fit = max(probe, int(seconds * 1e3 / probe_ms)) if probe_ms > 0 else steps
    return max(0, min(warmup, fit) - 2 * probe), max(1, min(steps, fit))


def engine_trial(calc: Any, atoms: Atoms, o: Any, options: EngineOptions, warmup: int = TRIAL_WARMUP,
                 steps: int = TRIAL_STEPS, seconds: float = TRIAL_SECONDS) -> tuple[float, float]:
    """(ms a step over the timed steps, seconds of the warm-up before them) of the device engine stepping a copy of
    ``atoms`` with ``calc`` as the run ``o`` (its ``MDOptions``) would; momenta drawn at the run's temperature
    (seeded) when the structure is at rest. Two probes of ``PROBE_STEPS`` (fewer for a short ``warmup``) time the
    step first; ``trial_steps`` cuts the rest to ``seconds`` each."""
    trial = atoms.copy()
    if not np.any(trial.get_momenta()):
        thermalize(trial, o["temperature_K"], np.random.default_rng(o["seed"]))
    engine = engine_dynamics(trial, calc, o, None, options, ()).engine
    engine.max_temperature_K = math.inf  # timing only: a hot trial is the run's to report
    probe = max(1, min(PROBE_STEPS, warmup // 2))
    try:
        start = time.perf_counter()
        engine.run(probe)  # the first steps: graph capture, a compilation
        t = time.perf_counter()
        engine.run(probe)  # each run ends in a sync: its steps are done when it returns
        probe_ms = (time.perf_counter() - t) * 1e3 / probe
        more, timed = trial_steps(probe_ms, warmup, steps, seconds, probe)
        engine.run(more)
        warm = time.perf_counter() - start
        t = time.perf_counter()
        engine.run(timed)
        return (time.perf_counter() - t) * 1e3 / timed, warm
    finally:
        engine.invalidate()  # its graphs' memory back before the run's engine captures its own


def auto_compile(calc: Any, atoms: Atoms, steps: int, trial: Trial | None, min_steps: int = COMPILE_AUTO_MIN_STEPS,
                 min_seconds: float = COMPILE_AUTO_MIN_SECONDS, keep_below: float = KEEP_BELOW,
                 say: Callable[[str], None] | None = None) -> str | None:
    """compile auto (the module doc): compiles ``calc`` or leaves it plain; the line saying which and why (None off
    CUDA). ``trial``: times the engine's step as the calculator is set (None: the run uses ASE's dynamics);
    ``keep_below``: the compiled step is kept at this fraction of the plain one or less; ``say``: told before the
    compiled trial starts (its compilation takes a while)."""
    if getattr(getattr(calc, "device", None), "type", None) != "cuda":
        return None
    if steps < min_steps:
        return (f"torch.compile: off ({steps:,} steps; auto tries it for runs of {min_steps:,} or more, --compile "
                "forces it)")
    uses_tiles = getattr(calc, "uses_tiles", None)
    if callable(uses_tiles) and uses_tiles(atoms):  # asked before compiled_fits, which builds the whole Verlet list
        return "torch.compile: off (the system runs in tiles, eagerly)"
    if not calc.patched or not calc.compiled_fits(atoms):
        why = "the model is not patched by cgforge" if not calc.patched else "the box leaves too little GPU memory"
        return f"torch.compile: off ({why})"
    if trial is None:
        return "torch.compile: off (auto decides by a trial of the device engine; ASE's dynamics run plain)"
    try:
        plain_ms, _ = trial()
    except MDBlowUp as err:  # the run itself will meet it and report it as runs do (exit code 3)
        return f"torch.compile: off (the trial's plain steps blew up: {err})"
    run_s = steps * plain_ms / 1e3
    if run_s < min_seconds:
        return (f"torch.compile: off ({steps:,} steps of {plain_ms:.2f} ms take ~{run_s:.0f} s; auto tries it for runs "
                f"of {min_seconds:.0f} s or more, where a tenth off the step repays the compilation)")
    if say is not None:
        say(f"torch.compile auto: the plain step takes {plain_ms:.2f} ms here; compiling the model to time its "
            "compiled step (tens of seconds)")
    try:
        calc.set_compile("default")
        compiled_ms, compile_s = trial()
    except MDBlowUp as err:
        calc.set_compile(False)
        return f"torch.compile: off (the trial's compiled steps blew up: {err})"
    except (RuntimeError, ValueError) as err:  # no Triton, no dynamo, a failed compilation: run eagerly, say why
        calc.set_compile(False)
        return f"torch.compile: off ({err})"
    measured = f"a trial on this system: {compiled_ms:.2f} ms a step compiled, {plain_ms:.2f} plain"
    if compiled_ms > keep_below * plain_ms:
        calc.set_compile(False)
        return f"torch.compile: off ({measured}; compiled in {compile_s:.0f} s)"
    return f"torch.compile: on ({measured}; compiled in {compile_s:.0f} s)"
