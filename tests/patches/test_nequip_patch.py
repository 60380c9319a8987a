"""NequIP adapter: patched NequIP models (checkpoints and packages) give nequip/e3nn's energies and forces.

The models are trained here with ``nequip-train`` (nequip's EMT test dataset, one epoch, 4 features,
3 layers) and packaged with nequip-package's own ``build`` command, once per module, for l_max 1, 2, 3
with and without parity (FP64), one FP32 model, and one model trained with ``enable_cgforge`` in its
config. All trainings run in parallel subprocesses; the packaging runs in one process.
"""

from __future__ import annotations

import copy
import hashlib
import io
import os
import random
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

nequip = pytest.importorskip("nequip")

import ase.build  # noqa: E402
import e3nn  # noqa: E402
import yaml  # noqa: E402
from nequip.data import compute_neighborlist_, from_ase  # noqa: E402
from nequip.model.modify_utils import get_all_modifiers, modify  # noqa: E402
from nequip.model.saved_models.load_utils import load_saved_model  # noqa: E402
from nequip.nn._tp_scatter_base import TensorProductScatter  # noqa: E402
from nequip.nn.model_modifier_utils import (  # noqa: E402
    is_persistent_model_modifier,
    is_private_model_modifier,
)
from nequip.scripts._workflow_utils import get_workflow_state, set_workflow_state  # noqa: E402
from nequip.utils.global_state import set_global_state  # noqa: E402
from oracles import central_difference, jacobian_rows  # noqa: E402

from cgforge import kernels  # noqa: E402
from cgforge.patches import nequip as pn  # noqa: E402
from cgforge.patches.graph_cache import CallGraphCache  # noqa: E402

cuda = pytest.mark.cuda
# Every test here needs the module's models, trained by nequip-train first (~40 s on a CPU, 76 s loaded): the
# whole module is in the full tier (CI); the fast tier covers NequIP through the bundled model's tests.
pytestmark = pytest.mark.slow
NEQUIP = lambda script: [sys.executable, "-m", f"nequip.scripts.{script}"]  # nequip-train etc., PATH or not
R_MAX = 3.0
NUM_LAYERS = 3
FP64_CASES = [f"l{l_max}_p{parity}" for l_max in (1, 2, 3) for parity in (True, False)]
FP32_CASE = "l2_pTrue_fp32"
MODIFIER_CASE = "l1_pTrue_cgforge"  # trained with `modifiers: [{modifier: enable_cgforge}]`
KINDS = ("ckpt", "zip")

CONFIG = """
run: [train]
seed: 1
cutoff_radius: @R_MAX@
model_type_names: [Cu]
chemical_species: ${model_type_names}
dataloader:
  _target_: torch.utils.data.DataLoader
  batch_size: 2
data:
  _target_: nequip.data.datamodule.NequIPDataModule
  seed: ${seed}
  split_dataset:
    dataset:
      _target_: nequip.data.dataset.EMTTestDataset
      transforms:
        - _target_: nequip.data.transforms.ChemicalSpeciesToAtomTypeMapper
          model_type_names: ${model_type_names}
          chemical_species_to_atom_type_map: ${list_to_identity_dict:${chemical_species}}
        - _target_: nequip.data.transforms.NeighborListTransform
          r_max: ${cutoff_radius}
      supercell: [2, 2, 1]
      seed: ${seed}
      num_frames: 4
      element: Cu
    train: 2
    val: 2
  train_dataloader: ${dataloader}
  val_dataloader: ${dataloader}
  stats_manager:
    _target_: nequip.data.CommonDataStatisticsManager
    type_names: ${model_type_names}
trainer:
  _target_: lightning.Trainer
  accelerator: cpu
  max_epochs: 1
  enable_progress_bar: false
  logger: false
  callbacks:
    - _target_: lightning.pytorch.callbacks.ModelCheckpoint
      dirpath: ${hydra:runtime.output_dir}
      filename: last
      save_top_k: 1
training_module:
  _target_: nequip.train.NequIPLightningModule
  loss:
    _target_: nequip.train.EnergyForceLoss
    per_atom_energy: true
    coeffs: {total_energy: 1.0, forces: 1.0}
  val_metrics:
    _target_: nequip.train.EnergyForceMetrics
    coeffs: {total_energy_mae: 1.0, forces_mae: 1.0}
  optimizer:
    _target_: torch.optim.SGD
    lr: 0.05
  model:
@MODEL@
"""

MODEL = """
_target_: nequip.model.NequIPGNNModel
seed: ${seed}
model_dtype: @DTYPE@
type_names: ${model_type_names}
r_max: ${cutoff_radius}
l_max: @L_MAX@
parity: @PARITY@
num_layers: @NUM_LAYERS@
num_features: 4
radial_mlp_depth: 1
radial_mlp_width: 8
avg_num_neighbors: ${training_data_stats:num_neighbors_mean}
per_type_energy_shifts: ${training_data_stats:per_atom_energy_mean}
per_type_energy_scales: ${training_data_stats:forces_rms}
"""


def _config(l_max: int, parity: bool, dtype: str = "float64", modifier: bool = False) -> str:
    model = MODEL.replace("@DTYPE@", dtype).replace("@L_MAX@", str(l_max))
    model = model.replace("@PARITY@", str(parity).lower()).replace("@NUM_LAYERS@", str(NUM_LAYERS))
    if modifier:
        model = "_target_: nequip.model.modify\nmodifiers:\n  - modifier: enable_cgforge\nmodel:\n" + _indent(
            model, 2
        )
    return CONFIG.replace("@R_MAX@", str(R_MAX)).replace("@MODEL@", _indent(model, 4))


def _indent(text: str, n: int) -> str:
    return "".join(" " * n + line + "\n" for line in text.strip().splitlines())


def _case_config(name: str) -> str:
    if name == FP32_CASE:
        return _config(2, True, "float32")
    if name == MODIFIER_CASE:
        return _config(1, True, modifier=True)
    l_max, parity = name.split("_")
    return _config(int(l_max[1:]), parity == "pTrue")


def _child_env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", HYDRA_FULL_ERROR="1", PYTHONWARNINGS="ignore")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def _check_run(proc: subprocess.Popen, log: Path, what: str) -> None:
    if proc.wait() != 0:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{log.read_text()[-4000:]}")


PACKAGE_DRIVER = """
import sys
from nequip.scripts.package import main
for ckpt, out in zip(sys.argv[1::2], sys.argv[2::2]):
    main(["build", ckpt, out])
"""


@pytest.fixture(scope="module", autouse=True)
def _nequip_state(nequip_state):
    """Every test here runs in nequip's global state (see conftest), restored after the module."""


@pytest.fixture(scope="module", autouse=True)
def _restore_global_state():
    """nequip's loaders set process-wide state (default dtype, seeds, e3nn flags): undo it afterwards."""
    dtype = torch.get_default_dtype()
    e3nn_flags = e3nn.get_optimization_defaults()
    rng = torch.get_rng_state(), np.random.get_state(), random.getstate()
    set_global_state()
    torch.set_default_dtype(torch.float64)  # set_global_state() does it only once per process
    yield
    torch.set_default_dtype(dtype)
    e3nn.set_optimization_defaults(**e3nn_flags)
    torch.set_rng_state(rng[0])
    np.random.set_state(rng[1])
    random.setstate(rng[2])


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Path]]:
    """{case: {"ckpt": path, "zip": path, "dir": run dir}}: trained and packaged once per module."""
    root = tmp_path_factory.mktemp("nequip_models")
    names = [*FP64_CASES, FP32_CASE, MODIFIER_CASE]
    procs = []
    for name in names:
        (root / f"{name}.yaml").write_text(_case_config(name))
        log = root / f"{name}.train.log"
        with open(log, "w") as out:
            cmd = [*NEQUIP("train"), "-cp", str(root), "-cn", name, f"hydra.run.dir={root / name}"]
            procs.append(
                (
                    subprocess.Popen(cmd, cwd=root, stdout=out, stderr=subprocess.STDOUT, env=_child_env()),
                    log,
                    f"nequip-train {name}",
                )
            )
    for proc, log, what in procs:
        _check_run(proc, log, what)
    result = {name: {"dir": root / name, "ckpt": root / name / "last.ckpt"} for name in names}
    pairs = []
    for name in [*FP64_CASES, FP32_CASE]:
        result[name]["zip"] = root / f"{name}.nequip.zip"
        pairs += [str(result[name]["ckpt"]), str(result[name]["zip"])]
    log = root / "package.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", PACKAGE_DRIVER, *pairs],
            cwd=root,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=_child_env(),
        )
    _check_run(proc, log, "nequip-package build")
    return result


class Models:
    """Loaded models, cached per module: plain ones through nequip's loader, patched ones through cgforge."""

    def __init__(self, files: dict) -> None:
        self.files = files
        self._plain: dict = {}
        self._patched: dict = {}

    def plain(self, case: str, kind: str) -> torch.nn.Module:
        if (case, kind) not in self._plain:
            model = load_saved_model(str(self.files[case][kind]), compile_mode="eager")
            self._plain[case, kind] = model.eval()
        return self._plain[case, kind]

    def patched(self, case: str, kind: str) -> torch.nn.Module:
        if (case, kind) not in self._patched:
            self._patched[case, kind] = pn.load_nequip(self.files[case][kind], verify=False)
        return self._patched[case, kind]


@pytest.fixture(scope="module")
def models(files: dict) -> Models:
    return Models(files)


# ---------------------------------------------------------------------------------------------
# Helpers


def cu_structure(device: str = "cpu", seed: int = 0) -> dict[str, torch.Tensor]:
    """8 rattled fcc Cu atoms in a periodic orthorhombic cell (edges through the cell boundaries)."""
    atoms = ase.build.bulk("Cu", "fcc", orthorhombic=True).repeat((2, 2, 1))
    atoms.rattle(0.08, seed=seed)
    data = from_ase(atoms)
    data["atom_types"] = torch.zeros(len(atoms), dtype=torch.int64)
    data = compute_neighborlist_(data, r_max=R_MAX)
    return {k: v.to(device) for k, v in data.items()}


def evaluate(model: torch.nn.Module, data: dict) -> dict[str, torch.Tensor]:
    out = model(dict(data))
    return {k: out[k].detach() for k in ("total_energy", "forces", "stress")}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


def assert_same_outputs(new: dict, ref: dict, tol: float) -> None:
    assert float(ref["forces"].abs().max()) > 1e-3, "reference forces are ~0: the comparison would be empty"
    for key in ref:
        assert torch.isfinite(new[key]).all(), key
        assert rel_err(new[key], ref[key]) <= tol, (key, rel_err(new[key], ref[key]))


def cgforge_convs(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, pn.CgforgeTensorProductScatter)]


def plain_convs(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__ == "TensorProductScatter"]


def force_jacobian(model: torch.nn.Module, data: dict) -> torch.Tensor:
    """dF/dx (3N x 3N) by autograd through the forces (train mode: nequip keeps the force graph)."""
    data = dict(data)
    pos = data["pos"].detach().clone().requires_grad_(True)
    data["pos"] = pos
    was_training = model.training
    model.train()
    try:
        jacobian = jacobian_rows(model(data)["forces"], pos)
    finally:
        model.train(was_training)
    return jacobian


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------------------------------------
# The modifier and nequip's tools


def test_modifier_registered_through_nequip_extension_entry_point(models: Models) -> None:
    from importlib.metadata import entry_points

    values = {ep.value for ep in entry_points(group="nequip.extension") if ep.name == "init_always"}
    assert "cgforge.patches.nequip_modifier" in values
    assert "enable_cgforge" in TensorProductScatter.__dict__
    found = get_all_modifiers(models.plain("l1_pTrue", "ckpt"))
    assert "enable_cgforge" in found
    assert not is_persistent_model_modifier(found["enable_cgforge"])  # never baked into nequip-package builds
    assert not is_private_model_modifier(found["enable_cgforge"])
    assert "cgforge" in found["enable_cgforge"].__doc__


def test_nequip_modify_applies_enable_cgforge(files: dict, models: Models) -> None:
    model = load_saved_model(str(files["l2_pFalse"]["ckpt"]), compile_mode="eager").eval()
    data = cu_structure()
    ref = evaluate(model, data)
    assert len(plain_convs(model)) == NUM_LAYERS
    modify(model, [{"modifier": "enable_cgforge"}])
    assert len(cgforge_convs(model)) == NUM_LAYERS and not plain_convs(model)
    assert_same_outputs(evaluate(model, data), ref, tol=1e-10)
    convs = cgforge_convs(model)
    modify(model, [{"modifier": "enable_cgforge"}])  # again: found on the patched modules, changes nothing
    assert cgforge_convs(model) == convs


def test_modifier_refuses_nequip_compile_workflow(models: Models) -> None:
    model = copy.deepcopy(models.plain("l1_pTrue", "ckpt"))
    previous = get_workflow_state()
    set_workflow_state("compile")
    try:
        with pytest.raises(pn.CompiledModelError, match="nequip-compile.*eager model"):
            modify(model, [{"modifier": "enable_cgforge"}])
    finally:
        set_workflow_state(previous)
    assert not cgforge_convs(model)


def test_nequip_compile_with_enable_cgforge_fails_with_clear_error(files: dict, tmp_path: Path) -> None:
    out = tmp_path / "model.nequip.pt2"
    cmd = [
        *NEQUIP("compile"),
        str(files["l1_pTrue"]["ckpt"]),
        str(out),
        "--mode",
        "aotinductor",
        "--device",
        "cpu",
        "--target",
        "ase",
        "--modifiers",
        "enable_cgforge",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=_child_env(), timeout=300)
    assert proc.returncode != 0
    assert "CompiledModelError" in proc.stderr and "eager model" in proc.stderr, proc.stderr[-2000:]
    assert not out.exists()


def test_training_with_enable_cgforge_in_config_matches_plain_training(files: dict) -> None:
    log = (files[MODIFIER_CASE]["dir"] / "train.log").read_text()
    assert f"cgforge: patched {NUM_LAYERS} NequIP convolutions" in log
    # same seed, data and SGD steps as the plain l1_pTrue run: the same weights if the gradients agree
    trained = torch.load(files[MODIFIER_CASE]["ckpt"], map_location="cpu", weights_only=False)["state_dict"]
    plain = torch.load(files["l1_pTrue"]["ckpt"], map_location="cpu", weights_only=False)["state_dict"]
    assert trained.keys() == plain.keys()
    floats = [k for k, v in plain.items() if torch.is_tensor(v) and v.is_floating_point() and v.numel()]
    assert len(floats) > 10
    for k in floats:
        assert rel_err(trained[k], plain[k]) <= 1e-10, k


# ---------------------------------------------------------------------------------------------
# Patched = plain, from checkpoints and packages


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", FP64_CASES)
def test_patched_matches_plain_fp64(models: Models, case: str, kind: str) -> None:
    plain, patched = models.plain(case, kind), models.patched(case, kind)
    assert len(cgforge_convs(patched)) == NUM_LAYERS and not plain_convs(patched)
    if kind == "zip":  # the package's own classes, not the installed nequip's
        assert all(
            type(m.original[0]).__module__.startswith("<torch_package_") for m in cgforge_convs(patched)
        )
    assert patched.model_dtype == torch.float64 and not patched.training
    sd_plain, sd_patched = plain.state_dict(), patched.state_dict()
    assert sd_plain.keys() == sd_patched.keys()
    assert all(torch.equal(sd_plain[k], sd_patched[k]) for k in sd_plain)
    data = cu_structure()
    assert_same_outputs(evaluate(patched, data), evaluate(plain, data), tol=1e-10)


@pytest.mark.parametrize("case", [*FP64_CASES, FP32_CASE])
def test_each_convolution_matches_original_on_random_directed_graph(models: Models, case: str) -> None:
    """Module level, random features and a random one-way edge list.

    A whole-model test cannot see sender and receiver swapped: with a symmetric neighbour list and
    |r|-only edge weights, the swap amounts to inverting the structure, which leaves an O(3)-invariant
    energy unchanged. Here the edges are not symmetric, so it shows.
    """
    gen = torch.Generator().manual_seed(5)
    convs = cgforge_convs(models.patched(case, "zip"))
    assert len(convs) == NUM_LAYERS
    for conv in convs:
        (original,) = conv.original
        dtype = conv.model_dtype
        num_nodes, num_edges = 7, 23
        x = torch.randn(num_nodes, conv.tp.irreps_in1.dim, generator=gen, dtype=dtype)
        edge_attr = torch.randn(num_edges, conv.tp.irreps_in2.dim, generator=gen, dtype=dtype)
        weight = torch.randn(num_edges, conv.tp.weight_numel, generator=gen, dtype=dtype)
        edge_src = torch.randint(0, num_nodes, (num_edges,), generator=gen)
        edge_dst = torch.randint(0, num_nodes - 2, (num_edges,), generator=gen)  # two nodes receive nothing
        args = (x, edge_attr, weight, edge_dst, edge_src)
        ref = original(*args)
        assert float(ref[-2:].abs().max()) == 0.0 and float(ref.abs().max()) > 0
        assert rel_err(conv(*args), ref) <= (1e-6 if dtype == torch.float32 else 1e-12)
        assert rel_err(conv(x, edge_attr, weight, edge_src, edge_dst), ref) > 1e-2  # orientation matters


@pytest.mark.parametrize("kind", KINDS)
def test_fp32_model_matches_plain(models: Models, kind: str) -> None:
    plain, patched = models.plain(FP32_CASE, kind), models.patched(FP32_CASE, kind)
    assert patched.model_dtype == torch.float32 and len(cgforge_convs(patched)) == NUM_LAYERS
    data = cu_structure()
    assert_same_outputs(evaluate(patched, data), evaluate(plain, data), tol=1e-5)


@pytest.mark.parametrize("case", FP64_CASES)
def test_forces_are_minus_finite_difference_energy_gradient(models: Models, case: str) -> None:
    model = models.patched(case, "ckpt")
    data = cu_structure(seed=1)
    forces = evaluate(model, data)["forces"]
    h = 1e-5
    pos = data["pos"].detach()
    grad = torch.zeros_like(pos)
    for i in range(pos.shape[0]):
        for d in range(3):
            direction = torch.zeros_like(pos)
            direction[i, d] = 1.0
            grad[i, d] = central_difference(
                lambda t: float(model({**data, "pos": pos + t * direction})["total_energy"]), h)  # noqa: B023
    scale = max(1.0, float(forces.abs().max()))
    assert float((forces + grad).abs().max()) <= 1e-7 * scale


@pytest.mark.parametrize("case", FP64_CASES)
def test_force_jacobian_is_symmetric_and_matches_plain(models: Models, case: str) -> None:
    data = cu_structure(seed=2)
    jac = force_jacobian(models.patched(case, "ckpt"), data)
    assert float(jac.abs().max()) > 1e-3
    assert rel_err(jac, jac.T) <= 1e-10
    assert rel_err(jac, force_jacobian(models.plain(case, "ckpt"), data)) <= 1e-10


@pytest.mark.parametrize("case", ["l3_pTrue", "l3_pFalse"])
def test_training_gradients_match_plain(models: Models, case: str) -> None:
    """Parameter gradients of an energy+force loss: the double backward through the fused convolution."""
    data = cu_structure(seed=3)

    def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
        model = copy.deepcopy(model).train()
        out = model(dict(data, pos=data["pos"].detach().clone()))
        loss = out["total_energy"].sum() ** 2 + (out["forces"] ** 2).sum()
        names, params = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad])
        return dict(zip(names, torch.autograd.grad(loss, params, allow_unused=True)))

    new, ref = grads(models.patched(case, "ckpt")), grads(models.plain(case, "ckpt"))
    assert new.keys() == ref.keys()
    checked = 0
    for name, g in ref.items():
        if g is None:
            assert new[name] is None, name
            continue
        assert rel_err(new[name], g) <= 1e-9, name
        checked += float(g.abs().max()) > 0
    assert checked > 10


def test_one_graph_per_model_call_shared_by_layers(models: Models, monkeypatch: pytest.MonkeyPatch) -> None:
    model = models.patched("l2_pTrue", "zip")
    built, conv_calls = [], []

    class CountingGraph(kernels.ConvGraph):
        def __init__(self, *args, **kwargs):
            built.append(args[2])
            super().__init__(*args, **kwargs)

    original_forward = kernels.Convolution.forward

    def counting_forward(self, *args, **kwargs):
        conv_calls.append(type(self))
        return original_forward(self, *args, **kwargs)

    monkeypatch.setattr(kernels, "ConvGraph", CountingGraph)
    monkeypatch.setattr(kernels.Convolution, "forward", counting_forward)
    first, second = cu_structure(seed=0), cu_structure(seed=4)
    evaluate(model, first)
    assert len(built) == 1 and len(conv_calls) == NUM_LAYERS
    evaluate(model, second)
    evaluate(model, first)
    assert len(built) == 3 and len(conv_calls) == 3 * NUM_LAYERS


def test_unpatch_restores_plain_modules(files: dict, models: Models) -> None:
    model = pn.load_nequip(files["l2_pTrue"]["zip"])
    pn.unpatch(model)
    assert not cgforge_convs(model) and len(plain_convs(model)) == NUM_LAYERS
    assert not pn.is_patched(model)
    assert not any(isinstance(h, CallGraphCache) for h in model._forward_pre_hooks.values())
    data = cu_structure()
    assert_same_outputs(evaluate(model, data), evaluate(models.plain("l2_pTrue", "zip"), data), tol=0.0)


def test_patched_model_survives_pickle_and_deepcopy(models: Models) -> None:
    model = models.patched("l3_pTrue", "ckpt")
    data = cu_structure()
    ref = evaluate(model, data)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    for clone in (torch.load(buf, weights_only=False), copy.deepcopy(model)):
        convs = cgforge_convs(clone)
        assert len(convs) == NUM_LAYERS and all(isinstance(c.conv, kernels.Convolution) for c in convs)
        assert len({id(c.graphs) for c in convs}) == 1  # still one shared graph cache
        assert_same_outputs(evaluate(clone, data), ref, tol=0.0)


def test_patch_refuses_other_accelerations_and_leaves_model_untouched(models: Models) -> None:
    model = copy.deepcopy(models.plain("l1_pFalse", "ckpt"))

    class OpenEquivarianceTensorProductScatter(TensorProductScatter):  # stands in for nequip's OEQ module
        def __init__(self, old: torch.nn.Module) -> None:
            torch.nn.Module.__init__(self)
            self.tp = old.tp

    parent, name = next(
        (p, n)
        for p in model.modules()
        for n, c in p.named_children()
        if type(c).__name__ == "TensorProductScatter"
    )
    parent._modules[name] = OpenEquivarianceTensorProductScatter(parent._modules[name])
    with pytest.raises(pn.UnsupportedModelError, match="another convolution"):
        pn.patch(model)
    assert not cgforge_convs(model) and len(plain_convs(model)) == NUM_LAYERS - 1


# ---------------------------------------------------------------------------------------------
# Loading checks and bad inputs


def test_load_verifies_against_plain_model(files: dict) -> None:
    model = pn.load_nequip(files["l3_pFalse"]["zip"], verify=True)
    assert len(cgforge_convs(model)) == NUM_LAYERS
    assert pn.verify_patch(model) <= 1e-10  # on an already patched model: unpatches, compares, re-patches
    assert len(cgforge_convs(model)) == NUM_LAYERS


def test_dtype_conversion_refused(files: dict) -> None:
    with pytest.raises(ValueError, match="dtype: .*float64"):
        pn.load_nequip(files["l1_pTrue"]["zip"], dtype="float32")
    with pytest.raises(ValueError, match="dtype"):
        pn.load_nequip(files["l1_pTrue"]["zip"], dtype="float16")
    assert pn.load_nequip(files["l1_pTrue"]["zip"], dtype=torch.float64).model_dtype == torch.float64


@pytest.mark.parametrize("suffix", [".nequip.pt2", ".nequip.pth"])
def test_compiled_models_refused_with_supported_route(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"model{suffix}"
    path.write_bytes(b"not really compiled")
    with pytest.raises(pn.CompiledModelError, match=r"compiled.*eager model.*\.ckpt or \.nequip\.zip"):
        pn.load_nequip(path)
    with pytest.raises(pn.CompiledModelError, match="compiled"):
        pn.save_patched_nequip(path, tmp_path / "out.nequip.zip")
    from cgforge import patches

    with pytest.raises(ValueError, match="compiled"):
        patches.load(path)


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_bad_inputs_give_clear_errors(files: dict, tmp_path: Path) -> None:
    zip_path = files["l1_pTrue"]["zip"]
    with pytest.raises(FileNotFoundError, match="not found"):
        pn.load_nequip(tmp_path / "missing.ckpt")
    with pytest.raises(IsADirectoryError, match="directory"):
        pn.load_nequip(tmp_path)
    with pytest.raises(ValueError, match=r"expected a NequIP \.ckpt or \.nequip\.zip"):
        pn.load_nequip(_write(tmp_path / "model.txt", b"x"))
    with pytest.raises(ValueError, match="not a torch checkpoint"):
        pn.load_nequip(_write(tmp_path / "text.ckpt", b"hello"))
    with pytest.raises(ValueError, match="not a NequIP package"):
        with zipfile.ZipFile(tmp_path / "empty.nequip.zip", "w") as zf:
            zf.writestr("a/b.txt", "x")
        pn.load_nequip(tmp_path / "empty.nequip.zip")
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.ckpt")
    with pytest.raises(ValueError, match="could not load it as a NequIP checkpoint"):
        pn.load_nequip(tmp_path / "other.ckpt")
    shutil.copy(zip_path, tmp_path / "renamed.ckpt")
    with pytest.raises(ValueError, match="package"):
        pn.load_nequip(tmp_path / "renamed.ckpt")
    with pytest.raises(TypeError, match="path"):
        pn.load_nequip(42)
    with pytest.raises(ValueError, match="device"):
        pn.load_nequip(zip_path, device="tpu")
    with pytest.raises(ValueError, match="model_name: .*sole_model"):
        pn.load_nequip(zip_path, model_name="other")
    with pytest.raises(pn.UnsupportedModelError, match="no NequIP convolution"):
        pn.patch(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    with pytest.raises(TypeError, match="model"):
        pn.patch("model.ckpt")
    from cgforge.patches import families

    assert families.family_for_file(zip_path) is families.family_for_file(files["l1_pTrue"]["ckpt"]) is families.NEQUIP


# ---------------------------------------------------------------------------------------------
# Writing patched packages (`cgforge patch` for NequIP files)


@pytest.mark.parametrize("kind", KINDS)
def test_save_patched_package_from_file(files: dict, models: Models, tmp_path: Path, kind: str) -> None:
    src = files["l3_pTrue"][kind]
    before = sha256(src)
    out = pn.save_patched_nequip(src, tmp_path / "patched.nequip.zip")
    assert sha256(src) == before  # the input is never touched
    loaded = load_saved_model(str(out), compile_mode="eager").eval()  # nequip's own loader
    assert len(cgforge_convs(loaded)) == NUM_LAYERS
    data = cu_structure()
    assert_same_outputs(evaluate(loaded, data), evaluate(models.plain("l3_pTrue", kind), data), tol=1e-10)
    with zipfile.ZipFile(out) as zf:
        name = next(n for n in zf.namelist() if n.endswith("model/package_metadata.txt"))
        metadata = yaml.safe_load(zf.read(name))
    assert metadata["available_models"] == ["eager"] and metadata["cgforge"]["patched"] is True
    assert "cgforge" in metadata["external_modules"]
    reloaded = pn.load_nequip(out)  # already patched: verify unpatches, compares and re-patches
    assert len(cgforge_convs(reloaded)) == NUM_LAYERS
    with pytest.raises(FileExistsError, match="exists"):
        pn.save_patched_nequip(src, out)
    assert pn.save_patched_nequip(src, out, force=True) == out


def test_save_patched_package_from_model(files: dict, tmp_path: Path) -> None:
    model = pn.load_nequip(files["l2_pFalse"]["zip"])
    data = cu_structure()
    ref = evaluate(model, data)
    out = pn.save_patched_nequip(model, tmp_path / "from_model.nequip.zip")
    assert len(cgforge_convs(model)) == NUM_LAYERS  # the model given is still patched and usable
    assert_same_outputs(evaluate(model, data), ref, tol=0.0)
    assert_same_outputs(evaluate(pn.load_nequip(out), data), ref, tol=0.0)


def test_save_patched_bad_outputs(files: dict, tmp_path: Path) -> None:
    src = files["l1_pTrue"]["zip"]
    with pytest.raises(ValueError, match=r"must end with \.nequip\.zip"):
        pn.save_patched_nequip(src, tmp_path / "out.model")
    with pytest.raises(ValueError, match="input"):
        pn.save_patched_nequip(src, src, force=True)
    with pytest.raises(FileNotFoundError, match="directory"):
        pn.save_patched_nequip(src, tmp_path / "nowhere" / "out.nequip.zip")
    with pytest.raises(TypeError, match="model_or_path"):
        pn.save_patched_nequip(3.5, tmp_path / "out.nequip.zip")
    assert not list(tmp_path.iterdir())


# ---------------------------------------------------------------------------------------------
# GPU


@cuda
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", [*FP64_CASES, FP32_CASE])
def test_cuda_patched_matches_plain(models: Models, files: dict, case: str, kind: str) -> None:
    plain = copy.deepcopy(models.plain(case, kind)).to("cuda")
    patched = pn.load_nequip(files[case][kind], device="cuda")
    assert all(p.is_cuda for p in patched.parameters())
    data = cu_structure("cuda")
    tol = 1e-5 if case == FP32_CASE else 1e-10
    assert_same_outputs(evaluate(patched, data), evaluate(plain, data), tol=tol)
    cpu = evaluate(models.patched(case, kind), cu_structure())
    assert_same_outputs({k: v.cpu() for k, v in evaluate(patched, data).items()}, cpu, tol=tol)


@cuda
@pytest.mark.parametrize("case", ["l3_pTrue", "l3_pFalse"])
def test_cuda_force_jacobian_is_symmetric(models: Models, files: dict, case: str) -> None:
    patched = pn.load_nequip(files[case]["ckpt"], device="cuda")
    data = cu_structure("cuda", seed=2)
    jac = force_jacobian(patched, data)
    assert rel_err(jac, jac.T) <= 1e-10
    assert rel_err(jac.cpu(), force_jacobian(models.plain(case, "ckpt"), cu_structure(seed=2))) <= 1e-10


def test_cli_patch_writes_nequip_package(files: dict, models: Models, tmp_path: Path) -> None:
    from cgforge.plugin.cli import main

    src = files["l2_pTrue"]["ckpt"]
    before = sha256(src)
    out = tmp_path / "cli.nequip.zip"
    assert main(["patch", str(src), str(out)]) == 0
    assert sha256(src) == before
    # the cgforge class paths the package names are the contract's (cgforge._moved.PICKLED_CLASSES)
    from test_pickle_contract import cgforge_globals, package_externs

    from cgforge._moved import PICKLED_CLASSES

    assert cgforge_globals(out) <= set(PICKLED_CLASSES["nequip"])
    assert package_externs(out) <= {path.rpartition(".")[0] for path in PICKLED_CLASSES["nequip"]}
    loaded = load_saved_model(str(out), compile_mode="eager").eval()
    assert len(cgforge_convs(loaded)) == NUM_LAYERS
    data = cu_structure()
    assert_same_outputs(evaluate(loaded, data), evaluate(models.plain("l2_pTrue", "ckpt"), data), tol=1e-10)
    assert main(["patch", str(src), str(out)]) == 1  # exists, no --force
    assert main(["patch", str(src), str(tmp_path / "wrong.model")]) == 1  # NequIP writes packages only
    assert main(["patch", str(src), str(out), "--force", "--dtype", "float32"]) == 1
