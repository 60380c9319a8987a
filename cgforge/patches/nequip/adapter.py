"""The calculator's adapter for NequIP models, and whether edges beyond the cutoff are inert.

``NequipAdapter`` gives the energy model an AtomicDataDict with ``edge_vectors`` filled in (imports no nequip
code). ``inert_beyond_cutoff``, read from nequip 0.19: the edge embedding, ZBL and Lennard-Jones are multiplied by
``PolynomialCutoff`` (``* (x < 1)``), each block's ``edge_mlp`` is bias-free (checked at 0), a radial table holds
edge_mlp(0) = 0 for x >= 1; any other module is "not known".
"""

from __future__ import annotations

import numpy as np
import torch
from ase.data import atomic_numbers as _SYMBOL_TO_Z
from ase.data import chemical_symbols
from torch import Tensor

from ..common import UnknownElementError, check_numbers, unknown_elements, vanishes_at_zero
from ..graph_cache import CallGraphCache
from ..radial_table import fused_edge_bytes, original
from ..torch_internals import forward_pre_hooks
from . import radial_table, streaming
from .modules import CUTOFF_MODULES, NODE_MODULES, class_name


class NequipAdapter:
    kind = "nequip"
    sender_row = 1  # nequip: edge_index[0] is the centre (receives messages), edge_index[1] the neighbour

    def __init__(self, model: torch.nn.Module, device: torch.device, type_map: dict[str, str] | None = None) -> None:
        metadata = model.metadata
        self.model = model
        self.device = device
        self.type_names = metadata["type_names"].split(" ")
        self.n_species = len(self.type_names)
        self.cutoff = float(metadata["r_max"])
        # nequip's own calculator feeds float64 positions whatever the model dtype (the model casts after
        # the edge geometry): do the same, so FP32 models see the same edge lengths.
        self.dtype = torch.float64
        self.energy_model = energy_model_of(model)
        self.hops = message_hops(self.energy_model)
        table = np.full(119, -1, dtype=np.int64)
        for symbol, type_name in self._symbol_to_type(type_map).items():
            table[_SYMBOL_TO_Z[symbol]] = self.type_names.index(type_name)
        self._table = table

    def _symbol_to_type(self, type_map: dict[str, str] | None) -> dict[str, str]:
        if type_map is None:
            # Default: type names that are chemical symbols map to themselves.
            return {name: name for name in self.type_names if name in _SYMBOL_TO_Z}
        if not isinstance(type_map, dict):
            raise TypeError(f"type_map: expected a dict chemical symbol -> type name, got {type(type_map).__name__}")
        for symbol, name in type_map.items():
            if symbol not in _SYMBOL_TO_Z:
                raise ValueError(f"type_map: {symbol!r} is not a chemical symbol")
            if name not in self.type_names:
                raise ValueError(f"type_map: {name!r} is not a type of this model; types are {self.type_names}")
        return dict(type_map)

    def species(self, numbers: np.ndarray) -> Tensor:
        numbers = check_numbers(numbers)
        inside = (numbers >= 0) & (numbers < len(self._table))
        index = np.where(inside, self._table[np.clip(numbers, 0, len(self._table) - 1)], -1)
        if (index < 0).any():
            known = [chemical_symbols[z] for z in np.nonzero(self._table >= 0)[0]]
            err = unknown_elements(numbers, index >= 0, known or ["(no chemical symbols)"])
            if len(known) < self.n_species:
                err = UnknownElementError(f"{err}; model types are {self.type_names}: pass type_map="
                                          "{symbol: type name} for types that are not chemical symbols")
            raise err
        return torch.as_tensor(index, device=self.device)

    def warmup_species(self, n: int) -> Tensor:
        return torch.arange(n, device=self.device) % self.n_species

    def species_index(self, species: Tensor) -> Tensor:
        return species

    def species_from_index(self, index: Tensor) -> Tensor:
        return index.to(device=self.device, dtype=torch.int64)

    def edge_index(self, sender: Tensor, receiver: Tensor) -> Tensor:
        return torch.stack([receiver, sender])

    def energy(self, positions: Tensor, vectors: Tensor, species: Tensor, edge_index: Tensor,
               per_atom: bool) -> tuple[Tensor, Tensor | None]:
        # nequip: edge_index[0] is the centre, vector = pos[index[1]] - pos[index[0]]. Our list holds every pair
        # in both directions, so (receiver -> sender, -vector) is the same edge set with the centres already
        # sorted, as the fused convolution's CSR order wants.
        data = {"pos": positions, "atom_types": species, "edge_index": edge_index, "edge_vectors": -vectors}
        # calling the inner energy model skips the GraphModel's pre-hook that empties the per-call graph cache
        for hook in forward_pre_hooks(self.model):
            if isinstance(hook, CallGraphCache):
                hook.clear()
        out = self.energy_model(data)
        atomic = out.get("atomic_energy")  # its plain sum: nequip's total is a scatter (atomics on CUDA)
        energy = out["total_energy"].sum() if atomic is None else atomic.sum()
        return energy, atomic.reshape(-1) if per_atom and atomic is not None else None

    def inert_beyond_cutoff(self) -> str | None:
        return inert_beyond_cutoff(self.energy_model)

    def stored_edge_bytes(self, n_atoms: int | None = None) -> int:
        """Peak bytes per edge of a stored-path force call, as ``MaceAdapter``'s (NequIP has no row chunks)."""
        itemsize = torch.finfo(self.dtype).bits // 8
        layers = streaming.streaming_layers(self.energy_model)
        fused = fused_edge_bytes(radial_table.radial_tables(self.energy_model), len(layers), itemsize)
        return fused if fused is not None else int(2.3 * itemsize * sum(m.tp_scatter.conv.weight_numel for m in layers))

    def set_streaming(self, budget_bytes: int | None) -> int:
        """Stream every layer that can, chunks sized to ``budget_bytes`` (None: stop); how many stream."""
        if budget_bytes is None or not streaming.streaming_layers(self.energy_model):
            streaming.set_streaming(self.energy_model, None)
            return 0
        chunk = streaming.chunk_edges_for(self.energy_model, budget_bytes, self.dtype)
        return streaming.set_streaming(self.energy_model, chunk)

    def set_row_chunks(self, n_atoms: int | None) -> bool:
        """NequIP's convolution outputs are as narrow as its features: nothing to chunk."""
        return False

    def message_layers(self) -> list[torch.nn.Module]:
        return [m for m in self.energy_model.modules() if type(m).__name__ == "ConvNetLayer"]

    def why_not_tabulated(self) -> str | None:
        return radial_table.why_not_tabulated(self.energy_model)

    def set_radial_table(self, on: bool) -> list[tuple[int, float]]:
        """Tabulate every block's weights as functions of the edge length (``patches.nequip.radial_table``), or
        stop; the (intervals, measured relative error) of each table in use."""
        radial_table.set_radial_table(self.energy_model, on)
        return [(t.table_coeffs.shape[0], max(t.value_error, t.slope_error))
                for t in radial_table.radial_tables(self.energy_model)]


def message_hops(energy_model: torch.nn.Module) -> int:
    """Message-passing layers of a NequIP energy model (its ``ConvNetLayer`` children): an atom's energy depends on
    the atoms within this many cutoffs. At least 1 (a pair term alone reaches one cutoff)."""
    return max(1, sum(class_name(original(m)).endswith("ConvNetLayer") for m in energy_model.children()))


def energy_model_of(model: torch.nn.Module) -> torch.nn.Module:
    """The energy model inside nequip's ForceStressOutput (matched by class name: packaged classes differ)."""
    inner = getattr(model, "model", None)
    if inner is not None and type(inner).__name__ == "ForceStressOutput" and hasattr(inner, "func"):
        return inner.func
    raise ValueError(f"model: expected a nequip GraphModel wrapping a ForceStressOutput energy model, found "
                     f"{type(inner).__name__ if inner is not None else 'no .model'}; cgforge's calculator "
                     "differentiates the energy itself")


def inert_beyond_cutoff(energy_model: torch.nn.Module) -> str | None:
    """The same for a NequIP energy model (the SequentialGraphNetwork inside ForceStressOutput)."""
    if type(energy_model).__name__ != "SequentialGraphNetwork":
        return f"energy model {type(energy_model).__name__} is not a nequip SequentialGraphNetwork"
    for name, module in energy_model.named_children():
        module = original(module)  # the encoding and factor a tabulated model's stand-ins hold
        cls = type(module).__name__
        if cls in NODE_MODULES:
            continue
        if cls in CUTOFF_MODULES:
            if class_name(getattr(module, "cutoff", None)) != "PolynomialCutoff":
                return f"{name} ({cls}): its cutoff is not nequip's PolynomialCutoff"
            continue
        if cls == "ConvNetLayer":
            conv = getattr(module, "conv", None)
            if type(conv).__name__ != "InteractionBlock":
                return f"{name}.conv ({type(conv).__name__}) is not nequip's InteractionBlock"
            mlp = original(conv.edge_mlp)  # the MLP a streaming or tabulated layer holds (a table clamps to W(x = 1))
            if not vanishes_at_zero(mlp, int(mlp.dims[0])):
                return f"{name}.conv.edge_mlp is not zero for zero edge features (bias or activation)"
            continue
        return f"{name} ({cls}) is not a module cgforge has checked"
    return None
