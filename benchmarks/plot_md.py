"""Plot seconds per MD step against the number of atoms from bench_md.py's JSON files.

    python benchmarks/plot_md.py OUT.png benchmarks/results/md-*.json [--dtype float32] [--kind nvt]

One line per (model, backend); rows that ran out of memory or failed are left out. Needs matplotlib.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def load_rows(paths: list[Path], dtype: str, kind: str,
              skip_systems: tuple[str, ...] = ()) -> dict[tuple[str, str], list[tuple[int, float]]]:
    """{(model, backend): [(atoms, seconds per step)]}, the last file's row winning for a repeated point."""
    points: dict[tuple[str, str], dict[int, float]] = defaultdict(dict)
    for path in paths:
        for row in json.loads(path.read_text())["rows"]:
            seconds = row.get(f"{kind}_s")
            if row.get("dtype") != dtype or not isinstance(seconds, int | float) or row.get("system") in skip_systems:
                continue
            points[(row["model"], row["backend"])][int(row["atoms"])] = float(seconds)
    return {key: sorted(values.items()) for key, values in points.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("png", type=Path)
    parser.add_argument("json", type=Path, nargs="+")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kind", default="nvt", choices=("nvt", "npt"))
    parser.add_argument("--title", default="")
    parser.add_argument("--skip-systems", default="dhfr", help="comma-separated systems left out (not water)")
    args = parser.parse_args(argv)
    if args.png.exists():
        raise SystemExit(f"{args.png} exists; give a new file name")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = load_rows(args.json, args.dtype, args.kind, tuple(filter(None, args.skip_systems.split(","))))
    if not series:
        raise SystemExit(f"no {args.dtype} {args.kind} rows in {[str(p) for p in args.json]}")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    models = sorted({model for model, _ in series})
    backends = sorted({backend for _, backend in series})
    colours = {model: plt.get_cmap("tab10")(i) for i, model in enumerate(models)}  # colour: model
    markers = dict(zip(backends, "osD^vP*X"))  # marker: backend
    for (model, backend), values in sorted(series.items()):
        atoms, seconds = zip(*values, strict=True)
        style = "-" if backend.startswith("cgforge") else "--"
        ax.plot(atoms, [1e3 * s for s in seconds], style, color=colours[model], marker=markers.get(backend, "o"),
                label=f"{model} / {backend}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("atoms")
    ax.set_ylabel(f"ms per MD step ({args.kind.upper()}, {args.dtype})")
    ax.set_title(args.title or "MD step time (solid: cgforge, dashed: peers)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(args.png, dpi=120)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
