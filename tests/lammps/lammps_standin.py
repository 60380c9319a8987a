"""A stand-in for LAMMPS's ML-IAP data object, built from an ASE structure: tests without LAMMPS.

``build_domains(atoms, element_types, cutoff, ghost_cutoff, ...)`` splits a periodic orthorhombic box into
slabs along x (one per "MPI rank"); each domain gets its local atoms (global order), ghosts (every periodic
image and every other domain's atom within ``ghost_cutoff`` of its slab, per dimension, as LAMMPS's brick
communication selects them) and the pairs within ``cutoff`` (strictly), grouped by centre: centres are the
local atoms, or (``ghost_neighbours=True``, LAMMPS's ``pair_style mliap unified FILE 1``) local atoms and
ghosts. The neighbours of each centre come in a shuffled order (LAMMPS's is binned, not sorted).

Flavours: ``"host"`` (numpy arrays, write-only ``eatoms`` and ``energy``, ``update_pair_forces`` taking a
C-contiguous float64 array) and ``"kokkos"`` (DLPack arrays on ``device``, ``eatoms`` a read-only property
returning the array to write into, ``update_pair_forces_gpu`` taking a torch tensor, ``x`` the atoms' positions as
LAMMPS 22 Jul 2025's couple has them; ``with_x=False`` gives None there). Their classes carry the
module names of LAMMPS's couples (``mliap_unified_couple``, ``mliap_unified_couple_kokkos``), by which cgforge
tells them apart. ``lammps="2025"`` gives the host class what LAMMPS 22 Jul 2025's has on top:
``update_pair_forces_gpu``, ``forward_exchange`` and ``reverse_exchange`` that only raise NotImplementedError.
``exchange=True`` adds ``forward_exchange`` / ``reverse_exchange`` between the domains to the Kokkos flavour
(threads meet at a barrier, as ranks would in MPI); ``run_domains`` then runs one model object per domain in
its own thread. Each exchange's (direction, width) is logged in ``exchange_log``; on the host an exchange
wider than LAMMPS's host communication buffers hold per atom (6 forward, 3 reverse) raises, where LAMMPS
would write past them.

For tests without LAMMPS (tests/lammps/test_lammps.py); the real couples are exercised by
tests/lammps/test_lammps_real.py.

``combine(domains)`` adds the domains up as LAMMPS does: energy, forces of every atom (ghost copies summed
into their owners) and the virial ``-sum rij (x) fij`` (LAMMPS's sign: W = -dE/d strain).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from ase import Atoms
from scipy.spatial import cKDTree

__all__ = ["HOST_COMM_WIDTH", "StandInData", "build_domains", "combine", "run_domains"]

# per-atom values LAMMPS's host communication buffers hold at least: size_border forward, size_reverse reverse
HOST_COMM_WIDTH = {"forward": 6, "reverse": 3}


class _DLPackArray:
    """A device array seen only through DLPack (as CuPy arrays reach the model from Kokkos)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._t = tensor

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        return self._t.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self) -> Any:
        return self._t.__dlpack_device__()


class _Shared:
    """What the domains' exchanges meet at."""

    def __init__(self, n: int) -> None:
        self.barrier = threading.Barrier(n, timeout=120)
        self.posted: dict[int, Any] = {}


class StandInData:
    """One domain's data object (see the module doc). ``gid`` [ntotal]: global atom index of each atom;
    ``owner`` [ntotal, 2]: (domain, local index) owning each atom."""

    def __init__(self, *, domain: int, positions: np.ndarray, gid: np.ndarray, owner: np.ndarray, nlocal: int,
                 elems: np.ndarray, pairs: tuple[np.ndarray, np.ndarray], ghost_neighbours: bool,
                 flavour: str, device: str, shared: _Shared | None, with_x: bool = True) -> None:
        i, j = pairs
        self.domain, self.gid, self.owner, self.flavour = domain, gid, owner, flavour
        self.nlocal = nlocal
        self.ntotal = len(gid)
        self.nlistatoms = nlocal
        self.natomneigh = self.ntotal if ghost_neighbours else nlocal
        self.npairs = len(i)
        self.eflag, self.vflag = 1, 1
        self._device = torch.device(device)
        rij = positions[j] - positions[i]
        host = {"pair_i": i.astype(np.int32), "jatoms": j.astype(np.int32), "rij": np.ascontiguousarray(rij),
                "elems": elems.astype(np.int32), "iatoms": np.arange(self.natomneigh, dtype=np.int32),
                "numneighs": np.bincount(i, minlength=self.natomneigh).astype(np.int32),
                "x": np.ascontiguousarray(positions, dtype=np.float64)}
        self.with_x = with_x
        self._host = host
        self.f = np.zeros((self.ntotal, 3))
        self.virial = np.zeros((3, 3))
        self.eatoms_written = np.zeros(nlocal)
        self.energy_written: float | None = None
        self.pair_force_calls = 0
        self._eatoms_buffer = torch.zeros(nlocal, dtype=torch.float64, device=self._device)
        self._shared = shared
        self.exchange_log: list[tuple[str, int]] = []  # ("forward" | "reverse", width) of each exchange call

    @property
    def exchanges(self) -> int:
        """Exchange calls made (forward and reverse)."""
        return len(self.exchange_log)

    def _array(self, name: str) -> Any:
        a = self._host[name]
        if self.flavour == "host" or self._device.type == "cpu":  # numpy, as both couples give host memory
            return a
        return _DLPackArray(torch.from_numpy(a).to(self._device))

    pair_i = property(lambda self: self._array("pair_i"))
    pair_j = property(lambda self: self._array("jatoms"))
    jatoms = property(lambda self: self._array("jatoms"))
    rij = property(lambda self: self._array("rij"))
    elems = property(lambda self: self._array("elems"))
    iatoms = property(lambda self: self._array("iatoms"))
    numneighs = property(lambda self: self._array("numneighs"))

    # --- results --------------------------------------------------------------------------------

    def _set_energy(self, value: float) -> None:
        self.energy_written = float(value)

    energy = property(None, _set_energy)  # write-only, as in LAMMPS

    def _set_eatoms(self, value: np.ndarray) -> None:
        if self.flavour != "host":
            raise AttributeError("eatoms is read-only in the Kokkos flavour: write into the array it returns")
        self.eatoms_written = np.array(value, dtype=np.float64).reshape(self.nlistatoms)

    def _get_eatoms(self) -> Any:
        if self.flavour == "host":
            raise AttributeError("eatoms is write-only in the host flavour")
        if self._device.type == "cpu":
            return self._eatoms_buffer.numpy()  # a view: what is written lands in the buffer
        return _DLPackArray(self._eatoms_buffer)

    eatoms = property(_get_eatoms, _set_eatoms)

    def update_pair_forces(self, fij: np.ndarray) -> None:
        if not (isinstance(fij, np.ndarray) and fij.dtype == np.float64 and fij.flags.c_contiguous):
            raise TypeError(f"update_pair_forces: expected a C-contiguous float64 numpy array, got {type(fij)}")
        self._tally(fij)

    def _tally(self, fij: np.ndarray) -> None:
        if fij.shape != (self.npairs, 3):
            raise ValueError(f"fij: expected shape ({self.npairs}, 3), got {fij.shape}")
        i, j = self._host["pair_i"], self._host["jatoms"]
        np.add.at(self.f, i, fij)
        np.add.at(self.f, j, -fij)
        self.virial -= self._host["rij"].T @ fij
        self.pair_force_calls += 1

    def read_kokkos_eatoms(self) -> None:
        """Kokkos flavour: what the model wrote into ``eatoms`` (as LAMMPS reads it after the call)."""
        self.eatoms_written = self._eatoms_buffer.cpu().numpy().copy()

    # --- exchange between domains ---------------------------------------------------------------

    def _forward_exchange(self, feats: torch.Tensor, out: torch.Tensor, width: int) -> None:
        self._check(feats, out, width, "forward")
        shared, n = self._shared, self.nlocal
        out[:n] = feats[:n]
        shared.posted[self.domain] = feats[:n].detach().clone()
        shared.barrier.wait()
        owner = torch.as_tensor(self.owner[n:], device=out.device)
        for d, rows in shared.posted.items():
            sel = (owner[:, 0] == d).nonzero().flatten()
            out[n + sel] = rows.to(out.device)[owner[sel, 1]]
        shared.barrier.wait()  # nobody posts again before everyone has read

    def _reverse_exchange(self, grad: torch.Tensor, gout: torch.Tensor, width: int) -> None:
        self._check(grad, gout, width, "reverse")
        shared, n = self._shared, self.nlocal
        gout.zero_()
        gout[:n] = grad[:n]
        shared.posted[self.domain] = (torch.as_tensor(self.owner[n:]), grad[n:].detach().clone())
        shared.barrier.wait()
        for owner, rows in shared.posted.values():
            sel = (owner[:, 0] == self.domain).nonzero().flatten()
            gout.index_add_(0, owner[sel, 1].to(gout.device), rows[sel].to(gout.device))
        shared.barrier.wait()

    def _check(self, a: torch.Tensor, b: torch.Tensor, width: int, direction: str) -> None:
        for t in (a, b):
            if not (isinstance(t, torch.Tensor) and t.is_contiguous() and tuple(t.shape) == (self.ntotal, width)):
                raise ValueError(f"exchange: expected contiguous [{self.ntotal}, {width}] tensors, got "
                                 f"{type(t).__name__} {tuple(getattr(t, 'shape', ()))}")
        room = HOST_COMM_WIDTH[direction]
        if a.device.type == "cpu" and width > room:
            raise ValueError(f"{direction}_exchange: {width} values per atom on the host, where LAMMPS's "
                             f"communication buffers hold {room}: LAMMPS would write past them")
        self.exchange_log.append((direction, width))


class _HostData(StandInData):
    __module__ = "mliap_unified_couple"  # LAMMPS's host couple


class _HostData2025(_HostData):
    """The host couple of LAMMPS 22 Jul 2025: Kokkos-only methods that raise."""

    __module__ = _HostData.__module__  # a class body sets its own module: the couple's again

    def update_pair_forces_gpu(self, fij: Any) -> None:
        raise NotImplementedError("update_pair_forces_gpu() is only available with the KOKKOS unified coupling")

    def forward_exchange(self, copy_from: Any, copy_to: Any, vec_len: int) -> None:
        raise NotImplementedError("forward_exchange() is only available with the KOKKOS unified coupling")

    def reverse_exchange(self, copy_from: Any, copy_to: Any, vec_len: int) -> None:
        raise NotImplementedError("reverse_exchange() is only available with the KOKKOS unified coupling")


class _KokkosData(StandInData):
    __module__ = "mliap_unified_couple_kokkos"  # LAMMPS's Kokkos couple

    @property
    def x(self) -> Any:
        """The atoms' positions [ntotal, 3] (22 Jul 2025's couple); None (a NULL array) with ``with_x=False``."""
        return self._array("x") if self.with_x else None

    @property
    def dev(self) -> int:
        return int(self._device.type == "cuda")

    def update_pair_forces_gpu(self, fij: torch.Tensor) -> None:
        if not (isinstance(fij, torch.Tensor) and fij.dtype == torch.float64 and fij.is_contiguous()):
            raise TypeError("update_pair_forces_gpu: expected a contiguous float64 tensor")
        # "cuda" (no index) names the current device, as torch.device("cuda:0") does on one GPU
        if fij.device.type != self._device.type or self._device.index not in (None, fij.device.index):
            raise ValueError(f"update_pair_forces_gpu: forces on {fij.device}, LAMMPS's arrays on {self._device}")
        self._tally(fij.cpu().numpy())


class _Exchanging:
    def forward_exchange(self, feats: torch.Tensor, out: torch.Tensor, width: int) -> None:
        self._forward_exchange(feats, out, width)

    def reverse_exchange(self, grad: torch.Tensor, gout: torch.Tensor, width: int) -> None:
        self._reverse_exchange(grad, gout, width)


def _data_class(flavour: str, exchange: bool, lammps: str) -> type:
    if flavour == "host":
        if exchange:
            raise ValueError("exchange=True: only LAMMPS's Kokkos couple exchanges features (flavour='kokkos')")
        return _HostData2025 if lammps == "2025" else _HostData
    if not exchange:
        return _KokkosData
    return type("_KokkosDataExchange", (_Exchanging, _KokkosData), {"__module__": _KokkosData.__module__})


def build_domains(atoms: Atoms, element_types: Sequence[str], cutoff: float, ghost_cutoff: float, *,
                  n_domains: int = 1, ghost_neighbours: bool = True, exchange: bool = False, flavour: str = "host",
                  device: str = "cpu", seed: int = 0, lammps: str = "2024",
                  with_x: bool = True) -> list[StandInData]:
    """The domains' data objects for ``atoms`` (see the module doc)."""
    if flavour not in ("host", "kokkos"):
        raise ValueError(f"flavour: expected 'host' or 'kokkos', got {flavour!r}")
    if lammps not in ("2024", "2025"):
        raise ValueError(f"lammps: expected '2024' or '2025', got {lammps!r}")
    cell = np.asarray(atoms.cell)
    lengths = np.diag(cell)
    if not (all(atoms.pbc) and np.allclose(cell, np.diag(lengths)) and (lengths > 0).all()):
        raise ValueError("atoms: the stand-in needs a fully periodic orthorhombic cell")
    symbols = atoms.get_chemical_symbols()
    unknown = sorted(set(symbols) - set(element_types))
    if unknown:
        raise ValueError(f"atoms: elements {unknown} are not among the model's {list(element_types)}")
    species = np.array([list(element_types).index(s) for s in symbols])
    frac = np.mod(atoms.get_scaled_positions(wrap=False), 1.0)
    x = frac * lengths
    home = np.minimum((frac[:, 0] * n_domains).astype(int), n_domains - 1)
    local_index = np.zeros(len(atoms), dtype=int)
    for d in range(n_domains):
        local_index[home == d] = np.arange(int((home == d).sum()))
    reach = np.ceil(ghost_cutoff / lengths).astype(int) + 1
    images = np.stack(np.meshgrid(*[np.arange(-r, r + 1) for r in reach], indexing="ij"), -1).reshape(-1, 3)
    rng = np.random.default_rng(seed)
    shared = _Shared(n_domains) if exchange else None
    cls = _data_class(flavour, exchange, lammps)
    domains = []
    for d in range(n_domains):
        lo = np.array([d / n_domains * lengths[0], 0.0, 0.0])
        hi = np.array([(d + 1) / n_domains * lengths[0], lengths[1], lengths[2]])
        local = np.nonzero(home == d)[0]
        ghost_gid, ghost_pos = [], []
        for s in images:
            pos = x + s * lengths
            inside = ((pos >= lo - ghost_cutoff) & (pos < hi + ghost_cutoff)).all(axis=1)
            if not s.any():
                inside &= home != d  # the local atoms themselves are not ghosts
            ghost_gid.append(np.nonzero(inside)[0])
            ghost_pos.append(pos[inside])
        gid = np.concatenate([local, *ghost_gid])
        positions = np.concatenate([x[local], *ghost_pos])
        nlocal = len(local)
        owner = np.stack([home[gid], local_index[gid]], axis=1)
        i, j = _pairs(positions, cutoff, nlocal if not ghost_neighbours else len(gid), rng)
        domains.append(cls(domain=d, positions=positions, gid=gid, owner=owner, nlocal=nlocal,
                           elems=species[gid], pairs=(i, j), ghost_neighbours=ghost_neighbours, flavour=flavour,
                           device=device, shared=shared, with_x=with_x))
    return domains


def _pairs(positions: np.ndarray, cutoff: float, n_centres: int, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """(centre, neighbour) of every pair closer than ``cutoff`` whose centre is < n_centres, grouped by centre."""
    pairs = cKDTree(positions).query_pairs(cutoff, output_type="ndarray")
    i = np.concatenate([pairs[:, 0], pairs[:, 1]])
    j = np.concatenate([pairs[:, 1], pairs[:, 0]])
    keep = (np.linalg.norm(positions[j] - positions[i], axis=1) < cutoff) & (i < n_centres)
    i, j = i[keep], j[keep]
    order = np.lexsort((rng.random(len(i)), i))  # grouped by centre, neighbours shuffled
    return i[order], j[order]


def run_domains(models: Sequence[Any], domains: Sequence[StandInData]) -> None:
    """``models[d].compute_forces(domains[d])`` for every domain; in threads when the domains exchange."""
    for model, data in zip(models, domains):
        if callable(getattr(model, "prepare", None)):
            model.prepare(data)  # loading is not thread-safe: before the threads
    call: Callable[[int], None] = lambda d: models[d].compute_forces(domains[d])  # noqa: E731
    if len(domains) == 1 or domains[0]._shared is None:
        for d in range(len(domains)):
            call(d)
    else:
        if any(data._device.type == "cuda" for data in domains):
            # torch runs a device's backward passes on one worker thread: one domain's reverse exchange inside
            # its backward would block the other domain's backward forever
            raise ValueError("the stand-in exchanges between domains in threads, which deadlocks in CUDA backward "
                             "passes: use ghost-neighbour mode on CUDA (real LAMMPS ranks are processes)")
        errors: list[BaseException] = []

        def target(d: int) -> None:
            try:
                call(d)
            except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
                errors.append(err)
                domains[d]._shared.barrier.abort()

        threads = [threading.Thread(target=target, args=(d,)) for d in range(len(domains))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
    for data in domains:
        if data.flavour == "kokkos":
            data.read_kokkos_eatoms()


def combine(domains: Sequence[StandInData], n_atoms: int) -> dict[str, np.ndarray | float]:
    """Energy, per-atom energies, forces [n_atoms, 3] and virial (LAMMPS's sign) summed over the domains."""
    forces = np.zeros((n_atoms, 3))
    energies = np.zeros(n_atoms)
    energy, virial = 0.0, np.zeros((3, 3))
    for data in domains:
        if data.energy_written is None:
            raise RuntimeError(f"domain {data.domain}: the model wrote no energy")
        np.add.at(forces, data.gid, data.f)
        energies[data.gid[:data.nlocal]] = data.eatoms_written
        energy += data.energy_written
        virial += data.virial
    return {"energy": energy, "energies": energies, "forces": forces, "virial": virial}
