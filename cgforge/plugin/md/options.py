"""The options of :func:`cgforge.plugin.md.run_md` and ``cgforge md``, declared once: :class:`MDOptions`, whose
fields carry default, check, flag, help and restart rule; ``cgforge md``'s flags (:func:`add_arguments`), run_md's
keywords, a restart's defaults, the banner and docs/md.md's table (:func:`options_table`) come from them."""

from __future__ import annotations

import argparse
import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import InitVar, dataclass, field, fields
from functools import partial
from typing import Any

ENSEMBLES = ("nvt", "nve", "npt")
ENGINES = ("auto", "device", "ase")  # auto: the device engine when the calculator runs on CUDA, else ASE's
THERMOSTATS = ("langevin", "csvr")  # NVT; NPT uses CSVR in the engine, Berendsen's in ASE's dynamics
PLOT_SUFFIXES = (".png", ".pdf", ".svg")
# Blow-up limit when none is given: far above any liquid or solid, far below an exploded run; 10x hot targets
MAX_TEMPERATURE_FLOOR_K = 5000.0
MAX_TEMPERATURE_FACTOR = 10.0
# compile auto (compile_trial.py): runs shorter than this are not tried (even the largest saving per step measured
# would not repay the compilation), nor runs whose plain steps take less than this many seconds in all (a tenth off
# the step would not repay it; docs/measured-constants.md)
COMPILE_AUTO_MIN_STEPS = 10_000
COMPILE_AUTO_MIN_SECONDS = 200.0

# A run's mode: the ensemble, and for NVT its thermostat. A field with ``modes`` is refused in the others.
MODES = {"nvt-langevin": "NVT (langevin)", "nvt-csvr": "NVT (csvr)", "nve": "NVE", "npt": "NPT"}
# Restart rules: what ``--restart`` does with a field.
KEPT = "kept"  # saved in every frame (md_<name>); the restart's value is the default, another one is refused
FOLLOWS = "follows"  # the restart's value is the default; another one is allowed and said (not bit for bit)
OWN = "own"  # each run's own (not saved)
REFUSED = "refused"  # a restart continues the saved state: refused with a restart
RESTART_RULES = {KEPT: "the run's; another value is refused", FOLLOWS: "the run's; another one is said",
                 OWN: "this run's", REFUSED: "refused"}


def check_number(name: str, value: Any, *, minimum: float | None = 0.0, strict: bool = True,
                 allow_inf: bool = False) -> float:
    """A float; > minimum (strict) or >= minimum; finite unless ``allow_inf``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):  # numpy's numbers too
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
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
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


def option(default: Any, check: Callable[[str, Any], Any], flag: str, help: str, restart: str = OWN, *,
           value: Any = None, shown: str | None = None, modes: tuple[str, ...] | None = None, role: str = "",
           unit: str = "", **argparse_kwargs: Any) -> Any:
    """A field of :class:`MDOptions` (docs/development.md, "How to add an MD option"): ``shown`` replaces the
    default in help and docs, ``role`` names the field where its ``modes`` refuse it; the rest goes to argparse."""
    if shown is None:
        shown = value if value is not None else default
        shown = f"{shown:g} {unit}".strip() if isinstance(shown, float) else str(shown)
    return field(default=default, metadata=dict(
        check=check, flag=flag, help=help, restart=restart, value=value, shown=shown, modes=modes, role=role,
        unit=unit, argparse=argparse_kwargs))


def _check_compile(name: str, value: Any) -> str:
    """auto, off, or an Inductor mode (True: default; False: off)."""
    if value in ("auto", "off"):
        return value
    from cgforge.plugin.runtime.compiled import parse_compile  # torch: only once a run is planned

    return parse_compile(value, name, others=("auto", "off")) or "off"


_AT_LEAST_0, _ANY_NUMBER = partial(check_number, strict=False), partial(check_number, minimum=None)
_ABOVE_0_OR_INF = partial(check_number, allow_inf=True)
_COUNT_0, _COUNT_1 = partial(check_count, minimum=0), partial(check_count, minimum=1)


@dataclass(frozen=True)
class MDOptions:
    """A run's options, checked once where made: what was not given (None) gets its default; an option of another
    mode is refused, one that does not apply is None. ``names`` maps a keyword to what the user typed."""

    ensemble: str | None = option(None, partial(check_choice, choices=ENSEMBLES), "--ensemble", (
        "nvt (Langevin), nve (velocity Verlet) or npt (isotropic; needs a periodic cell: stochastic cell "
        "rescaling with the CSVR thermostat in the device engine, Berendsen's thermostat and barostat in ASE's "
        "dynamics)"), KEPT, value="nvt", type=str.lower, choices=ENSEMBLES)
    thermostat: str | None = option(None, partial(check_choice, choices=THERMOSTATS), "--thermostat", (
        "NVT: langevin (--friction) or csvr (Bussi's stochastic velocity rescaling; --taut)"), KEPT,
        value="langevin", modes=("nvt-langevin", "nvt-csvr"), role="the thermostat choice", type=str.lower,
        choices=THERMOSTATS)
    temperature_K: float | None = option(None, _AT_LEAST_0, "--temperature", (
        "target temperature in K, and of the initial velocities"), KEPT, value=300.0, unit="K")
    timestep_fs: float | None = option(None, check_number, "--timestep", "timestep in fs", KEPT, value=0.5, unit="fs")
    steps: int = option(100, _COUNT_0, "--steps", "MD steps", type=int)
    friction: float | None = option(None, _AT_LEAST_0, "--friction", "Langevin friction in 1/fs", KEPT,
                                    value=0.01, modes=("nvt-langevin",), role="the Langevin friction", unit="1/fs")
    pressure_bar: float | None = option(None, _ANY_NUMBER, "--pressure", "NPT: pressure in bar", KEPT,
                                        value=1.01325, modes=("npt",), role="the barostat's pressure", unit="bar")
    taut_fs: float | None = option(None, check_number, "--taut", (
        "temperature coupling time in fs of the CSVR thermostat (NVT with --thermostat csvr) and of NPT"), KEPT,
        value=100.0, modes=("nvt-csvr", "npt"), role="the CSVR thermostat's coupling time", unit="fs")
    taup_fs: float | None = option(None, check_number, "--taup", "NPT: pressure coupling time in fs", KEPT,
                                   value=1000.0, modes=("npt",), role="the barostat's coupling time", unit="fs")
    compressibility_per_bar: float | None = option(None, check_number, "--compressibility", (
        "NPT: isothermal compressibility in 1/bar (the default is water's)"), KEPT, value=4.57e-5, modes=("npt",),
        role="the barostat's compressibility", unit="1/bar")
    seed: int | None = option(None, _COUNT_0, "--seed", "velocities, thermostat noise and box", KEPT, value=0,
                              type=int)
    engine: str | None = option(None, partial(check_choice, choices=ENGINES), "--engine", (
        "auto: cgforge's device engine when the model runs on CUDA, ASE's dynamics otherwise; device: the engine also "
        "on a CPU; ase: ASE's dynamics (a restart continues on the engine that wrote it)"), FOLLOWS, value="auto",
        type=str.lower, choices=ENGINES)
    max_temperature_K: float | None = option(None, _ABOVE_0_OR_INF, "--max-temperature", (
        "stop (exit code 3) when the temperature exceeds this, in K ('inf' turns it off); non-finite forces or "
        "energy always stop the run"), shown=f"max({MAX_TEMPERATURE_FLOOR_K:g}, {MAX_TEMPERATURE_FACTOR:g} x the "
        "temperature)")
    trajectory_interval: int = option(10, _COUNT_1, "--traj-interval", (
        "steps between frames (the last step is always written)"), type=int)
    log_interval: int = option(10, _COUNT_1, "--log-interval", "steps between progress lines", type=int)
    init_velocities: bool | None = option(None, check_flag, "--init-velocities", (
        "draw Maxwell-Boltzmann velocities at the temperature (--no-init-velocities: keep the structure's); "
        "default: only when the atoms are at rest"), REFUSED, shown="at rest only",
        action=argparse.BooleanOptionalAction)
    relax: int | None = option(None, _COUNT_0, "--relax", (
        "FIRE steps (to 0.1 eV/Å) before MD; a generated box needs them: its rigid, grid-placed molecules would "
        "otherwise heat to ~1500 K; a restart takes 0 only"), REFUSED, value=0,
        shown="0; cgforge md: 100 for a generated box", type=int)
    compile: str | None = option(None, _check_compile, "--compile", (
        "compile the model with torch.compile (Inductor); MODE: default (the flag alone), max-autotune-no-cudagraphs, "
        f"off, or auto: on a GPU, for a run of at least {COMPILE_AUTO_MIN_STEPS:,} steps whose plain steps take "
        f"{COMPILE_AUTO_MIN_SECONDS:.0f} s or more, a trial on its own system keeps the faster of the plain and the "
        "compiled step"),
        value="auto", type=str, nargs="?", const="default", metavar="MODE")
    force: bool = option(False, check_flag, "--force", (
        "overwrite the trajectory, log and plot files if they exist (never the input files)"), action="store_true")
    names: InitVar[Callable[[str], str] | None] = None

    def __post_init__(self, names: Callable[[str], str] | None) -> None:
        name = names or str
        spec = {f.name: f.metadata for f in fields(self)}
        ensemble = check_choice(name("ensemble"), self.ensemble or "nvt", ENSEMBLES)
        if self.thermostat is not None and ensemble != "nvt":
            _not_for(name("thermostat"), spec["thermostat"], ensemble)
        thermostat = check_choice(name("thermostat"), self.thermostat or "langevin", THERMOSTATS) \
            if ensemble == "nvt" else None
        mode = f"nvt-{thermostat}" if thermostat else ensemble
        done = {"ensemble": ensemble, "thermostat": thermostat}
        for key, meta in spec.items():
            value = getattr(self, key)
            applies = meta["modes"] is None or mode in meta["modes"]
            if key in done:
                value = done[key]
            elif value is not None and not applies:
                _not_for(name(key), meta, mode)
            elif applies and (value := meta["value"] if value is None else value) is not None:
                value = meta["check"](name(key), value)
            object.__setattr__(self, key, value if applies else None)
        if self.max_temperature_K is None:
            object.__setattr__(self, "max_temperature_K", max(MAX_TEMPERATURE_FLOOR_K,
                                                              MAX_TEMPERATURE_FACTOR * self.temperature_K))
        elif ensemble != "nve" and self.max_temperature_K <= self.temperature_K:
            raise ValueError(f"{name('max_temperature_K')}: the blow-up limit {self.max_temperature_K:g} K must be "
                             f"above the target temperature {self.temperature_K:g} K")

    def __getitem__(self, key: str) -> Any:
        return getattr(self, key)

    @classmethod
    def given(cls, given: Mapping[str, Any], names: Callable[[str], str] | None = None,
              saved: Mapping[str, Any] | None = None, source: str = "", new_run: str = "") -> MDOptions:
        """``given``'s options; after a restart a kept option not given is the ``saved`` one, another is refused."""
        name = names or str
        o = dict(given)
        for key, value in (saved or {}).items():
            rule = cls.__dataclass_fields__[key].metadata["restart"]
            if o.get(key) is None:
                o[key] = value
            elif rule == KEPT and not _same(o[key], value):
                shown = value.upper() if key == "ensemble" else value
                raise ValueError(f"{name(key)}: {source} ran with {name(key).lstrip('-')} {shown!s}, and a restart "
                                 f"continues its run; leave {name(key)} out, or start a new run from its last frame "
                                 f"with other settings ({new_run}: positions and velocities kept)")
        old_nve = (saved or {}).get("ensemble") == "nve" and "temperature_K" not in saved  # saved before issue 61
        if old_nve and given.get("temperature_K") is not None:
            raise ValueError(f"{name('temperature_K')}: {source} saved no temperature (an NVE run: its restart "
                             f"continues the saved velocities); leave {name('temperature_K')} out "
                             f"({name('max_temperature_K')} sets the blow-up limit)")
        return cls(**o, names=names)

    def saved(self) -> dict[str, Any]:
        """What a frame saves for a restart (``md_<name>``): the kept options of the run's mode."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.metadata["restart"] == KEPT and getattr(self, f.name) is not None}

    def describe(self) -> str:
        """The physics of the run in words: 'NPT at 300 K and 1.01325 bar, taut 100 fs, ..., timestep 0.5 fs'."""
        head = self.ensemble.upper() + (f" ({self.thermostat})" if self.thermostat else "") + (
            f" at {self.temperature_K:g} K" if self.ensemble != "nve" else "") + (
            f" and {self.pressure_bar:g} bar" if self.pressure_bar is not None else "")
        more = [f"{f.metadata['flag'].lstrip('-')} {getattr(self, f.name):g} {f.metadata['unit']}"
                for f in fields(self) if f.metadata["modes"] and f.metadata["unit"] and f.name != "pressure_bar"
                and getattr(self, f.name) is not None]
        return ", ".join([head, *more, f"timestep {self.timestep_fs:g} fs"])


@dataclass(frozen=True)
class EngineOptions:
    """How the device engine runs (``Engine(engine_options=)``, ``run_md(engine_options=)``,
    ``run_md_batch(engine_options=)``), checked where made. block: steps between host syncs (None: 10; run_md: by
    device); steps_per_graph: steps in one CUDA graph; rebuild_margin: how much faster than seen the list's slack is
    assumed to shrink; cuda_graph, pipelined_rebuild (the next list searched on a side stream), fuse_integrator (the
    integrator compiled): None decides by device; padded: run_md_batch's padded step without the capture (None: as
    cuda_graph; how a CPU checks it). ``run_md_batch`` reads cuda_graph and padded only, ``Engine`` all but padded."""

    block: int | None = None
    steps_per_graph: int = 1
    cuda_graph: bool | None = None
    rebuild_margin: float = 1.5
    pipelined_rebuild: bool | None = None
    fuse_integrator: bool | None = None
    padded: bool | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "block", None if self.block is None else check_count("block", self.block, 1))
        object.__setattr__(self, "steps_per_graph", check_count("steps_per_graph", self.steps_per_graph, 1))
        object.__setattr__(self, "rebuild_margin", _AT_LEAST_0("rebuild_margin", self.rebuild_margin))
        for name in ("cuda_graph", "pipelined_rebuild", "fuse_integrator", "padded"):
            if getattr(self, name) not in (None, True, False):
                raise TypeError(f"{name}: expected None, True or False, got {getattr(self, name)!r}")

    @classmethod
    def of(cls, value: EngineOptions | Mapping[str, Any] | None, name: str = "engine_options") -> EngineOptions:
        """``value`` (EngineOptions, a dict of its fields or None: the defaults) as EngineOptions."""
        if value is None or isinstance(value, cls):
            return cls() if value is None else value
        if not isinstance(value, Mapping):
            raise TypeError(f"{name}: expected EngineOptions, a dict or None, got {type(value).__name__}")
        known = [f.name for f in fields(cls)]
        if unknown := sorted(map(str, set(value) - set(known))):
            raise ValueError(f"{name}: unknown key {unknown[0]!r}; known: {', '.join(known)}")
        return cls(**value)

    def only(self, used: tuple[str, ...], user: str) -> EngineOptions:
        """This value, refused where a field outside ``used`` is not its default (``user`` ignores it)."""
        for f in fields(self):
            if f.name not in used and getattr(self, f.name) != f.default:
                raise ValueError(f"engine_options: {f.name}={getattr(self, f.name)!r} has no effect on {user}, which "
                                 f"reads {', '.join(used)} only")
        return self

    def for_one_structure(self, user: str) -> EngineOptions:
        """This value, refused where it sets what only a batch reads (padded)."""
        return self.only(tuple(f.name for f in fields(self) if f.name != "padded"), user)


def _not_for(name: str, meta: Mapping[str, Any], mode: str) -> None:
    modes = meta["modes"]
    where = "NVT" if set(modes) == {"nvt-langevin", "nvt-csvr"} else " and ".join(MODES[m] for m in modes)
    raise ValueError(f"{name}: {meta['role']} is for {where}; this run is {MODES[mode]} (choose that ensemble or "
                     "thermostat to use it)")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, str) and isinstance(b, str):
        return a.lower() == b.lower()
    try:
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-12)
    except (TypeError, ValueError):
        return True  # not a number: the option's own check names it


OPTION_FIELDS = {f.name: f.metadata for f in fields(MDOptions)}


def refuse_on_restart(given: Mapping[str, Any], names: Callable[[str], str]) -> None:
    """Before a restart's file is read: refuse a given option a restart refuses (unless it does nothing)."""
    for key, meta in OPTION_FIELDS.items():
        if meta["restart"] == REFUSED and given.get(key) is not None and given[key] != meta["value"]:
            raise ValueError(f"{names(key)}: a restart continues the saved state (velocities, random state); leave "
                             f"{names(key)} out")


def read_saved(info: Mapping[str, Any]) -> dict[str, Any]:
    """The kept options a frame's ``info`` saved (``md_<name>``), of their flag's type (float unless declared)."""
    return {k: meta["argparse"].get("type", float)(info[f"md_{k}"]) for k, meta in OPTION_FIELDS.items()
            if meta["restart"] == KEPT and f"md_{k}" in info}


def add_arguments(parser: argparse.ArgumentParser, keys: tuple[str, ...] | None = None,
                  override: Mapping[str, Mapping[str, Any]] | None = None) -> None:
    """One flag per :class:`MDOptions` field (None when not given); ``keys``: only these; ``override``: argparse's."""
    for key, meta in OPTION_FIELDS.items():
        if keys is not None and key not in keys:
            continue
        kwargs = {"type": float, **meta["argparse"]}
        if "action" in kwargs:
            kwargs.pop("type")
        elif "choices" not in kwargs:  # argparse shows the choices, else the flag's name
            kwargs.setdefault("metavar", meta["flag"].lstrip("-").upper())
        note = "; after --restart: the run's saved value, and another value is refused" if meta["restart"] == KEPT \
            and keys is None else ""
        kwargs["help"] = f"{meta['help']} (default {meta['shown']}{note})".replace("%", "%%")
        kwargs.update((override or {}).get(key, {}))
        parser.add_argument(meta["flag"], dest=key, default=None, **kwargs)


def given_by_args(args: argparse.Namespace) -> dict[str, Any]:
    """The options the command line gave (the others are not given: None)."""
    return {key: getattr(args, key) for key in OPTION_FIELDS if getattr(args, key, None) is not None}


def options_table() -> str:
    """docs/md.md's table of the options: flag, keyword, default, after a restart, meaning."""
    rows = ["| flag | `run_md` keyword | default | after `--restart` | meaning |", "|---|---|---|---|---|"]
    rows += [f"| `{meta['flag']}` | `{key}` | {meta['shown']} | {RESTART_RULES[meta['restart']]} | {meta['help']} |"
             for key, meta in OPTION_FIELDS.items()]
    return "\n".join(rows)

