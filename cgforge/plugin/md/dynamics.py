"""The integrators behind :func:`cgforge.plugin.md.run_md`: ASE's dynamics (any ASE calculator) or cgforge's device
engine (``engine.Engine``), behind one interface: ``nsteps``, ``irun(steps)`` (yields at the start, then with
``atoms`` updated: ASE's after every step, the engine at the trajectory and log intervals, the last step, and
after a block when Ctrl-C was pressed) and ``restart_info()``. docs/md.md tabulates the integrator per ensemble.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import numpy as np
from ase import Atoms, units

from .checks import engine_blow_up
from .files import Restart, encode_info
from .options import EngineOptions

# Steps between the engine's host syncs: longer on CUDA, where a sync stalls the launch queue; short on a CPU,
# where it costs nothing and Ctrl-C is acted on sooner.
ENGINE_BLOCK = {"cuda": 50, "cpu": 10}


def engine_unfit(calc: Any, atoms: Atoms) -> str | None:
    """None when the device engine can run ``calc`` on ``atoms``, else why it cannot."""
    if not all(hasattr(calc, name) for name in ("step", "adapter", "neighbours", "device")):
        return (f"the device engine runs the model step of a cgforge Calculator; {type(calc).__name__} is not one "
                "(ASE's dynamics run any ASE calculator)")
    return f"the device engine does not apply constraints ({atoms.constraints})" if atoms.constraints else None


def choose_engine(choice: str, calc: Any, atoms: Atoms, name: str = "engine", restart: Any = None) -> str:
    """'device' or 'ase' for ``choice`` ('auto': the device engine for a cgforge Calculator on CUDA whose system
    neither runs in tiles nor streams edges); 'device' that cannot be served is an error naming why (``name``: the
    argument; ``restart``: the trajectory whose engine it is)."""
    unfit = engine_unfit(calc, atoms)
    uses_tiles = getattr(calc, "uses_tiles", None)
    tiles = callable(uses_tiles) and uses_tiles(atoms)
    if unfit is None and tiles:
        unfit = ("the calculator evaluates this system in tiles (workspace), and the device engine captures one graph "
                 "of the whole system")
    if choice == "device":
        if unfit is not None:
            why = f" ({restart} was run by it, and a restart continues on it)" if restart is not None else ""
            raise ValueError(f"{name}: the device engine{why} cannot run this: {unfit}; use {name} ase (ASE's "
                             "dynamics; after a restart not bit for bit: other random numbers)")
        return "device"
    if choice == "auto" and unfit is None and getattr(calc.device, "type", None) == "cuda":
        plan_for = getattr(calc, "plan_for", None)
        if callable(plan_for):
            plan_for(atoms)  # a box the stored path cannot hold turns streaming on for good
        # streaming reads its chunk ranges on the host each step: ASE's dynamics drive it (the engine captures)
        return "ase" if getattr(calc, "streaming", False) else "device"
    return "ase"


def ase_dynamics(atoms: Atoms, o: dict[str, Any], rng: np.random.Generator) -> Any:
    """ASE's integrator for ``o['ensemble']`` (and ``o['thermostat']``)."""
    dt = o["timestep_fs"] * units.fs
    ensemble = o["ensemble"]
    if ensemble == "nvt" and o["thermostat"] == "csvr":
        from ase.md.bussi import Bussi

        return Bussi(atoms, dt, temperature_K=o["temperature_K"], taut=o["taut_fs"] * units.fs, rng=rng)
    if ensemble == "nvt":
        from ase.md.langevin import Langevin

        # fixcm=False: ASE >= 3.28 deprecates its approximate centre-of-mass fix (the box may drift as a whole)
        return Langevin(atoms, dt, temperature_K=o["temperature_K"], friction=o["friction"] / units.fs, rng=rng,
                        fixcm=False)
    if ensemble == "npt":
        from ase.md.nptberendsen import NPTBerendsen

        bar = 1e5 * units.Pascal
        return NPTBerendsen(atoms, dt, temperature_K=o["temperature_K"], pressure_au=o["pressure_bar"] * bar,
                            taut=o["taut_fs"] * units.fs, taup=o["taup_fs"] * units.fs,
                            compressibility_au=o["compressibility_per_bar"] / bar)
    from ase.md.verlet import VelocityVerlet

    return VelocityVerlet(atoms, dt)


def engine_integrator(o: dict[str, Any]) -> Any:
    """The engine's integrator for ``o`` (units converted: bar -> GPa, 1/bar -> 1/GPa)."""
    from . import integrators as it

    dt, temperature = o["timestep_fs"], o["temperature_K"]
    if o["ensemble"] == "nvt" and o["thermostat"] == "csvr":
        return it.CSVR(dt, temperature, tau_fs=o["taut_fs"])
    if o["ensemble"] == "nvt":
        return it.Langevin(dt, temperature, o["friction"])
    if o["ensemble"] == "npt":
        return it.StochasticCellRescaling(dt, temperature, o["pressure_bar"] * 1e-4, tau_fs=o["taut_fs"],
                                          tau_p_fs=o["taup_fs"],
                                          compressibility_per_GPa=o["compressibility_per_bar"] * 1e4)
    return it.VelocityVerlet(dt)


class AseDynamics:
    """ASE's dynamics with the numpy generator's state as the restart information."""

    def __init__(self, dyn: Any) -> None:
        self.dyn = dyn

    nsteps = property(lambda self: self.dyn.nsteps, lambda self, value: setattr(self.dyn, "nsteps", value),
                      doc="ASE's step counter")

    def irun(self, steps: int) -> Iterator[Any]:
        return self.dyn.irun(steps)

    def restart_info(self) -> dict[str, Any]:
        rng = getattr(self.dyn, "rng", None)
        return {"md_rng": encode_info(rng.bit_generator.state)} if isinstance(rng, np.random.Generator) else {}

    def describe(self) -> str:
        return f"ASE {type(self.dyn).__name__}"


class EngineDynamics:
    """The device engine behind run_md's loop (see the module doc). ``interrupted``: polled after each block."""

    def __init__(self, engine: Any, intervals: tuple[int, ...]) -> None:
        self.engine, self.intervals = engine, intervals
        self.nsteps = engine.step
        self.interrupted: Callable[[], bool] = lambda: False
        self._extra: dict[str, float] = {}

    def irun(self, steps: int) -> Iterator[None]:
        """See the module doc; the engine's ``MDBlowUp`` comes out as run_md's ``MDInstabilityError``."""
        from .engine import MDBlowUp

        try:
            yield from self._irun(steps)
        except MDBlowUp as err:
            raise engine_blow_up(err, self.engine.max_temperature_K) from None

    def _irun(self, steps: int) -> Iterator[None]:
        e = self.engine
        end = e.step + steps
        e.sync_atoms()  # computes the forces of the start
        self._written()
        yield
        while e.step < end:
            step = e.step
            stop = min([end, *((step // k + 1) * k for k in self.intervals)])
            target = min(stop, step + e.block)
            # every=target: target is the one multiple of itself after step, so the engine writes atoms there from
            # the copy it queued with the block's report: no sync of its own
            e.run(target - step, every=target if target == stop else 0)
            self.nsteps = e.step
            if target == stop:
                self._written()
                yield
            elif self.interrupted():
                e.sync_atoms()
                self._written()
                yield

    def _written(self) -> None:
        from .engine import ENGINE_INFO_KEY

        # Kept out of atoms.info (a dict there would not survive extended XYZ); restart_info carries it.
        self._extra = dict(self.engine.atoms.info.pop(ENGINE_INFO_KEY, {}).get("extra", {}))

    def restart_info(self) -> dict[str, Any]:
        e = self.engine
        return {"md_engine": encode_info({"seed": e.seed, "integrator": e.integrator.name, "extra": self._extra})}

    def describe(self) -> str:
        e = self.engine
        graph = ", CUDA graph" if e.cuda_graph else ""
        return f"cgforge device engine ({e.integrator.name} on {e.device}{graph})"


def engine_dynamics(atoms: Atoms, calc: Any, o: dict[str, Any], state: Restart | None, options: EngineOptions,
                    intervals: tuple[int, ...]) -> EngineDynamics:
    """The engine for ``atoms``, continuing ``state``'s step counter and, when the engine wrote it, its seed and
    integrator scalars (the whole random state: the noise hashes (seed, step)); it stops at ``intervals``."""
    from .engine import Engine

    integrator = engine_integrator(o)
    seed, extra = o["seed"], {}
    saved = state.engine_state if state is not None else None
    if saved is not None:
        seed = int(saved["seed"])
        extra = saved.get("extra", {}) if saved.get("integrator") == integrator.name else {}
    if options.block is None:
        options = replace(options, block=ENGINE_BLOCK.get(calc.device.type, 10))
    engine = Engine(calc, atoms, integrator, seed=seed, max_temperature_K=o["max_temperature_K"],
                    engine_options=options)
    if state is not None:
        engine.load_state({"positions": atoms.get_positions(), "momenta": atoms.get_momenta(),
                           "cell": np.array(atoms.cell), "numbers": atoms.numbers, "step": state.step,
                           "extra": extra})
    return EngineDynamics(engine, intervals)


def thermalize(atoms: Atoms, temperature_K: float, rng: np.random.Generator) -> None:
    """Maxwell-Boltzmann momenta (ASE >= 3.28 names it thermalize_momenta), zero total momentum."""
    try:
        from ase.md.velocitydistribution import thermalize_momenta
    except ImportError:
        from ase.md.velocitydistribution import MaxwellBoltzmannDistribution as thermalize_momenta
    thermalize_momenta(atoms, temperature_K=temperature_K, rng=rng)
    if len(atoms) > 1:  # one atom: no motion would be left (and ASE's Stationary divides by zero)
        from ase.md.velocitydistribution import Stationary

        Stationary(atoms)
