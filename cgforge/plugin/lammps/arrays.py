"""Reading LAMMPS's ML-IAP data object into torch tensors and writing the results back, for both couples.

The host couple gives numpy views of LAMMPS's memory, the Kokkos couple device arrays (DLPack, zero-copy) on its
own stream, synchronised around torch's use (docs/lammps.md, section 4). ``pair_i`` is the centre, ``rij = x[j] -
x[i]``, and ``update_pair_forces(fij)`` adds ``fij`` to f[i], ``-fij`` to f[j] and ``-rij (x) fij`` to the
virial: so ``fij = dE/drij``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .timers import OFF

__all__ = ["HOST_COUPLE", "KOKKOS_COUPLE", "LammpsArrays", "PairData", "couple_of", "is_device_flavour",
           "lammps_arrays", "read_pairs", "to_tensor", "write_results"]

HOST_COUPLE = "mliap_unified_couple"
KOKKOS_COUPLE = "mliap_unified_couple_kokkos"


def couple_of(data: Any) -> str:
    """The LAMMPS couple whose data object ``data`` is: ``HOST_COUPLE`` or ``KOKKOS_COUPLE`` (its class's module)."""
    module = type(data).__module__.rpartition(".")[2]
    if module not in (HOST_COUPLE, KOKKOS_COUPLE):
        raise TypeError(f"LAMMPS data: expected an ML-IAP data object of {HOST_COUPLE} or {KOKKOS_COUPLE}, got "
                        f"{type(data).__module__}.{type(data).__qualname__}")
    return module


def is_device_flavour(data: Any) -> bool:
    """True for the Kokkos couple's data object, False for the host couple's (told by its module, see above)."""
    return couple_of(data) == KOKKOS_COUPLE


def to_tensor(array: Any) -> Tensor:
    """A tensor sharing ``array``'s memory: numpy through ``from_numpy``, anything else through DLPack."""
    if isinstance(array, Tensor):
        return array
    if isinstance(array, np.ndarray):
        return torch.from_numpy(array)
    if hasattr(array, "__dlpack__"):
        return torch.from_dlpack(array)
    raise TypeError(f"LAMMPS data: expected a numpy, DLPack or torch array, got {type(array).__name__}")


def _sync(*tensors: Tensor) -> None:
    """Wait for all work on the device of CUDA ``tensors``: every stream, Kokkos's included (LAMMPS fills and
    reads its arrays on its own stream, which torch's stream does not wait for: nequip PR #605, mace #1294)."""
    for device in {t.device for t in tensors if t.is_cuda}:
        torch.cuda.synchronize(device)


@dataclass
class PairData:
    """One call's inputs as tensors on the model's device."""

    centre: Tensor  # int64 [npairs] (pair_i)
    neighbour: Tensor  # int64 [npairs] (pair_j)
    rij: Tensor  # [npairs, 3] in the model's input dtype
    elems: Tensor  # int64 [ntotal], NULL types (-1) as 0
    listed: Tensor  # int64 [nlistatoms]: atom index of each eatoms entry (iatoms[:nlistatoms])


@dataclass
class LammpsArrays:
    """One call's arrays as LAMMPS holds them (tensors sharing its memory, host or device; synchronised with
    LAMMPS's stream) and its counts (host ints)."""

    nlocal: int
    ntotal: int
    npairs: int
    nlist: int  # nlistatoms: entries of eatoms
    natomneigh: int  # centres in the neighbour list (> nlist: ghost atoms are centres too)
    pair_i: Tensor
    pair_j: Tensor
    rij: Tensor
    elems: Tensor
    iatoms: Tensor


def lammps_arrays(data: Any, timers: Any = OFF) -> LammpsArrays:
    """``data``'s arrays without a copy, NULL ones made up where they may be (no pairs; iatoms: 0..nlist-1); the wait
    for LAMMPS's stream is timed by ``timers`` (``timers.PhaseTimers``)."""
    nlist, ntotal = int(data.nlistatoms), int(data.ntotal)
    nlocal = int(getattr(data, "nlocal", nlist))  # older Kokkos data objects lack nlocal (29Aug2024 has it)
    npairs = int(data.npairs)
    tensors = {}
    for name in ("pair_i", "pair_j", "rij", "elems", "iatoms"):
        if (array := getattr(data, name)) is None:
            if name in ("pair_i", "pair_j", "rij") and npairs == 0:
                array = np.zeros((0, 3) if name == "rij" else 0, dtype=np.float64 if name == "rij" else np.int32)
            elif name == "iatoms":
                array = np.arange(nlist, dtype=np.int32)
            else:
                raise ValueError(f"LAMMPS data: {name} is missing (NULL)")
        tensors[name] = to_tensor(array)
    with timers.wait():
        _sync(*tensors.values())
    natomneigh = int(getattr(data, "natomneigh", nlist) or nlist)
    return LammpsArrays(nlocal, ntotal, npairs, nlist, natomneigh, **tensors)


def read_pairs(a: LammpsArrays, device: torch.device, dtype: torch.dtype) -> PairData:
    """The pair list, element indices and listed atoms of one call (``lammps_arrays``) as tensors on ``device``."""
    centre = a.pair_i[:a.npairs].to(device=device, dtype=torch.int64)
    neighbour = a.pair_j[:a.npairs].to(device=device, dtype=torch.int64)
    rij = a.rij[:a.npairs].to(device=device, dtype=dtype)
    elems = a.elems[:a.ntotal].to(device=device, dtype=torch.int64).clamp(min=0)
    listed = a.iatoms[:a.nlist].to(device=device, dtype=torch.int64)
    return PairData(centre, neighbour, rij, elems, listed)


def write_results(data: Any, eatoms: Tensor, energy: Tensor, fij: Tensor, timers: Any = OFF) -> None:
    """Per-atom energies (``eatoms``, [nlistatoms]), the total (``energy``) and ``fij = dE/drij`` into ``data``; empty
    arrays are not handed over (the coupling takes their first element's address), device ones after one sync."""
    fij = fij.detach().to(torch.float64).contiguous()
    eatoms = eatoms.detach().to(torch.float64)
    device = is_device_flavour(data)
    lammps_device = None  # where LAMMPS's device arrays are (None: not looked up yet)
    if eatoms.numel():
        if device:
            target = to_tensor(data.eatoms)  # a read-only property: the array LAMMPS reads, written in place
            if target.shape != eatoms.shape:  # a longer write would go past LAMMPS's array
                raise ValueError(f"eatoms: LAMMPS holds {tuple(target.shape)}, the model gave {tuple(eatoms.shape)}")
            target.copy_(eatoms.to(target.device))
            lammps_device = target.device
        else:
            data.eatoms = np.ascontiguousarray(eatoms.cpu().numpy())
    with timers.wait():  # a device scalar's read waits for the step
        data.energy = float(energy)
    if fij.shape[0] and tuple(fij.shape) != (int(data.npairs), 3):  # LAMMPS reads npairs x 3 doubles from the pointer
        raise ValueError(f"fij: expected ({int(data.npairs)}, 3), got {tuple(fij.shape)}")
    if device and fij.shape[0] and lammps_device is None:
        lammps_device = to_tensor(data.rij).device
    if device and lammps_device is not None and lammps_device.type == "cuda":
        forces = fij.to(lammps_device)
        with timers.wait():
            _sync(forces)  # torch's stream done (the per-atom energies' copy included) before LAMMPS reads on its own
        if fij.shape[0]:
            data.update_pair_forces_gpu(forces)
    elif fij.shape[0]:
        data.update_pair_forces(np.ascontiguousarray(fij.cpu().numpy()))
