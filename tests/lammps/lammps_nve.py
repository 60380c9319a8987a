"""NVE steps in LAMMPS with a ``cgforge lammps-model`` file (run under mpirun by test_lammps_real.py, beside it).

    mpirun -np 2 python tests/lammps/lammps_nve.py MODEL.pkl DATA.lmp OUT.json --steps 10 --ghost-cutoff 11
    python tests/lammps/lammps_nve.py ... --kokkos gpu   # a Kokkos CUDA build (scripts/lammps_gpu.sh), one GPU
    mpirun -np 2 python tests/lammps/lammps_nve.py ... --kokkos gpu --gpus 2 --ghost-neighbours 0 --ghost-cutoff 6
                                                           # two GPUs, one rank each, exchange mode
    mpirun -np 2 python tests/lammps/lammps_nve.py ... --kokkos host --ghost-neighbours 0 --ghost-cutoff 6
                                                           # a Kokkos host build, exchange mode (one cutoff of ghosts)

Reads a LAMMPS data file (types in ``--elements`` order, velocities included), runs ``fix nve`` with
``pair_style mliap unified MODEL G`` (G = 1: ghost-neighbour mode, 0: exchange mode, which needs the Kokkos
couple) and writes, on rank 0, every atom's position,
force and per-atom energy at each step (sorted by atom id), the potential energy and the pair virial W
(LAMMPS's ``compute pressure NULL virial`` times volume / nktv2p: eV; W = -dE/d strain).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

NKTV2P_METAL = 1.6021765e6  # LAMMPS's force->nktv2p in metal units (update.cpp)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("data")
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dt", type=float, default=0.0005, help="ps")
    parser.add_argument("--elements", default="H O")
    parser.add_argument("--ghost-cutoff", type=float, required=True)
    parser.add_argument("--ghost-neighbours", type=int, default=1)
    parser.add_argument("--every", type=int, default=1, help="record every N steps (0: only the last)")
    parser.add_argument("--sort-every", type=int, default=0,
                        help="LAMMPS sorts (renumbers) its atoms every N steps, at a re-neighbouring (0: never)")
    parser.add_argument("--neighbour-check", choices=["yes", "no"], default="yes",
                        help="no: LAMMPS re-neighbours (rebuilds its ghosts) every step")
    parser.add_argument("--kokkos", choices=["gpu", "host"], default=None,
                        help="run the Kokkos couple: gpu (device arrays) or host (a Kokkos host build)")
    parser.add_argument("--gpus", type=int, default=1, help="with --kokkos gpu: GPUs per node (one MPI rank each)")
    parser.add_argument("--gpu-aware", choices=["on", "off"], default="off",
                        help="with --kokkos gpu: whether MPI reads device memory (off: Kokkos stages through the host)")
    parser.add_argument("--log", default="none", help="LAMMPS's log file (none: no log)")
    parser.add_argument("--timers-report", action="store_true",
                        help="after the steps, print cgforge's timer tables into LAMMPS's screen and log through the "
                             "input's `python` command, as docs/lammps.md tells users to")
    args = parser.parse_args(argv)

    import lammps
    import lammps.mliap

    cmdargs = ["-log", args.log, "-screen", "none", "-nocite"]
    if args.kokkos == "gpu":
        cmdargs += ["-k", "on", "g", str(args.gpus), "-sf", "kk", "-pk", "kokkos", "newton", "on", "neigh", "half",
                    "gpu/aware", args.gpu_aware]
    elif args.kokkos == "host":
        cmdargs += ["-k", "on", "t", "1", "-sf", "kk", "-pk", "kokkos", "newton", "on", "neigh", "half"]
    lmp = lammps.lammps(cmdargs=cmdargs)
    if args.kokkos:
        lammps.mliap.activate_mliappy_kokkos(lmp)
    else:
        lammps.mliap.activate_mliappy(lmp)
    me = lmp.extract_setting("world_rank")
    nprocs = lmp.extract_setting("world_size")
    lmp.commands_string(f"""
        units metal
        atom_style atomic
        atom_modify map array sort {args.sort_every} 0.0
        boundary p p p
        read_data {args.data}
        pair_style mliap unified {args.model} {args.ghost_neighbours}
        pair_coeff * * {args.elements}
        comm_modify cutoff {args.ghost_cutoff}
        neighbor 1.0 bin
        neigh_modify every 1 delay 0 check {args.neighbour_check}
        compute pe_atom all pe/atom
        compute pe_sum all reduce sum c_pe_atom
        compute wvir all pressure NULL virial
        timestep {args.dt}
        fix integrate all nve
        thermo_style custom step pe ke etotal c_pe_sum c_wvir[1]   # per-atom energies and virial every step
        thermo 1
    """)
    frames = []
    start = time.perf_counter()

    def record(step: int) -> None:
        frames.append(_frame(lmp, step))

    lmp.command("run 0")
    record(0)
    every = args.every or args.steps
    done = 0
    while done < args.steps:
        n = min(every, args.steps - done)
        lmp.command(f"run {n} pre no post no")
        done += n
        record(done)
    seconds = time.perf_counter() - start
    if args.timers_report:
        lmp.command('python cgforge_timers input 1 SELF format p here '
                    '"from cgforge.plugin.lammps.timers import report as cgforge_timers"')
        lmp.command("python cgforge_timers invoke")
    if me == 0:
        with open(args.out, "w") as f:
            json.dump({"nprocs": nprocs, "frames": frames, "seconds": seconds, "models": _models()}, f)
    lmp.close()
    return 0


def _models() -> list[dict]:
    """What this rank's cgforge objects did (LAMMPS loaded them from the file: found among the live objects)."""
    import gc

    from cgforge.plugin.lammps import CgforgeMLIAP

    return [{"mode": o.last_mode, "path": o.last_path, "exchanges": o.exchanges, "ranks": o.ranks,
             "cutoff": o.cutoff, "rcutfac": o.rcutfac, "owner_exchanges": o.owner_exchanges,
             "owner_reuses": o._owners.reuses, "owner_refreshes": o._owners.refreshes}
            for o in gc.get_objects() if isinstance(o, CgforgeMLIAP)]


def _frame(lmp, step: int) -> dict:
    n = lmp.get_natoms()
    ids = np.array(lmp.gather_atoms("id", 0, 1), dtype=np.int64)
    order = np.argsort(ids)
    x = np.array(lmp.gather_atoms("x", 1, 3)).reshape(n, 3)[order]
    f = np.array(lmp.gather_atoms("f", 1, 3)).reshape(n, 3)[order]
    v = np.array(lmp.gather_atoms("v", 1, 3)).reshape(n, 3)[order]
    pe_atom = np.array(lmp.gather("c_pe_atom", 1, 1)).reshape(n)[order]
    pe = lmp.get_thermo("pe")
    volume = lmp.get_thermo("vol")
    p = [lmp.extract_compute("wvir", 0, 1)[k] for k in range(6)]  # xx yy zz xy xz yz, bar
    w = np.array([[p[0], p[3], p[4]], [p[3], p[1], p[5]], [p[4], p[5], p[2]]]) * volume / NKTV2P_METAL
    return {"step": step, "x": x.tolist(), "f": f.tolist(), "v": v.tolist(), "pe_atom": pe_atom.tolist(),
            "pe": pe, "virial": w.tolist()}


if __name__ == "__main__":
    sys.exit(main())
