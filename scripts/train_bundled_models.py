"""Make the bundled water models: cgforge/models/water-mace.model and cgforge/models/water-nequip.nequip.zip.

The labels come from the project's own flexible classical water model, q-SPC/Fw with damped-shifted-force
Coulomb (cgforge/plugin/water.py), so the whole pipeline runs offline on a laptop CPU:

    python scripts/train_bundled_models.py                 # all stages, ~1 h on a shared 2-core CPU
    python scripts/train_bundled_models.py --stage data    # one stage: data | mace | nequip | evaluate

Stages (intermediate files under --workdir, default build/bundled-models/, git-ignored):
  data      Langevin MD of periodic water boxes with q-SPC/Fw (several densities, temperatures and strained
            cells; frames from the first step on, so the hot start from a grid is covered), plus copies
            with random displacements. Energy, forces and stress of every frame -> train/valid/test.xyz.
  mace      mace_run_train on it -> cgforge/models/water-mace.model (whole pickled ScaleShiftMACE, float32).
  nequip    nequip-train + nequip-package -> cgforge/models/water-nequip.nequip.zip (model_dtype float32).
  evaluate  test-set errors of both models through MACE's and NequIP's own ASE calculators, and a short
            NVT stability run with each and with q-SPC/Fw itself -> <workdir>/metrics.json (quoted in
            cgforge/models/README.md).

Every random choice has a fixed seed. Training is deterministic for a given machine and thread count.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from cgforge.plugin.runtime.bundled import MODEL_FILES, NAMES

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO / "cgforge" / "models"  # the checkout's package folder (an installed cgforge's may not be writable)
MACE_MODEL = MODELS / MODEL_FILES["mace"]
NEQUIP_MODEL = MODELS / MODEL_FILES["nequip"]
STAGES = ("data", "mace", "nequip", "evaluate")

# Shared by both models: 5 Å is past the first two O-O shells' onset (2.8 Å, 4.5 Å); two message
# passing steps see 10 Å, about the q-SPC/Fw DSF cutoff (9 Å).
R_MAX = 5.0
TIMESTEP_FS = 0.5  # resolves the O-H stretch (period ~ 9 fs)
FRICTION_PER_FS = 0.02  # strong Langevin coupling: the hot grid start cools within ~100 fs
KEYS = {"energy": "REF_energy", "forces": "REF_forces", "stress": "REF_stress"}  # not ASE's own names


# ---------------------------------------------------------------------------------------------
# Data


@dataclass(frozen=True)
class Trajectory:
    """One q-SPC/Fw Langevin run; frames every ``every`` steps from step 0."""

    name: str
    n_molecules: int
    density: float  # g/cm^3
    temperature: float  # K
    seed: int
    strain: float = 0.0  # largest |component| of a random symmetric strain applied to the cell
    steps: int = 1000
    every: int = 25
    rattled_every: int = 4  # every 4th frame also gives a copy with Gaussian displacements (0 = none)


TRAIN_TRAJECTORIES = (
    Trajectory("liquid-300-a", 32, 1.00, 300, seed=1),
    Trajectory("liquid-300-b", 32, 1.00, 300, seed=2),
    Trajectory("liquid-350", 32, 1.00, 350, seed=3),
    Trajectory("liquid-450", 32, 1.00, 450, seed=4),
    Trajectory("hot-600", 32, 1.00, 600, seed=5),
    Trajectory("sparse-0.90", 32, 0.90, 300, seed=6),
    Trajectory("dense-1.10", 32, 1.10, 350, seed=7),
    # compressed cells: close O-O and O...H contacts, so the models learn the short-range repulsion
    Trajectory("dense-1.25", 32, 1.25, 400, seed=8),
    Trajectory("dense-1.40", 32, 1.40, 300, seed=9),
    Trajectory("strained-a", 32, 1.00, 300, seed=10, strain=0.04),
    Trajectory("strained-b", 32, 1.05, 400, seed=11, strain=0.04),
    Trajectory("box64-300", 64, 1.00, 300, seed=12),
)
# Held out: fresh seeds, a 64-molecule box and a strained cell, plain MD frames only.
TEST_TRAJECTORIES = (
    Trajectory("test-300", 32, 1.00, 300, seed=101, every=50, rattled_every=0),
    Trajectory("test-64-350", 64, 1.02, 350, seed=102, strain=0.02, every=50, rattled_every=0),
)
RATTLE_ANGSTROM = 0.04
VALID_FRACTION = 0.1


def _thermalize(atoms, temperature_K: float, rng: np.random.Generator) -> None:
    try:
        from ase.md.velocitydistribution import thermalize_momenta  # ase >= 3.29
    except ImportError:
        from ase.md.velocitydistribution import MaxwellBoltzmannDistribution as thermalize_momenta
    thermalize_momenta(atoms, temperature_K=temperature_K, rng=rng)


def _random_strain(rng: np.random.Generator, size: float) -> np.ndarray:
    e = rng.uniform(-size, size, (3, 3))
    return np.eye(3) + 0.5 * (e + e.T)


def _label(atoms, calc):
    """A copy of ``atoms`` carrying q-SPC/Fw energy, forces, stress under ``KEYS`` (no calculator)."""
    atoms = atoms.copy()
    atoms.calc = calc
    energy, forces, stress = atoms.get_potential_energy(), atoms.get_forces(), atoms.get_stress()
    atoms.calc = None
    atoms.info[KEYS["energy"]] = float(energy)
    atoms.info[KEYS["stress"]] = stress.copy()  # Voigt order xx yy zz yz xz xy, ASE sign
    atoms.arrays[KEYS["forces"]] = forces.copy()
    return atoms


def run_trajectory(spec: Trajectory) -> list:
    """Labelled frames of one q-SPC/Fw Langevin run (and their rattled copies)."""
    from ase import units
    from ase.md.langevin import Langevin

    from cgforge.plugin.water import QSPCFwCalculator, water_box

    rng = np.random.default_rng(spec.seed)
    atoms = water_box(spec.n_molecules, density=spec.density, seed=spec.seed)
    if spec.strain:
        atoms.set_cell(atoms.cell.array @ _random_strain(rng, spec.strain), scale_atoms=True)
    calc = QSPCFwCalculator()
    atoms.calc = calc
    _thermalize(atoms, temperature_K=spec.temperature, rng=rng)
    dynamics = Langevin(atoms, TIMESTEP_FS * units.fs, temperature_K=spec.temperature,
                        friction=FRICTION_PER_FS / units.fs, fixcm=False, rng=rng)
    frames = []
    for index in range(spec.steps // spec.every):
        if index:
            dynamics.run(spec.every)
        frame = _label(atoms, calc)
        frame.info["config_type"] = spec.name
        frames.append(frame)
        if spec.rattled_every and index % spec.rattled_every == spec.rattled_every - 1:
            rattled = atoms.copy()
            rattled.positions += rng.normal(scale=RATTLE_ANGSTROM, size=rattled.positions.shape)
            rattled = _label(rattled, QSPCFwCalculator())
            rattled.info["config_type"] = spec.name + "-rattled"
            frames.append(rattled)
    return frames


def make_data(workdir: Path) -> dict:
    from ase.io import write

    started = time.time()
    frames = []
    for spec in TRAIN_TRAJECTORIES:
        t = time.time()
        frames += run_trajectory(spec)
        print(f"  {spec.name}: {len(frames)} frames so far ({time.time() - t:.0f} s)", flush=True)
    order = np.random.default_rng(0).permutation(len(frames))
    n_valid = round(VALID_FRACTION * len(frames))
    valid = [frames[i] for i in sorted(order[:n_valid])]
    train = [frames[i] for i in sorted(order[n_valid:])]
    test = []
    for spec in TEST_TRAJECTORIES:
        test += run_trajectory(spec)
    for name, subset in (("train", train), ("valid", valid), ("test", test)):
        write(workdir / f"{name}.xyz", subset, format="extxyz")
    summary = {
        "frames": {"train": len(train), "valid": len(valid), "test": len(test)},
        "atoms": {"train": sum(len(a) for a in train)},
        "seconds": round(time.time() - started),
        "trajectories": {"train": [asdict(s) for s in TRAIN_TRAJECTORIES],
                         "test": [asdict(s) for s in TEST_TRAJECTORIES]},
    }
    (workdir / "data.json").write_text(json.dumps(summary, indent=1))
    print(f"data: {summary['frames']} in {summary['seconds']} s")
    return summary


# ---------------------------------------------------------------------------------------------
# Helpers for the training stages


def _child_env(threads: int) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), HYDRA_FULL_ERROR="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["CUDA_VISIBLE_DEVICES"] = ""  # CPU training, also on a GPU machine: reproducible numbers
    return env


def _run(cmd: list[str], cwd: Path, log: Path, threads: int) -> float:
    """Run ``cmd``, output to ``log``; raise with the log's tail on failure. Returns seconds taken."""
    print("  $ " + " ".join(cmd), flush=True)
    started = time.time()
    with open(log, "w") as out:
        code = subprocess.call(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=_child_env(threads))
    if code:
        raise RuntimeError(f"{cmd[2] if len(cmd) > 2 else cmd[0]} failed (exit {code}); last lines of {log}:\n"
                           + log.read_text()[-3000:])
    return time.time() - started


def _need_data(workdir: Path) -> None:
    missing = [n for n in ("train.xyz", "valid.xyz", "test.xyz") if not (workdir / n).exists()]
    if missing:
        raise FileNotFoundError(f"{workdir}: {', '.join(missing)} missing; run the data stage first "
                                f"(python scripts/train_bundled_models.py --stage data)")


# ---------------------------------------------------------------------------------------------
# MACE

MACE_EPOCHS = 10
MACE_ARGS = {
    "model": "MACE",  # mace_run_train builds a ScaleShiftMACE for this
    "num_channels": 32,
    "max_L": 1,  # 32x0e+32x1o messages: vector features, so both l=0 and l=1 kernel paths are exercised
    "max_ell": 2,
    "correlation": 2,  # 3 costs ~20% more per step on the CPU for little gain on a two-body-dominated model
    "num_interactions": 2,
    "r_max": R_MAX,
    "num_radial_basis": 8,
    "num_cutoff_basis": 5,
    "radial_MLP": "[32, 32]",
    "E0s": "{1: 0.0, 8: 0.0}",  # q-SPC/Fw's zero is separated molecules at rest: no per-element offset
    "scaling": "rms_forces_scaling",
    "loss": "stress",  # weighted energy (per atom) + forces + stress
    "energy_weight": 100.0,
    "forces_weight": 100.0,
    "stress_weight": 1000.0,
    "batch_size": 4,
    "valid_batch_size": 8,
    "lr": 0.01,
    "scheduler": "ExponentialLR",  # fixed decay to lr/10 over the run (set in train_mace)
    "ema_decay": 0.99,
    "default_dtype": "float32",  # 2.5x faster than float64 on the CPU; cgforge.patches.load converts
    "device": "cpu",
    "seed": 1,
    "error_table": "PerAtomRMSEstressvirials",
    "eval_interval": 2,
}


def train_mace(workdir: Path, threads: int, epochs: int) -> dict:
    _need_data(workdir)
    run_dir = workdir / "mace"
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: mace_run_train would resume old checkpoints
    run_dir.mkdir()
    args = dict(MACE_ARGS, max_num_epochs=epochs, lr_scheduler_gamma=round(0.1 ** (1 / epochs), 6), name="water-mace",
                train_file=str(workdir / "train.xyz"), valid_file=str(workdir / "valid.xyz"),
                test_file=str(workdir / "test.xyz"), energy_key=KEYS["energy"], forces_key=KEYS["forces"],
                stress_key=KEYS["stress"])
    cmd = [sys.executable, "-m", "mace.cli.run_train"] + [f"--{k}={v}" for k, v in args.items()]
    cmd += ["--ema", "--amsgrad", "--save_cpu"]
    seconds = _run(cmd, run_dir, run_dir / "train.log", threads)
    produced = run_dir / "water-mace.model"
    if not produced.exists():
        raise RuntimeError(f"mace_run_train finished but wrote no {produced}")
    MODELS.mkdir(exist_ok=True)
    shutil.copyfile(produced, MACE_MODEL)
    print(f"mace: {MACE_MODEL} ({MACE_MODEL.stat().st_size / 1e6:.2f} MB) in {seconds / 60:.1f} min")
    return {"seconds": round(seconds), "epochs": epochs, "args": args}


# ---------------------------------------------------------------------------------------------
# NequIP

NEQUIP_EPOCHS = 20
NEQUIP_CONFIG = """\
# Written by scripts/train_bundled_models.py; train with nequip-train -cp DIR -cn water-nequip
run: [train]
seed: 1
cutoff_radius: @R_MAX@
model_type_names: [H, O]
chemical_species: ${model_type_names}
data:
  _target_: nequip.data.datamodule.ASEDataModule
  seed: ${seed}
  train_file_path: @TRAIN@
  val_file_path: @VALID@
  key_mapping: {REF_energy: total_energy, REF_forces: forces, REF_stress: stress}
  transforms:
    - _target_: nequip.data.transforms.ChemicalSpeciesToAtomTypeMapper
      model_type_names: ${model_type_names}
      chemical_species_to_atom_type_map: ${list_to_identity_dict:${chemical_species}}
    - _target_: nequip.data.transforms.NeighborListTransform
      r_max: ${cutoff_radius}
  train_dataloader: {_target_: torch.utils.data.DataLoader, batch_size: 4, shuffle: true}
  val_dataloader: {_target_: torch.utils.data.DataLoader, batch_size: 8}
  stats_manager:
    _target_: nequip.data.CommonDataStatisticsManager
    type_names: ${model_type_names}
trainer:
  _target_: lightning.Trainer
  accelerator: cpu
  max_epochs: @EPOCHS@
  check_val_every_n_epoch: 1
  log_every_n_steps: 20
  enable_progress_bar: false
  logger: {_target_: lightning.pytorch.loggers.CSVLogger, save_dir: ., name: logs, version: 0}
  callbacks:
    - _target_: lightning.pytorch.callbacks.ModelCheckpoint
      dirpath: ${hydra:runtime.output_dir}
      filename: last  # the final weights: the learning rate decays on a fixed schedule
      # Save at the end of the training epoch, after nequip's EMA module has swapped its averaged weights
      # back: at validation end Lightning runs this callback before the module's swap, and the checkpoint
      # would then hold the weights the wrong way round (nequip-package refuses it).
      save_on_train_epoch_end: true
training_module:
  _target_: nequip.train.EMALightningModule
  ema_decay: 0.99
  loss:
    _target_: nequip.train.EnergyForceStressLoss
    per_atom_energy: true
    coeffs: {total_energy: 100.0, forces: 100.0, stress: 1000.0}
  val_metrics:
    _target_: nequip.train.EnergyForceStressMetrics
    coeffs: {per_atom_energy_rmse: 1.0, forces_rmse: 1.0, stress_rmse: 1.0}
  train_metrics: ${training_module.val_metrics}
  optimizer: {_target_: torch.optim.Adam, lr: 0.01, amsgrad: true}
  lr_scheduler:
    scheduler: {_target_: torch.optim.lr_scheduler.ExponentialLR, gamma: @GAMMA@}
    interval: epoch
    frequency: 1
  model:
    _target_: nequip.model.NequIPGNNModel
    seed: ${seed}
    model_dtype: float32
    type_names: ${model_type_names}
    r_max: ${cutoff_radius}
    l_max: 1
    parity: true
    num_layers: 2
    num_features: 32
    num_bessels: 8
    polynomial_cutoff_p: 6
    radial_mlp_depth: 2
    radial_mlp_width: 32
    avg_num_neighbors: ${training_data_stats:num_neighbors_mean}
    per_type_energy_shifts: {H: 0.0, O: 0.0}
    per_type_energy_scales: ${training_data_stats:forces_rms}
    per_type_energy_scales_trainable: false
    per_type_energy_shifts_trainable: false
"""


def nequip_config(workdir: Path, epochs: int) -> str:
    text = NEQUIP_CONFIG.replace("@R_MAX@", str(R_MAX)).replace("@EPOCHS@", str(epochs))
    text = text.replace("@GAMMA@", str(round(0.1 ** (1 / epochs), 6)))  # lr/10 at the end, as for MACE
    return text.replace("@TRAIN@", str(workdir / "train.xyz")).replace("@VALID@", str(workdir / "valid.xyz"))


def train_nequip(workdir: Path, threads: int, epochs: int) -> dict:
    _need_data(workdir)
    run_dir = workdir / "nequip"
    run_dir.mkdir(exist_ok=True)
    shutil.rmtree(run_dir / "run", ignore_errors=True)  # a fresh run, not a resumed one
    (run_dir / "water-nequip.yaml").write_text(nequip_config(workdir, epochs))
    train_cmd = [sys.executable, "-m", "nequip.scripts.train", "-cp", str(run_dir), "-cn", "water-nequip",
                 f"hydra.run.dir={run_dir / 'run'}"]
    seconds = _run(train_cmd, run_dir, run_dir / "train.log", threads)
    checkpoint = run_dir / "run" / "last.ckpt"
    if not checkpoint.exists():
        raise RuntimeError(f"nequip-train finished but wrote no {checkpoint}")
    packaged = run_dir / "water-nequip.nequip.zip"
    package_cmd = [sys.executable, "-m", "nequip.scripts.package", "build", str(checkpoint), str(packaged)]
    seconds += _run(package_cmd, run_dir, run_dir / "package.log", threads)
    MODELS.mkdir(exist_ok=True)
    shutil.copyfile(packaged, NEQUIP_MODEL)
    print(f"nequip: {NEQUIP_MODEL} ({NEQUIP_MODEL.stat().st_size / 1e6:.2f} MB) in {seconds / 60:.1f} min")
    return {"seconds": round(seconds), "epochs": epochs}


# ---------------------------------------------------------------------------------------------
# Evaluation: test-set errors and an NVT stability run, through each package's own ASE calculator


def model_calculator(kind: str):
    """MACE's or NequIP's own ASE calculator for the bundled model (no cgforge involved)."""
    if kind == "mace":
        from mace.calculators import MACECalculator

        return MACECalculator(model_paths=str(MACE_MODEL), device="cpu", default_dtype="float32")  # as trained
    from nequip.integrations.ase import NequIPCalculator

    return NequIPCalculator._from_saved_model(str(NEQUIP_MODEL), device="cpu", chemical_species_to_atom_type_map=True)


def test_errors(calc, frames: list) -> dict:
    """RMSEs against the q-SPC/Fw labels: energy per atom (meV), forces (meV/Å), stress (meV/Å^3)."""
    de, df, ds = [], [], []
    for frame in frames:
        atoms = frame.copy()
        atoms.calc = calc
        de.append((atoms.get_potential_energy() - frame.info[KEYS["energy"]]) / len(atoms))
        df.append((atoms.get_forces() - frame.arrays[KEYS["forces"]]).ravel())
        ds.append(atoms.get_stress() - frame.info[KEYS["stress"]])
    rms = lambda x: float(np.sqrt(np.mean(np.square(np.concatenate([np.ravel(v) for v in x])))) * 1000)
    reference_forces = np.concatenate([f.arrays[KEYS["forces"]].ravel() for f in frames])
    return {"energy_rmse_mev_per_atom": rms(de), "forces_rmse_mev_per_a": rms(df),
            "stress_rmse_mev_per_a3": rms(ds),
            "forces_rms_reference_mev_per_a": float(np.sqrt(np.mean(reference_forces**2)) * 1000),
            "frames": len(frames)}


def oh_lengths(atoms) -> np.ndarray:
    """The 2M intramolecular O-H distances (minimum image), atoms ordered O, H, H."""
    from ase.geometry import find_mic

    positions = atoms.positions.reshape(-1, 3, 3)
    vectors = (positions[:, 1:] - positions[:, :1]).reshape(-1, 3)
    vectors, lengths = find_mic(vectors, atoms.cell, atoms.pbc)
    return lengths


def stability_run(calc, n_molecules: int, steps: int, temperature: float = 300.0, seed: int = 7) -> dict:
    """NVT Langevin from a fresh grid box (0.5 fs); O-H range and temperature over the run."""
    from ase import units
    from ase.md.langevin import Langevin

    from cgforge.plugin.water import water_box

    atoms = water_box(n_molecules, density=1.0, seed=seed)
    atoms.calc = calc
    rng = np.random.default_rng(seed)
    _thermalize(atoms, temperature_K=temperature, rng=rng)
    dynamics = Langevin(atoms, TIMESTEP_FS * units.fs, temperature_K=temperature, friction=0.01 / units.fs,
                        fixcm=False, rng=rng)
    oh_min, oh_max, temps, closest_oo = np.inf, 0.0, [], np.inf
    started = time.time()
    for _ in range(steps // 10):
        dynamics.run(10)
        lengths = oh_lengths(atoms)
        oh_min, oh_max = min(oh_min, lengths.min()), max(oh_max, lengths.max())
        temps.append(atoms.get_temperature())
        oxygens = atoms[atoms.numbers == 8]
        d = oxygens.get_all_distances(mic=True)
        closest_oo = min(closest_oo, d[np.triu_indices(len(oxygens), 1)].min())
    half = len(temps) // 2
    return {"molecules": n_molecules, "steps": steps, "timestep_fs": TIMESTEP_FS,
            "oh_min_a": float(oh_min), "oh_max_a": float(oh_max), "oo_min_a": float(closest_oo),
            "temperature_mean_second_half_k": float(np.mean(temps[half:])),
            "temperature_max_k": float(np.max(temps)), "seconds": round(time.time() - started)}


def evaluate(workdir: Path, md_steps: int, md_molecules: int, kinds: list[str]) -> dict:
    import torch
    from ase.io import read

    _need_data(workdir)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    test = read(workdir / "test.xyz", index=":")
    results = {}
    for kind, path in (("mace", MACE_MODEL), ("nequip", NEQUIP_MODEL)):
        if kind not in kinds:
            continue
        if not path.exists():
            print(f"evaluate: {path} missing, skipped")
            continue
        errors = test_errors(model_calculator(kind), test)
        print(f"{kind}: test {errors}", flush=True)
        md = stability_run(model_calculator(kind), md_molecules, md_steps) if md_steps else None
        print(f"{kind}: NVT {md}", flush=True)
        results[kind] = {"test": errors, "nvt": md, "size_mb": round(path.stat().st_size / 1e6, 3)}
    if "qspcfw" in kinds and md_steps:  # the reference's own O-H/O-O ranges and temperature, same protocol
        from cgforge.plugin.water import QSPCFwCalculator

        results["qspcfw"] = {"nvt": stability_run(QSPCFwCalculator(), md_molecules, md_steps)}
        print(f"qspcfw: NVT {results['qspcfw']['nvt']}", flush=True)
    return results


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", choices=(*STAGES, "all"), default="all")
    parser.add_argument("--workdir", type=Path, default=REPO / "build" / "bundled-models")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per training (1 made the shipped models)")
    parser.add_argument("--mace-epochs", type=int, default=MACE_EPOCHS)
    parser.add_argument("--nequip-epochs", type=int, default=NEQUIP_EPOCHS)
    parser.add_argument("--md-steps", type=int, default=2000, help="NVT steps of the stability check (0: none)")
    parser.add_argument("--md-molecules", type=int, default=64)
    parser.add_argument("--kinds", nargs="+", choices=(*NAMES, "qspcfw"),
                        default=[*NAMES, "qspcfw"], help="what the evaluate stage checks")
    parser.add_argument("--nice", type=int, default=10, help="niceness increment, so the machine stays usable")
    args = parser.parse_args(argv)
    if args.nice:
        os.nice(args.nice)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    args.workdir.mkdir(parents=True, exist_ok=True)
    metrics_file = args.workdir / "metrics.json"
    stages = STAGES if args.stage == "all" else (args.stage,)
    for stage in stages:
        print(f"== {stage}", flush=True)
        if stage == "data":
            key, value = "data", make_data(args.workdir)
        elif stage == "mace":
            key, value = "mace_training", train_mace(args.workdir, args.threads, args.mace_epochs)
        elif stage == "nequip":
            key, value = "nequip_training", train_nequip(args.workdir, args.threads, args.nequip_epochs)
        else:
            key, value = "evaluation", evaluate(args.workdir, args.md_steps, args.md_molecules, args.kinds)
        # re-read: stages may run as separate processes at the same time
        metrics = json.loads(metrics_file.read_text()) if metrics_file.exists() else {}
        metrics[key] = {**metrics.get(key, {}), **value} if key == "evaluation" else value
        metrics_file.write_text(json.dumps(metrics, indent=1))
    print(f"metrics: {metrics_file}")


if __name__ == "__main__":
    main()
