"""The plot at the end of an MD run (``--plot FILE.png``, ``run_md(..., plot=...)``): temperature, total and
potential energy, pressure and volume (NPT) and ns/day against simulated time, from the values recorded at the
progress lines. Matplotlib's Agg canvas without pyplot: no display, no global figure state."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

import numpy as np

from cgforge.atomic import atomic_path


def check_matplotlib(what: str = "plot") -> None:
    """An error naming ``what`` when matplotlib is not installed (checked before a run, not after it)."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError(f"{what}: writing a plot needs matplotlib (pip install matplotlib, or cgforge[plot])")


def write_plot(path: Path, history: list[dict[str, float]], title: str, npt: bool,
               targets: dict[str, float] | None = None) -> bool:
    """Write the figure to ``path`` atomically, ``targets`` (by record key) as dashed lines; False (nothing
    written) when nothing was recorded."""
    if not history:
        return False
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # (y label, [(record key, legend)]) per panel; pressure and volume only for NPT (or when recorded)
    panels = [("temperature [K]", [("temperature_K", "T")]),
              ("energy [eV]", [("etot_eV", "total"), ("epot_eV", "potential")])]
    if npt or any(math.isfinite(r["pressure_bar"]) for r in history):
        panels.append(("pressure [bar]", [("pressure_bar", "P")]))
    if npt:
        panels.append(("volume [Å³]", [("volume_A3", "V")]))
    panels.append(("ns/day", [("ns_per_day", "speed")]))
    fig = Figure(figsize=(7.0, 1.9 * len(panels) + 0.6), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    t = [r["time_ps"] for r in history]
    for ax, (label, series) in zip(axes, panels, strict=True):
        for key, legend in series:
            points = [(x, r[key]) for x, r in zip(t, history, strict=True) if math.isfinite(r[key])]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, marker="." if len(points) < 50 else None, label=legend)
        for key, _ in series:
            if targets and key in targets:
                ax.axhline(targets[key], color="0.4", linestyle="--", linewidth=0.8, label="target")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if len(series) > 1:
            ax.legend(loc="best", fontsize="small")
    axes[-1].set_xlabel("time [ps]")
    fig.suptitle(title, fontsize="medium")
    with atomic_path(path, suffix=path.suffix) as tmp:
        fig.savefig(tmp, dpi=110, format=path.suffix.lstrip(".").lower())
    return True


def record(atoms: Any, step: int, time_fs: float, etot: float, ns_per_day: float) -> dict[str, float]:
    """The values of one progress line (no calculator call: the stress only when the results hold it)."""
    epot = etot - float(atoms.get_kinetic_energy())
    volume = float(atoms.get_volume()) if atoms.pbc.all() and abs(atoms.cell.volume) > 0 else math.nan
    pressure = math.nan
    results = getattr(atoms.calc, "results", None)
    stress = results.get("stress") if isinstance(results, dict) else None
    if stress is not None and math.isfinite(volume):
        from ase import units

        # ASE's stress is the potential part; the ideal-gas (kinetic) part is 2 E_kin / (3 V)
        kinetic = 2.0 * float(atoms.get_kinetic_energy()) / (3.0 * volume)
        s = np.asarray(stress, dtype=float)
        trace = float(np.trace(s)) if s.shape == (3, 3) else float(s[:3].sum())
        pressure = (-trace / 3.0 + kinetic) / units.bar
    return {"step": float(step), "time_ps": time_fs / 1000.0, "temperature_K": float(atoms.get_temperature()),
            "etot_eV": etot, "epot_eV": epot, "ns_per_day": ns_per_day, "volume_A3": volume,
            "pressure_bar": pressure}


def plot_run(path: Path, history: list[dict[str, float]], n_atoms: int, o: dict[str, Any], out: Any,
             what: str = "plot") -> str | None:
    """The path written with the plot of a run's ``history`` (``o``: its options), said on ``out``, or None: a plot
    that cannot be written is a warning line naming ``what``, never the run's error."""
    ensemble = o["ensemble"]
    targets = {"temperature_K": o["temperature_K"]} if ensemble != "nve" else {}
    if ensemble == "npt":
        targets["pressure_bar"] = o["pressure_bar"]
    title = (f"{n_atoms} atoms, {ensemble.upper()}" + (f" {o['temperature_K']:g} K" if ensemble != "nve" else "")
             + (f" {o['pressure_bar']:g} bar" if ensemble == "npt" else "") + f", {o['timestep_fs']:g} fs")
    try:
        if write_plot(path, history, title, ensemble == "npt", targets):
            out(f"plot: {path}")
            return str(path)
        out(f"plot: nothing recorded, {path} not written")
    except Exception as err:
        reason = (err.strerror or str(err)) if isinstance(err, OSError) else f"{type(err).__name__}: {err}"
        out(f"warning: {what}: {path} not written ({reason})")
    return None
