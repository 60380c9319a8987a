"""cgforge's ``Potential`` behind TorchSim's model interface: TorchSim's integrators, optimisers and autobatching
over cgforge's batch step (docs/batch.md, "TorchSim's integrators and optimisers").

    import torch_sim as ts
    from cgforge.plugin.torchsim import torchsim_model
    model = torchsim_model("mace", device="cuda", dtype="float32")   # a name, a file, a module, a Potential
    final = ts.integrate(system=atoms_list, model=model, integrator=ts.Integrator.nvt_langevin, n_steps=1000,
                         temperature=300.0, timestep=0.0005)

``forward(state)`` returns, detached: energy [B] (eV), forces [N, 3] (eV/Å), stress [B, 3, 3] = virial / |det cell|.
torch-sim-atomistic is imported when a model is made; it is not a dependency of cgforge.
"""

from __future__ import annotations

import os
from functools import cache
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .calculator import Calculator
from .runtime.batch import BatchStep, BatchStructureError, non_finite
from .runtime.potential import Potential, load

__all__ = ["torchsim_model", "torchsim_model_class"]


def torchsim_model_class() -> type:
    """The ``torch_sim.models.interface.ModelInterface`` subclass over a cgforge ``Potential`` (made once);
    ImportError naming torch-sim-atomistic where it does not import."""
    try:
        from torch_sim.models.interface import ModelInterface
    except ImportError as err:
        raise ImportError("cgforge's TorchSim model needs torch-sim-atomistic (Python >= 3.12; pip install "
                          f"torch-sim-atomistic), which did not import: {err}") from err
    return _class_over(ModelInterface)


def torchsim_model(model: str | os.PathLike | torch.nn.Module | Potential | Calculator,
                   device: str | torch.device | None = None, dtype: str | torch.dtype | None = None, *,
                   compute_forces: bool = True, compute_stress: bool = True, min_distance: float | None = 0.5,
                   **load_kwargs: Any) -> Any:
    """A TorchSim model over ``model``: what ``runtime.load(model, device, dtype, **load_kwargs)`` takes, or a
    ``Potential`` / ``Calculator`` already made (whose device and dtype those given must be). compute_forces,
    compute_stress: what ``forward`` returns. min_distance: as ``Potential.evaluate_batch`` takes it."""
    return torchsim_model_class()(model, device, dtype, compute_forces=compute_forces,
                                  compute_stress=compute_stress, min_distance=min_distance, **load_kwargs)


def _potential(model: object, device: str | torch.device | None, dtype: str | torch.dtype | None,
               load_kwargs: dict) -> Potential:
    """The ``Potential`` of ``model``: the one given (its device and dtype checked) or one loaded here."""
    if isinstance(model, Calculator):
        model = model.potential
    if not isinstance(model, Potential):
        return load(model, device, dtype, **load_kwargs)
    if load_kwargs:
        raise ValueError(f"{', '.join(sorted(load_kwargs))}: loading options, but the model given is already a "
                         "Potential (or Calculator); make it with them instead")
    adapter = model.adapter
    if device is not None and torch.device(device) != adapter.device:
        raise ValueError(f"device: {device} given, but the potential runs on {adapter.device}")
    if dtype is not None and (getattr(torch, dtype) if isinstance(dtype, str) else dtype) != adapter.dtype:
        raise ValueError(f"dtype: {dtype} given, but the potential's is {adapter.dtype}")
    return model


class _Model:
    """The methods of the TorchSim model (``torchsim_model``), mixed into ``ModelInterface`` by ``_class_over``:
    ``forward(state)`` as the module doc says."""

    def __init__(self, model: Any, device: Any = None, dtype: Any = None, *, compute_forces: bool = True,
                 compute_stress: bool = True, min_distance: float | None = 0.5, **load_kwargs: Any) -> None:
        super().__init__()
        self.potential = _potential(model, device, dtype, load_kwargs)
        self.min_distance = min_distance
        self._device = self.potential.adapter.device
        self._dtype = self.potential.adapter.dtype
        self._compute_forces = bool(compute_forces)
        self._compute_stress = bool(compute_stress)
        self._memory_scales_with = "n_atoms_x_density"  # a radial cutoff: edges grow with the density
        self._layout: tuple[Tensor, Tensor, list[int], Tensor] | None = None  # numbers, system_idx, ptr, species

    # TorchSim's switches of what ``forward`` returns, kept as bools
    compute_forces = property(lambda self: self._compute_forces,
                              lambda self, value: setattr(self, "_compute_forces", bool(value)))
    compute_stress = property(lambda self: self._compute_stress,
                              lambda self, value: setattr(self, "_compute_stress", bool(value)))

    def batch_step(self) -> BatchStep:
        """The potential's batch step (its Verlet lists kept from call to call)."""
        return self.potential.batch_step(self.min_distance)

    def _structures(self, numbers: Tensor, system_idx: Tensor, n_systems: int) -> tuple[list[int], Tensor]:
        """ptr (structure b owns atoms ptr[b] .. ptr[b + 1] - 1) and the model's species input, worked out on
        the host only when the state's atomic numbers or system indices changed."""
        kept = self._layout
        if (kept is not None and kept[0].shape == numbers.shape and kept[0].device == numbers.device
                and len(kept[2]) == n_systems + 1 and torch.equal(kept[0], numbers)
                and torch.equal(kept[1], system_idx)):
            return kept[2], kept[3]
        owner = system_idx.detach().cpu().numpy()
        if owner.ndim != 1 or len(owner) != numbers.shape[0] or len(owner) == 0:
            raise ValueError(f"state: expected system_idx [N] for its {numbers.shape[0]} atoms, got shape "
                             f"{tuple(system_idx.shape)}")
        if (np.diff(owner) < 0).any() or owner[0] < 0 or owner[-1] >= n_systems:
            raise ValueError(f"state: system_idx must run from 0 to {n_systems - 1} in non-decreasing order (each "
                             "system's atoms together, as TorchSim's states keep them)")
        counts = np.bincount(owner, minlength=n_systems)
        if (counts == 0).any():
            raise BatchStructureError(int(np.argmin(counts)), "expected a structure with at least one atom, got "
                                                              "none")
        ptr = np.concatenate([[0], np.cumsum(counts)]).tolist()
        species = self.batch_step().species(numbers.detach().cpu().numpy(), ptr)
        self._layout = (numbers.detach().clone(), system_idx.detach().clone(), ptr, species)
        return ptr, species

    def forward(self, state: Any, **kwargs: Any) -> dict[str, Tensor]:
        """energy [B], forces [N, 3] (if compute_forces), stress [B, 3, 3] (if compute_stress) of the state's
        systems (module doc); the state is not changed."""
        cells = state.row_vector_cell.detach().to(self._dtype)  # [B, 3, 3], lattice vectors as rows
        n_systems = int(cells.shape[0])
        ptr, species = self._structures(state.atomic_numbers, state.system_idx, n_systems)
        pbc = tuple(bool(p) for p in torch.as_tensor(state.pbc).reshape(-1).expand(3).tolist())
        step = self.batch_step()
        out = step.run(state.positions.detach().to(self._device), cells.to("cpu", torch.float64).numpy(),
                       [pbc] * n_systems, ptr, species, forces=self._compute_forces or self._compute_stress,
                       stress=self._compute_stress)
        energy = out.energy.detach()
        finite = torch.isfinite(energy)
        if not bool(finite.all()):
            raise non_finite(int(torch.argmin(finite.to(torch.int8))))
        results = {"energy": energy}
        if self._compute_forces:
            results["forces"] = out.forces.detach()
        if self._compute_stress:
            volume = torch.linalg.det(cells.to(self._device)).abs()[:, None, None]
            stress = out.virial.detach() / torch.where(volume > 0, volume, torch.ones_like(volume))
            results["stress"] = torch.where(volume > 0, stress, torch.zeros_like(stress))
        return results


@cache
def _class_over(base: type) -> type:
    """The TorchSim model class over ``base`` (TorchSim's ``ModelInterface``): one class per base."""
    return type("CgforgeTorchSimModel", (_Model, base), {
        "__module__": __name__,
        "__doc__": "cgforge's Potential as a TorchSim model (``cgforge.plugin.torchsim``: what forward returns)."})
