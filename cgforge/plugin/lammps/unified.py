"""cgforge's ``MLIAPUnified`` class: MACE and NequIP models in LAMMPS through ``pair_style mliap unified``.

LAMMPS calls ``compute_forces(data)`` once per force evaluation with one MPI domain's atoms (local and ghosts),
its pairs within the cutoff (``pair_i`` the centre, ``rij = x_j - x_i``) and each atom's element. Each pair is an
edge ``pair_j -> pair_i`` with vector ``-rij``; the domain's energy sums its listed atoms' energies, and
``fij = dE/drij`` goes back through ``update_pair_forces(_gpu)`` (LAMMPS adds it to both atoms and tallies the virial).

Modes: ghost-neighbour (``pair_style ... 1``) and exchange (``... 0``), docs/lammps.md section 2. Ghost-mode calls
on CUDA and one-rank exchange-mode calls run the padded step (``captured``), captured in a CUDA graph; other calls
run eagerly. The object pickles small (the model file's bytes and the options); the model is loaded as a
``Potential`` (``runtime.load``) at the first call, in the LAMMPS process.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from .arrays import LammpsArrays, PairData, is_device_flavour, lammps_arrays, read_pairs, to_tensor, write_results
from .captured import STALE, UNSORTED, PaddedStep
from .exchange import ExchangeHooks, GhostMap
from .owners import GhostMapCache
from .ranks import launcher_ranks
from .receptive import ReceptiveField, receptive_field
from .timers import OFF, PhaseTimers, hook_exit, register

__all__ = ["CgforgeMLIAP", "MODES", "LammpsSetupError"]

MODES = ("auto", "ghost", "exchange")
_TRANSIENT = ("interface", "_potential", "_adapter", "_device", "_hooks", "_tmp", "_step", "padded_off", "ranks",
              "_owners", "_timers", "last_field")


class LammpsSetupError(RuntimeError):
    """The LAMMPS run is set up in a way that gives wrong numbers with this model (the message says the fix)."""


def _mliap_base() -> type:
    """LAMMPS's ``MLIAPUnified`` when importable (inside LAMMPS it is), else a stand-in with its attributes."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # lammps.mliap warns when imported outside a LAMMPS process
            from lammps.mliap.mliap_unified_abc import MLIAPUnified
        return MLIAPUnified
    except Exception:  # noqa: BLE001 - no LAMMPS, or one whose python library cannot be found: not needed here
        class MLIAPUnified:  # the attributes LAMMPS's coupling reads (CgforgeMLIAP sets them)
            def __init__(self) -> None:
                self.interface = self.element_types = self.ndescriptors = self.nparams = self.rcutfac = None

        return MLIAPUnified


class CgforgeMLIAP(_mliap_base()):
    """A MACE or NequIP model for ``pair_style mliap unified`` (written by ``cgforge lammps-model``, whose flags,
    the keywords here, docs/lammps.md's table explains; ``type_map`` also names the LAMMPS elements).

    _padded: internal, runs the padded step uncaptured (CPU tests). ``capture_error`` says why a capture failed;
    ``last_path`` which path the last call took ("captured", "padded" or "eager"); ``last_field``, for a ghost-mode
    call, (atoms, pairs) its model ran on of (atoms, pairs) LAMMPS gave (``receptive``), else None.
    """

    def __init__(self, model: str | os.PathLike, *, dtype: str | None = None, device: str | None = None,
                 patch: bool | None = None, head: str | None = None, type_map: dict[str, str] | None = None,
                 mode: str = "auto", cuda_graph: bool | None = None, radial_table: bool | None = None,
                 timers: bool = False, _padded: bool = False) -> None:
        from cgforge.plugin.runtime.bundled import checkpoint_path
        from cgforge.plugin.runtime.capture import resolve_cuda_graph
        from cgforge.plugin.runtime.potential import UnsupportedModelError, check_radial_table, load

        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {', '.join(MODES)}, got {mode!r}")
        if patch not in (None, True, False):
            raise TypeError(f"patch: expected None, True or False, got {patch!r}")
        if not (cuda_graph is None or isinstance(cuda_graph, bool)):
            raise TypeError(f"cuda_graph: expected None, True or False, got {cuda_graph!r}")
        check_radial_table(radial_table, "fp32")
        if not isinstance(timers, bool):
            raise TypeError(f"timers: expected True or False, got {timers!r}")
        if cuda_graph and device is not None and not str(device).startswith("cuda"):
            raise ValueError(f"cuda_graph=True needs the model on a CUDA device, got device={device!r}")
        path = checkpoint_path(model)
        self.model_name, self.model_bytes = path.name, path.read_bytes()
        self.dtype = None if dtype is None else str(dtype).replace("torch.", "")
        self.device = None if device is None else str(device)
        self.patch, self.head, self.mode, self.cuda_graph = patch, head, mode, cuda_graph
        self.type_map = dict(type_map) if type_map is not None else None
        self.radial_table, self.timers, self._padded = radial_table, timers, bool(_padded)
        # Load it now (CPU; patched unless patch=False, to check cgforge supports it; the radial tables if asked
        # for), so a bad or unsupported file, or an option this model cannot have, fails here and not inside LAMMPS.
        try:
            potential = load(path, "cpu", self.dtype, patch=patch is not False, radial_table=radial_table, head=head,
                             type_map=self.type_map, warmup=False)
        except UnsupportedModelError as err:
            raise UnsupportedModelError(f"{err}; patch=False (`--patch off`) runs the model's own code") from err
        adapter = potential.adapter
        self.inert_edges_reason = potential.inert_edges_reason  # None: padding edges change nothing
        resolve_cuda_graph(cuda_graph, None, self.inert_edges_reason)  # the model's side; the device's at setup
        self.kind = adapter.kind
        self.cutoff = float(adapter.cutoff)
        self.layers = len(adapter.message_layers())
        self.element_types = _element_names(adapter, self.type_map)
        self.rcutfac = 0.5 * self.cutoff  # LAMMPS's pair cutoff is 2 x rcutfac (element radius 1)
        self.ndescriptors = self.nparams = 1  # required by the coupling; unused
        self.last_mode = self.last_path = None
        self._clear_runtime()

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in _TRANSIENT}

    def __setstate__(self, state: dict) -> None:
        # Files written before an option existed load with its default.
        self.__dict__.update({"cuda_graph": None, "_padded": False, "inert_edges_reason": None, "last_path": None,
                              "radial_table": False, "timers": False})
        self.__dict__.update(state)
        self.__dict__.pop("owner_exchanges", None)  # a counter of files written before ``owners``: now the cache's
        self.interface = None
        self._clear_runtime()

    def _clear_runtime(self) -> None:
        self._potential = self._adapter = self._device = self._hooks = self._tmp = None
        self._step: PaddedStep | None = None
        self._owners = GhostMapCache()  # one-rank exchange mode's ghost owners, kept across calls
        self.ranks = 0  # MPI ranks of the run (``launcher_ranks``, read at setup; 0: not set up)
        self.padded_off: str | None = None  # why ghost-mode calls left the padded step for good (None: they did not)
        self._timers = OFF  # the calls' phase times (``set_timers``, at setup)
        self.last_field = None
        register(self)  # findable by the input's ``python`` command (``timers.report``, ``timers.switch``)

    @property
    def capture_error(self) -> str | None:
        """Why the CUDA-graph capture failed (calls then run the padded step eagerly), or None."""
        return None if self._step is None else self._step.capture_error

    @property
    def owner_exchanges(self) -> int:
        """Exchanges that found the ghosts' owners (one-rank exchange mode; kept maps are reused without one)."""
        return self._owners.exchanges

    @property
    def exchanges(self) -> int:
        """Exchanges through LAMMPS so far: of node features inside the model, and of the ghosts' owners."""
        return (self._hooks.calls if self._hooks is not None else 0) + self.owner_exchanges

    @property
    def ghost_cutoff(self) -> float:
        """The ghost shell ghost-neighbour mode needs (add the neighbour skin): layers x cutoff."""
        return self.layers * self.cutoff

    def _device_for(self, data: Any) -> torch.device:
        from cgforge.plugin.runtime.potential import resolve_device

        if self.device not in (None, "auto"):
            return resolve_device(self.device)
        if is_device_flavour(data) and (elems := to_tensor(data.elems)).is_cuda:
            return elems.device
        return torch.device("cpu")

    def prepare(self, data: Any) -> None:
        """Load the model for ``data`` (on the device of its arrays, or ``device``) unless loaded already, as the first
        ``compute_forces`` does. Loading is not thread-safe (e3nn traces modules with torch.fx): prepare first."""
        if self._potential is None:
            self.setup(self._device_for(data))

    def setup(self, device: torch.device | str) -> None:
        """Load (and patch) the model on ``device`` now: a ``Potential`` (``runtime.load``), whose rules decide
        cgforge's kernels, the radial tables and the capture as for the Calculator; its kernels compiled now."""
        from cgforge.plugin.runtime.potential import load

        device = torch.device(device)
        if device.type == "cuda" and device.index is not None:
            # one GPU per MPI rank (`-k on g N`): kernels launched on the current device must land on this one
            torch.cuda.set_device(device)
        if self.cuda_graph and device.type != "cuda":
            raise ValueError(f"cuda_graph=True needs the model on a CUDA device, got {device} (LAMMPS's arrays are on "
                             "the host: pass device='cuda', or cuda_graph=None)")
        self._tmp = tempfile.TemporaryDirectory(prefix="cgforge-lammps-")  # lives as long as the model
        path = Path(self._tmp.name) / self.model_name
        path.write_bytes(self.model_bytes)
        potential = load(path, device, self.dtype, patch=self.patch, radial_table=self.radial_table,
                         cuda_graph=self.cuda_graph, head=self.head, type_map=self.type_map, warmup=False)
        potential.compile_kernels()  # not in the middle of a step (or an exchange)
        self._potential, self._adapter, self._device = potential, potential.adapter, device
        self._hooks = ExchangeHooks(self._adapter)
        self.ranks = launcher_ranks()
        self.inert_edges_reason = potential.inert_edges_reason  # of the model as loaded here
        if potential.cuda_graph or self._padded:
            self._step = PaddedStep(potential, cuda_graph=potential.cuda_graph)
        self.set_timers(self.timers)

    def set_timers(self, on: bool) -> None:
        """Per-phase times on (from zero) or off (``timers``); takes effect at setup when called before it."""
        if not isinstance(on, bool):
            raise TypeError(f"timers: expected True or False, got {on!r}")
        self.timers = on
        if self._device is None:
            return
        self._timers = self._hooks.timers = PhaseTimers(self._device) if on else OFF
        if on:
            hook_exit()
        if self._step is not None:
            self._step.timers = self._timers

    def compute_descriptors(self, data: Any) -> None:
        pass

    def compute_gradients(self, data: Any) -> None:
        pass

    def compute_forces(self, data: Any) -> None:
        """Per-atom energies, the domain's energy and the pair forces of one LAMMPS step into ``data``."""
        self.prepare(data)
        with self._timers.call():
            self._forces(data)

    def _forces(self, data: Any) -> None:
        timers = self._timers
        with timers.phase("arrays"):
            arrays = lammps_arrays(data, timers)
        mode = self._choose_mode(data, arrays.natomneigh > arrays.nlist, arrays.ntotal > arrays.nlocal)
        self.last_mode = mode
        step = self._step if self.padded_off is None and arrays.nlist else None
        ghosts, check = None, None
        if mode == "exchange":
            if self.ranks == 1:  # the owners: kept from an earlier call (``check`` still to make) or found now
                with timers.phase("owners"):
                    ghosts, check = self._owners.lookup(data, arrays.nlocal, arrays.ntotal, self._device)
            else:  # every rank alike: no owner exchange (``exchange``'s module doc says why)
                ghosts = GhostMap.every_ghost(arrays.nlocal, arrays.ntotal, self._device)
            if self._exchanges_inside(ghosts):
                if self.cuda_graph:
                    raise LammpsSetupError(
                        "cuda_graph=True, but this exchange-mode call cannot be captured: "
                        + (f"the launcher runs {self.ranks} MPI ranks, whose exchanges call LAMMPS back inside the "
                           "model (forward_exchange)" if self.ranks != 1 else
                           "some ghost atoms belong to another MPI rank")
                        + ". Use one rank, ghost mode (`pair_style mliap unified FILE 1`) or cuda_graph=None")
                step = None
        if step is not None:
            outcome = step.run(data, arrays, ghosts, check)
            if outcome == STALE:  # LAMMPS rebuilt its ghosts since the kept owners were found: find them, again
                with timers.phase("owners"):
                    ghosts = self._owners.refresh(data, arrays.nlocal, arrays.ntotal, self._device)
                outcome = step.run(data, arrays, ghosts) if ghosts.one_domain else STALE
            if outcome is None:
                self.last_path = "captured" if step.cuda_graph else "padded"
                self.last_field = step.last_field
                return
            if outcome == UNSORTED:
                step.invalidate()  # its graph and buffers' memory back: not used again
                self.padded_off = ("LAMMPS's pairs are not in ascending centre order, which the padded step needs "
                                   "(it lays them out without a sort)")
                warnings.warn(f"cgforge: {self.padded_off}; this and later calls run the eager step",
                              RuntimeWarning, stacklevel=2)
        elif check is not None and bool(check.moved()):  # eager calls check the kept owners now (one read)
            with timers.phase("owners"):
                ghosts = self._owners.refresh(data, arrays.nlocal, arrays.ntotal, self._device)
        self.last_path = "eager"
        self._eager(data, arrays, ghosts)

    def _eager(self, data: Any, arrays: LammpsArrays, ghosts: GhostMap | None) -> None:
        """One call with a graph and species groups of its own, autograd run eagerly; ``ghosts``: exchange mode's
        map of atoms to nodes (None: ghost mode, every atom a node)."""
        adapter, timers = self._adapter, self._timers
        with timers.phase("arrays"):
            pairs = read_pairs(arrays, self._device, adapter.dtype)
        if pairs.listed.numel() == 0 and (ghosts is None or self.ranks == 1):  # nothing to count, no exchange owed
            write_results(data, pairs.rij.new_zeros(0), pairs.rij.new_zeros(()), pairs.rij.new_zeros(pairs.rij.shape))
            return
        npairs, field, self.last_field = pairs.rij.shape[0], None, None
        if ghosts is None:
            pairs, field = self._receptive(pairs)
        neighbour, elems = pairs.neighbour, pairs.elems
        if ghosts is not None and not ghosts.identity:  # images of local atoms are those atoms, then others' ghosts
            neighbour = ghosts.node_of.index_select(0, neighbour)
            elems = torch.cat([elems[:ghosts.nlocal], elems.index_select(0, ghosts.remote)])
        if adapter.set_row_chunks(elems.shape[0]) and self._step is not None:
            self._step.invalidate()  # its capture had other chunks
        species = adapter.species_from_index(elems)
        vectors = (-pairs.rij).detach().requires_grad_(True)  # pos[receiver] - pos[sender], receiver = pair_i
        edge_index = adapter.edge_index(neighbour, pairs.centre)
        positions = torch.zeros(elems.shape[0], 3, dtype=adapter.dtype, device=self._device)  # unused: shape only
        with timers.phase("model"), torch.enable_grad(), ExitStack() as stack:
            groups = self._potential.species_groups(elems)
            for cache in self._potential.graph_caches:
                stack.enter_context(cache.use_species(groups))
            if ghosts is not None and self._exchanges_inside(ghosts):
                stack.enter_context(self._hooks.active(data, ghosts))
            _, node_energy = adapter.energy(positions, vectors, species, edge_index, True)
            if node_energy is None:
                raise ValueError("model: it returns no per-atom energies, which LAMMPS needs (eatoms)")
            eatoms = node_energy.reshape(-1).index_select(0, pairs.listed)
            energy = eatoms.sum()
            grad = torch.autograd.grad(energy, vectors, allow_unused=True)[0] if vectors.shape[0] else None
        with timers.phase("forces"):
            fij = -grad if grad is not None else torch.zeros_like(vectors)  # dE/drij = -dE/dvector
            if field is not None:  # the pairs left out: exactly zero
                fij = fij.new_zeros(npairs, 3).index_copy_(0, field.pairs, fij)
            write_results(data, eatoms.detach(), energy.detach(), fij, timers)

    def _receptive(self, pairs: PairData) -> tuple[PairData, ReceptiveField | None]:
        """Ghost mode: ``pairs`` cut to what the listed atoms' energies read (``receptive``) and the cut (None: nothing
        left out); ``last_field`` says what the model runs on."""
        given = (pairs.elems.shape[0], pairs.rij.shape[0])
        field = receptive_field(pairs.centre, pairs.neighbour, pairs.listed, given[0], self.layers)
        if field is not None:
            node_of, kept = field.node_of, field.pairs
            pairs = PairData(node_of[pairs.centre[kept]], node_of[pairs.neighbour[kept]], pairs.rij[kept],
                             pairs.elems[field.atoms], node_of[pairs.listed])
        self.last_field = ((pairs.elems.shape[0], pairs.rij.shape[0]), given)
        return pairs, field

    def _exchanges_inside(self, ghosts: GhostMap) -> bool:
        """Whether an exchange-mode call sends features inside the model: on several ranks always (every rank alike),
        on one only if some ghost had no local owner (the stand-in's domains in one process)."""
        return self.ranks != 1 or not ghosts.one_domain

    def _choose_mode(self, data: Any, ghost_centres: bool, has_ghosts: bool) -> str:
        # the Kokkos couple's exchange; the host couple of 22 Jul 2025 has the methods too, but they only raise
        can_exchange = is_device_flavour(data) and callable(getattr(data, "forward_exchange", None))
        if self.mode == "exchange":
            if not can_exchange:
                raise LammpsSetupError("mode='exchange' needs a LAMMPS whose ML-IAP data object has forward_exchange "
                                       "(Kokkos ML-IAP, LAMMPS 22 Jul 2025 or later); this one has none: use "
                                       f"mode='ghost' with `pair_style mliap unified FILE 1` and `comm_modify "
                                       f"cutoff {self.ghost_cutoff:g}` (+ the neighbour skin)")
            return "exchange"
        if ghost_centres or not has_ghosts or self.layers == 1:
            return "ghost"
        if self.mode == "auto" and can_exchange:
            return "exchange"
        raise LammpsSetupError(
            f"this {self.layers}-layer model needs the pairs of ghost atoms: use `pair_style mliap unified FILE 1` "
            f"and `comm_modify cutoff {self.ghost_cutoff:g}` (layers x cutoff, plus the neighbour skin)"
            + ("" if can_exchange else ", or a LAMMPS with forward_exchange (Kokkos ML-IAP, 22 Jul 2025+)"))


def _element_names(adapter: Any, type_map: dict[str, str] | None) -> list[str]:
    """The element names ``pair_coeff`` maps LAMMPS types to, in the model's species order."""
    if adapter.kind == "mace":
        from ase.data import chemical_symbols

        return [chemical_symbols[z] for z in adapter.elements]
    names = list(adapter.type_names)
    if type_map:  # NequIP types named otherwise: LAMMPS sees the chemical symbols mapped to them
        by_type = {t: s for s, t in type_map.items()}
        names = [by_type.get(t, t) for t in names]
    return names
