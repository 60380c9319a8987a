"""Small MACE and NequIP potentials (random weights, FP64) behind one interface, for the equivariance and
conservation tests: energy and forces of an ase.Atoms, and the same with a differentiable force graph.

NequIP models are built in-process with nequip's own builder (`NequIPGNNModel`, no training: a second),
MACE models with tests/mace_helpers.py. Both come plain or patched by cgforge.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass

import ase.build
import mace_helpers
import numpy as np
import torch
from ase import Atoms
from global_state import nequip_global_state

MACE_SYSTEM_FORCE_RMS = 0.3  # eV/Å: MACE's random models are nearly flat; their energy is scaled to this


@dataclass
class Potential:
    """`evaluate(atoms, graph)` -> (energy tensor, forces tensor [N, 3], positions leaf, stress or None).

    With graph=True the forces keep their autograd graph (create_graph), for force Jacobians.
    """

    name: str
    model: torch.nn.Module
    evaluate_fn: Callable
    patch_fn: Callable
    device: str = "cpu"

    def evaluate(self, atoms: Atoms, graph: bool = False):
        return self.evaluate_fn(self.model, atoms, self.device, graph)

    def energy_forces(self, atoms: Atoms) -> tuple[float, np.ndarray]:
        energy, forces, _, _ = self.evaluate(atoms)
        return float(energy.detach().sum()), forces.detach().cpu().double().numpy()

    def patched(self) -> Potential:
        """A patched copy (cgforge's fused convolution in every interaction layer)."""
        model = self.patch_fn(copy.deepcopy(self.model))
        return Potential(f"{self.name} (cgforge)", model, self.evaluate_fn, self.patch_fn, self.device)

    def to(self, device: str) -> Potential:
        return Potential(self.name, copy.deepcopy(self.model).to(device), self.evaluate_fn, self.patch_fn, device)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def balance_features(pot: Potential, atoms: Atoms, linears: list[torch.nn.Module], target: float = 1.0) -> None:
    """Scale each e3nn Linear's outputs, irrep by irrep, to RMS `target` on `atoms`, first layer first.

    The linears are the ones feeding the convolutions (MACE `linear_up`, NequIP `linear_1`). With random
    weights the features shrink layer after layer, the l > 0 ones most (to ~1e-4 of the scalars), so the
    energy barely depends on the high-l paths and a wrong l = 3 coefficient changes the forces by ~1e-11:
    invisible. After balancing, every path of every layer moves the energy.
    """
    for lin in linears:
        captured: list[torch.Tensor] = []
        handle = lin.register_forward_hook(lambda module, args, out, into=captured: into.append(out.detach()))
        try:
            pot.energy_forces(atoms)
        finally:
            handle.remove()
        out = captured[0]
        rms = [float(out[:, sl].square().mean().sqrt()) for sl in lin.irreps_out.slices()]
        assert not lin.bias.numel(), "a bias would not scale with the weights"
        with torch.no_grad():
            weight, offset = lin.weight.view(-1), 0
            for ins in lin.instructions:
                n = int(np.prod(ins.path_shape))
                if rms[ins.i_out] > 0:
                    weight[offset:offset + n] *= target / rms[ins.i_out]
                offset += n
            assert offset == weight.numel()


# ------------------------------------------------------------------------------------------ MACE


def _mace_evaluate(model, atoms, device, graph):
    # mace's data objects are built in torch's default dtype: FP64 here, or the positions (and so the FP64
    # finite differences and rotations) would be rounded to FP32 before the model sees them
    with _default_dtype(torch.float64):
        batch = mace_helpers.batch_for(model, atoms, device)
    out = model(batch, training=graph, compute_force=True, compute_stress=True)
    return out["energy"], out["forces"], batch["positions"], out["stress"]


def mace_potential(target_force_rms: float = MACE_SYSTEM_FORCE_RMS, **kwargs) -> Potential:
    """A random ScaleShiftMACE (see mace_helpers.build_model for kwargs) whose interaction energy is scaled so
    that the force RMS on `mace_system()` is `target_force_rms` (otherwise ~1e-4 eV/Å: too flat to test)."""
    model = mace_helpers.build_model(**kwargs)
    from cgforge.patches import mace

    pot = Potential(f"MACE {kwargs}", model, _mace_evaluate, mace.patch)
    balance_features(pot, mace_system(), [block.linear_up for block in model.interactions])
    _, forces = pot.energy_forces(mace_system())
    with torch.no_grad():
        model.scale_shift.scale.mul_(target_force_rms / np.sqrt(np.mean(forces**2)))
    return pot


def mace_system(seed: int = 1) -> Atoms:
    """8 rattled water molecules in a periodic 6.2 Å box (24 atoms, ~640 edges at r_max 4)."""
    from cgforge.plugin.water import water_box

    atoms = water_box(n_side=2, seed=seed)
    atoms.rattle(0.05, seed=seed)
    return atoms


# ----------------------------------------------------------------------------------------- NequIP

NEQUIP_R_MAX = 3.0


def nequip_potential(l_max: int, parity: bool = True, num_layers: int = 3, seed: int = 0) -> Potential:
    """nequip's NequIPGNNModel with random weights, FP64, eval mode (built in-process, no training)."""
    from nequip.model import NequIPGNNModel

    with nequip_global_state():
        model = NequIPGNNModel(
            seed=seed, model_dtype="float64", type_names=["Cu", "Ag"], r_max=NEQUIP_R_MAX, l_max=l_max,
            parity=parity, num_layers=num_layers, num_features=4, radial_mlp_depth=1, radial_mlp_width=8,
            avg_num_neighbors=12.0, per_type_energy_shifts={"Cu": -3.0, "Ag": -2.5},
            per_type_energy_scales={"Cu": 1.0, "Ag": 1.3}, compile_mode="eager",
        )
    from cgforge.patches import nequip

    pot = Potential(f"NequIP l_max={l_max} parity={parity}", model.eval(), _nequip_evaluate, nequip.patch)
    linears = [m.linear_1 for name, m in model.named_modules() if name.endswith("_convnet.conv")]
    assert len(linears) == num_layers
    balance_features(pot, nequip_system(), linears)
    return pot


def _nequip_evaluate(model, atoms, device, graph):
    from nequip.data import compute_neighborlist_, from_ase

    with _default_dtype(torch.float64):  # from_ase builds in the default dtype; FP32 would round the positions
        data = from_ase(atoms)
        data["atom_types"] = torch.tensor([0 if z == 29 else 1 for z in atoms.numbers], dtype=torch.int64)
        data = compute_neighborlist_(data, r_max=NEQUIP_R_MAX)
    data = {k: v.to(device) for k, v in data.items()}
    positions = data["pos"].detach().requires_grad_(graph)  # nequip differentiates this very tensor
    data["pos"] = positions
    was_training = model.training
    model.train(graph)  # nequip keeps the force graph (create_graph) in train mode only
    try:
        out = model(dict(data))
    finally:
        model.train(was_training)
    return out["total_energy"], out["forces"], positions, out.get("stress")


def nequip_system(seed: int = 0) -> Atoms:
    """8 atoms (Cu and Ag) of a rattled periodic fcc cell, ~12 neighbours each at r_max 3 Å."""
    atoms = ase.build.bulk("Cu", "fcc", a=3.61, orthorhombic=True).repeat((2, 2, 1))
    atoms.numbers[[1, 6]] = 47  # two Ag
    atoms.rattle(0.08, seed=seed)
    return atoms
