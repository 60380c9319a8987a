"""The options of :func:`cgforge.plugin.md.run_md` and ``cgforge md``: defaults and checks.

Every check names what the user typed: the Python argument for run_md, the flag for the command line (the
caller passes a ``name`` function that maps one to the other).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # numpy and ASE load on use: `cgforge --help` reads this module's defaults
    from ase import Atoms

ENSEMBLES = ("nvt", "nve", "npt")
ENGINES = ("auto", "device", "ase")  # auto: the device engine when the calculator runs on CUDA, else ASE's
THERMOSTATS = ("langevin", "csvr")  # NVT; NPT uses CSVR in the engine, Berendsen's in ASE's dynamics

# Blow-up limit when none is given: far above any liquid or solid a user runs, far below what a run that
# exploded reaches (1e5-1e6 K within a few steps); 10x the target for hot runs.
MAX_TEMPERATURE_FLOOR_K = 5000.0
MAX_TEMPERATURE_FACTOR = 10.0

# NPT defaults: 1 atm, water's isothermal compressibility at 300 K.
DEFAULT_PRESSURE_BAR = 1.01325
DEFAULT_COMPRESSIBILITY_PER_BAR = 4.57e-5
DEFAULT_TAUT_FS = 100.0
DEFAULT_TAUP_FS = 1000.0
DEFAULT_FRICTION = 0.01  # 1/fs, Langevin

NPT_OPTIONS = ("pressure_bar", "taut_fs", "taup_fs", "compressibility_per_bar")
# The options a restart continues (saved in every frame's atoms.info as md_<name>): the physics of the run.
SAVED_OPTIONS = ("ensemble", "thermostat", "temperature_K", "timestep_fs", "friction", *NPT_OPTIONS, "seed")
PLOT_SUFFIXES = (".png", ".pdf", ".svg")


def check_number(name: str, value: Any, *, minimum: float | None = 0.0, strict: bool = True,
                 allow_inf: bool = False) -> float:
    """A float; > minimum (strict) or >= minimum; finite unless ``allow_inf``."""
    import numpy as np

    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__} {value!r}")
    value = float(value)
    ok = not math.isnan(value) and (math.isfinite(value) or (allow_inf and value > 0))
    if minimum is not None:
        ok = ok and (value > minimum if strict else value >= minimum)
    if not ok:
        bound = "" if minimum is None else f" {'>' if strict else '>='} {minimum:g}"
        raise ValueError(f"{name}: expected a finite number{bound}, got {value!r}")
    return value


def check_count(name: str, value: Any, minimum: int) -> int:
    """An int >= minimum."""
    import numpy as np

    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name}: expected an int >= {minimum}, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")
    return int(value)


def check_flag(name: str, value: Any) -> bool:
    """True or False (numpy's too)."""
    import numpy as np

    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{name}: expected True or False, got {type(value).__name__} {value!r}")
    return bool(value)


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    """``value`` lower-cased when it is one of ``choices``, else an error listing them."""
    if not isinstance(value, str):
        raise TypeError(f"{name}: expected one of {', '.join(choices)}, got {type(value).__name__}")
    if value.lower() not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(choices)}, got {value!r}")
    return value.lower()


def default_max_temperature(temperature_K: float) -> float:
    return max(MAX_TEMPERATURE_FLOOR_K, MAX_TEMPERATURE_FACTOR * temperature_K)


def checked_options(o: dict[str, Any], name: Callable[[str], str]) -> dict[str, Any]:
    """The MD options of :func:`run_md`, checked; ``name`` turns an argument's name into what the user typed
    (the Python name for run_md, the flag for the command line)."""
    o = dict(o)
    o["ensemble"] = ensemble = check_choice(name("ensemble"), o["ensemble"], ENSEMBLES)
    o["engine"] = check_choice(name("engine"), o.get("engine", "auto"), ENGINES)
    o["temperature_K"] = check_number(name("temperature_K"), o["temperature_K"], strict=False)
    o["timestep_fs"] = check_number(name("timestep_fs"), o["timestep_fs"])
    o["steps"] = check_count(name("steps"), o["steps"], 0)
    o["trajectory_interval"] = check_count(name("trajectory_interval"), o["trajectory_interval"], 1)
    o["log_interval"] = check_count(name("log_interval"), o["log_interval"], 1)
    o["seed"] = check_count(name("seed"), o["seed"], 0)
    # Options of one ensemble (or thermostat) are refused for the others: a --friction with NVE would silently
    # do nothing.
    thermostat = o.get("thermostat")
    if thermostat is not None and ensemble != "nvt":
        raise ValueError(f"{name('thermostat')}: the thermostat choice is for NVT; this run is {ensemble.upper()} "
                         "(NPT thermostats with CSVR in the device engine and Berendsen's in ASE's dynamics)")
    o["thermostat"] = thermostat = (check_choice(name("thermostat"), thermostat, THERMOSTATS)
                                    if thermostat is not None else "langevin" if ensemble == "nvt" else None)
    if o["friction"] is not None and thermostat != "langevin":
        why = f"this run is {ensemble.upper()}" if ensemble != "nvt" else f"this run's thermostat is {thermostat}"
        raise ValueError(f"{name('friction')}: the Langevin friction is for NVT only; {why}")
    o["friction"] = check_number(name("friction"), DEFAULT_FRICTION if o["friction"] is None else o["friction"],
                                 strict=False)
    csvr = ensemble == "nvt" and thermostat == "csvr"
    given_npt = [k for k in NPT_OPTIONS if o[k] is not None and not (csvr and k == "taut_fs")]
    if given_npt and ensemble != "npt":
        raise ValueError(f"{name(given_npt[0])}: a barostat option, for NPT only; this run is {ensemble.upper()} "
                         f"(choose the NPT ensemble to use it)")
    defaults = (DEFAULT_PRESSURE_BAR, DEFAULT_TAUT_FS, DEFAULT_TAUP_FS, DEFAULT_COMPRESSIBILITY_PER_BAR)
    for key, default in zip(NPT_OPTIONS, defaults, strict=True):
        value = default if o[key] is None else o[key]
        o[key] = check_number(name(key), value, minimum=None if key == "pressure_bar" else 0.0)
    if o["max_temperature_K"] is None:
        o["max_temperature_K"] = default_max_temperature(o["temperature_K"])
    else:
        o["max_temperature_K"] = check_number(name("max_temperature_K"), o["max_temperature_K"], allow_inf=True)
        if ensemble != "nve" and o["max_temperature_K"] <= o["temperature_K"]:
            raise ValueError(f"{name('max_temperature_K')}: the blow-up limit {o['max_temperature_K']:g} K must be "
                             f"above the target temperature {o['temperature_K']:g} K")
    o["force"] = check_flag(name("force"), o["force"])
    if o["init_velocities"] is not None:
        o["init_velocities"] = check_flag(name("init_velocities"), o["init_velocities"])
    return o


def ensemble_options(o: dict[str, Any]) -> dict[str, Any]:
    """The checked options run_md takes for ``o``'s ensemble (and thermostat), by name."""
    if o["ensemble"] == "npt":
        return {k: o[k] for k in NPT_OPTIONS}
    if o["ensemble"] == "nvt":
        return {"thermostat": o["thermostat"],
                **({"friction": o["friction"]} if o["thermostat"] == "langevin" else {"taut_fs": o["taut_fs"]})}
    return {}


def check_atoms_for(ensemble: str, atoms: Atoms, name: Callable[[str], str]) -> None:
    if ensemble == "npt" and not (atoms.pbc.all() and abs(atoms.cell.volume) > 0):
        raise ValueError(f"{name('ensemble')}: NPT changes the cell and needs a periodic 3-D cell; this structure "
                         f"has pbc={atoms.pbc.tolist()} and volume {abs(atoms.cell.volume):g} Å^3")


DEFAULTS = {"ensemble": "nvt", "temperature_K": 300.0, "timestep_fs": 0.5, "seed": 0}  # where None was given


def saved_options(o: dict[str, Any]) -> dict[str, Any]:
    """What a frame saves of the checked options ``o`` for a restart (``md_<name>`` in ``atoms.info``): the
    ensemble, the timestep and the options of that ensemble and thermostat (the temperature unless NVE)."""
    saved = {"ensemble": o["ensemble"], "timestep_fs": o["timestep_fs"], "seed": o["seed"], **ensemble_options(o)}
    if o["ensemble"] != "nve":
        saved["temperature_K"] = o["temperature_K"]
    return saved


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, str) and isinstance(b, str):
        return a.lower() == b.lower()
    try:
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-12)
    except (TypeError, ValueError):
        return True  # not a number: the option's own check names it


def with_restart_defaults(given: dict[str, Any], saved: dict[str, Any], source: str, name: Callable[[str], str],
                          new_run: str) -> dict[str, Any]:
    """``given`` (None: not given) with a restart's ``saved`` options as the defaults. A restart continues its
    run: a given value that contradicts a saved one is refused by name. ``source`` names the trajectory,
    ``new_run`` how to start a new run from its last frame."""
    o = dict(given)
    for key, value in saved.items():
        if key not in o:
            continue
        if o[key] is None:
            o[key] = value
        elif not _same(o[key], value):
            shown = value.upper() if key == "ensemble" else value
            raise ValueError(f"{name(key)}: {source} ran with {name(key).lstrip('-')} {shown!s}, and a restart "
                             f"continues its run; leave {name(key)} out, or start a new run from its last frame "
                             f"with other settings ({new_run}: positions and velocities kept)")
    return o


def with_defaults(given: dict[str, Any]) -> dict[str, Any]:
    """``given`` with ``DEFAULTS`` where it holds None."""
    return {k: (DEFAULTS[k] if v is None and k in DEFAULTS else v) for k, v in given.items()}


def check_structure(atoms: Atoms, what: str) -> None:
    """What needs no model: finite positions and cell, a periodic cell that spans its periodic directions."""
    import numpy as np

    positions = atoms.get_positions()
    bad = ~np.isfinite(positions).all(axis=1)
    if bad.any():
        first = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{what}: {int(bad.sum())} of {len(atoms)} atoms have non-finite positions (first: atom "
                         f"{first}, {atoms.get_chemical_symbols()[first]}, {positions[first].tolist()})")
    cell = np.asarray(atoms.cell, dtype=float)
    if not np.isfinite(cell).all():
        raise ValueError(f"{what}: the cell is not finite: {cell.tolist()}")
    pbc = np.asarray(atoms.pbc, dtype=bool)
    if pbc.any():
        vectors = cell[pbc]
        lengths = np.linalg.norm(vectors, axis=1)
        gram = float(np.linalg.det(vectors @ vectors.T))
        if (lengths <= 1e-6).any() or gram <= 1e-12 * float(np.prod(lengths**2)):
            raise ValueError(f"{what}: the cell is singular along its periodic directions (pbc={pbc.tolist()}, cell "
                             f"{np.round(cell, 6).tolist()}): give each periodic direction a cell vector, the "
                             "vectors independent")
