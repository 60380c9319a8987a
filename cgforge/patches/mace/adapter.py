"""The calculator's adapter for MACE models, and whether edges beyond the cutoff are inert.

``MaceAdapter`` calls the model on the dict ``MACE.forward`` takes, every force/stress option off, with
``positions`` = zeros and ``shifts`` = the calculator's edge vectors (MACE's position gathers off the gradient path).
``inert_beyond_cutoff``, read from mace-torch 0.3.16: ``PolynomialCutoff`` (``envelope * (r < r_max)``) multiplies
the radial basis (``apply_cutoff``) or the blocks' weights; zero edge features give weights ``MLP(0)``, zero for a
bias-free MLP whose activation vanishes at 0 (checked). Blocks whose radial MLP reads node features are inert only
without ``apply_cutoff``; ZBL carries the same envelope.
"""

from __future__ import annotations

import numpy as np
import torch
from ase.data import chemical_symbols
from torch import Tensor

from ..common import check_numbers, unknown_elements, vanishes_at_zero
from ..radial_table import fused_edge_bytes
from ..streaming import Deferred
from . import lean_forward, radial_table, row_chunks, streaming
from .patch import SUPPORTED_INTERACTIONS

_MODELS = ("MACE", "ScaleShiftMACE")
# Their radial MLP input mixes in node features: not zero for an edge with zero edge features.
_BLOCKS_NEEDING_CUTOFF_WEIGHTS = ("RealAgnosticAttResidualInteractionBlock",
                                  "RealAgnosticResidualNonLinearInteractionBlock")


class MaceAdapter:
    kind = "mace"
    sender_row = 0

    def __init__(self, model: torch.nn.Module, device: torch.device, head: str | None = None) -> None:
        self.model = model
        self.device = device
        self.dtype = next(model.parameters()).dtype
        self.cutoff = float(model.r_max)
        self.hops = len(model.interactions)  # an atom's energy depends on the atoms within hops x cutoff
        elements = [int(z) for z in model.atomic_numbers.tolist()]
        self.elements = elements
        self.n_species = len(elements)
        table = np.full(max(elements + [118]) + 1, -1, dtype=np.int64)
        table[elements] = np.arange(len(elements))
        self._table = table
        heads = list(getattr(model, "heads", None) or ["Default"])
        self.head = choose_head(heads, head)
        self._head_index_int = heads.index(self.head)
        self._head_index = torch.tensor([self._head_index_int], device=device)
        # MACE's forward for one structure and head, where the model is one it handles (``lean_forward``)
        self.lean = lean_forward.why_not_lean(model) is None
        self._per_size: dict[int, tuple[Tensor, Tensor]] = {}

    def species(self, numbers: np.ndarray) -> Tensor:
        numbers = check_numbers(numbers)
        inside = (numbers >= 0) & (numbers < len(self._table))
        index = np.where(inside, self._table[np.clip(numbers, 0, len(self._table) - 1)], -1)
        if (index < 0).any():
            raise unknown_elements(numbers, index >= 0, [chemical_symbols[z] for z in self.elements])
        return self._one_hot(torch.as_tensor(index, device=self.device))

    def warmup_species(self, n: int) -> Tensor:
        return self._one_hot(torch.arange(n, device=self.device) % self.n_species)

    def species_index(self, species: Tensor) -> Tensor:
        return species.argmax(dim=1)

    def species_from_index(self, index: Tensor) -> Tensor:
        return self._one_hot(index.to(device=self.device, dtype=torch.int64))

    def _one_hot(self, index: Tensor) -> Tensor:
        return torch.nn.functional.one_hot(index, self.n_species).to(self.dtype)

    def _per_structure(self, n_atoms: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        # One structure: batch all zeros, ptr [0, N], zero positions and cell. Cached per size: no allocation
        # per step (and fixed addresses for a captured step). Under torch.compile they are made in the graph
        # (constants to Inductor): filling the cache there would change what the graph's guards saw.
        compiling = torch.compiler.is_compiling()
        if compiling or n_atoms not in self._per_size:
            kw, real = {"dtype": torch.int64, "device": self.device}, {"dtype": self.dtype, "device": self.device}
            made = (torch.zeros(n_atoms, **kw), torch.arange(2, **kw) * n_atoms, torch.zeros(n_atoms, 3, **real),
                    torch.zeros(3, 3, **real))
            if compiling:
                return made
            self._per_size = {n_atoms: made}
        return self._per_size[n_atoms]

    def edge_index(self, sender: Tensor, receiver: Tensor) -> Tensor:
        return torch.stack([sender, receiver])

    def energy(self, positions: Tensor, vectors: Tensor, species: Tensor, edge_index: Tensor,
               per_atom: bool) -> tuple[Tensor, Tensor | None]:
        if self.lean:  # the total as a plain sum of the per-atom energies (below)
            node_energy = lean_forward.node_energies(self.model, species, vectors, edge_index,
                                                     self._head_index_int, self._head_index.expand(len(species)))
            return node_energy.sum(), node_energy if per_atom else None
        batch, ptr, zeros, cell = self._per_structure(positions.shape[0])
        # MACE sets requires_grad on data["positions"] and gathers it per edge; zeros (a leaf that no
        # gradient is asked of) keep that gather off the backward. vectors = 0 - 0 + shifts, exactly.
        data = {"positions": zeros, "node_attrs": species, "edge_index": edge_index, "shifts": vectors,
                "unit_shifts": cell[0].expand(vectors.shape[0], 3),  # read only for MACE's own stress: not asked
                "cell": cell, "batch": batch, "ptr": ptr, "head": self._head_index}
        out = self.model(data, training=False, compute_force=False, compute_virials=False,
                         compute_stress=False, compute_displacement=False)
        # The total as a plain sum of the per-atom energies: MACE's own total is a scatter_sum over `batch` (atomics
        # on CUDA), whose last bits change from run to run; torch.sum reduces in a fixed order.
        node_energy = out.get("node_energy")
        energy = out["energy"].sum() if node_energy is None else node_energy.sum()
        return energy, node_energy if per_atom else None

    def inert_beyond_cutoff(self) -> str | None:
        return inert_beyond_cutoff(self.model)

    def stored_edge_bytes(self, n_atoms: int | None = None) -> int:
        """Peak bytes per edge of a stored-path force call, for choosing streaming: every layer's weight rows
        about 2.3 times (weights, their gradient, the MLP's activations; docs/measured-constants.md); with
        every block's table read inside its convolution, ``patches.radial_table.FUSED_EDGE_ITEMS``, or
        ``row_chunks.ROW_CHUNKED_EDGE_ITEMS`` where ``n_atoms`` atoms make their rows in chunks."""
        itemsize = torch.finfo(self.dtype).bits // 8
        blocks = streaming.streaming_blocks(self.model)
        fused = fused_edge_bytes(radial_table.radial_tables(self.model), len(self.model.interactions), itemsize)
        if fused is None:
            return int(2.3 * itemsize * sum(b.conv_tp.weight_numel for b in blocks))
        if n_atoms is not None and row_chunks.chunk_rows_for(self.model, n_atoms, self.dtype) is not None:
            return row_chunks.ROW_CHUNKED_EDGE_ITEMS * itemsize
        return fused

    def set_streaming(self, budget_bytes: int | None) -> int:
        """Stream the edges of every layer that can, in chunks sized to ``budget_bytes`` (None: stop).
        Returns the number of streaming layers (0 when the model has none that can)."""
        if budget_bytes is None or not streaming.streaming_blocks(self.model):
            streaming.set_streaming(self.model, None)
            return 0
        return streaming.set_streaming(self.model, streaming.chunk_edges_for(self.model, budget_bytes, self.dtype))

    def set_row_chunks(self, n_atoms: int | None) -> bool:
        """The blocks' convolution rows and linear in chunks where ``n_atoms`` need it (``mace.row_chunks``)."""
        rows = None if n_atoms is None else row_chunks.chunk_rows_for(self.model, n_atoms, self.dtype)
        return row_chunks.set_row_chunks(self.model, rows)

    def message_layers(self) -> list[torch.nn.Module]:
        return list(self.model.interactions)

    def why_not_tabulated(self) -> str | None:
        return radial_table.why_not_tabulated(self.model)

    def set_radial_table(self, on: bool) -> list[tuple[int, float]]:
        """Tabulate every block's weights as functions of r (``patches.mace.radial_table``), or stop; the
        (intervals, measured relative error) of each table in use."""
        radial_table.set_radial_table(self.model, on)
        return [(t.table_coeffs.shape[0], max(t.value_error, t.slope_error))
                for t in radial_table.radial_tables(self.model)]


def choose_head(heads: list[str], head: str | None) -> str:
    if head is not None:
        if head not in heads:
            raise ValueError(f"head: {head!r} is not a head of this model; it has {heads}")
        return head
    if len(heads) == 1:
        return heads[0]
    default = [h for h in heads if h.lower() == "default"]
    if default:
        return default[0]
    raise ValueError(f"head: this model has several heads {heads}; pass head=... to choose one")


def inert_beyond_cutoff(model: torch.nn.Module) -> str | None:
    """None if every edge at or beyond ``model.r_max`` contributes exactly zero, else the reason it may not."""
    cls = type(model)
    if cls.__module__ != "mace.modules.models" or cls.__name__ not in _MODELS:
        return f"MACE model class {cls.__name__} is not one cgforge has checked ({', '.join(_MODELS)})"
    radial = getattr(model, "radial_embedding", None)
    radial = radial.module if isinstance(radial, Deferred) else radial  # the block a streaming model defers
    if type(radial).__name__ != "RadialEmbeddingBlock":
        return f"radial embedding {type(radial).__name__} is not mace's RadialEmbeddingBlock"
    cutoff_fn = getattr(radial, "cutoff_fn", None)
    if type(cutoff_fn).__name__ != "PolynomialCutoff":
        return f"radial cutoff {type(cutoff_fn).__name__} is not mace's PolynomialCutoff"
    if float(cutoff_fn.r_max) > float(model.r_max):
        return f"radial cutoff r_max {float(cutoff_fn.r_max)} exceeds the model's r_max {float(model.r_max)}"
    weights_cut = not getattr(radial, "apply_cutoff", True)  # the blocks multiply their weights by the cutoff
    for i, block in enumerate(model.interactions):
        name = type(block).__name__
        if name not in SUPPORTED_INTERACTIONS:
            return f"interactions.{i}: {name} is not a block cgforge has checked"
        if weights_cut:
            continue
        if name in _BLOCKS_NEEDING_CUTOFF_WEIGHTS:
            return (f"interactions.{i}: {name} feeds node features to its radial MLP; with apply_cutoff=True an "
                    "edge beyond the cutoff still gets nonzero weights")
        for attr in ("conv_tp_weights", "density_fn"):
            mlp = getattr(block, attr, None)
            mlp = mlp.module if isinstance(mlp, Deferred) else mlp  # the MLP a streaming or tabulated block holds
            if mlp is not None and not vanishes_at_zero(mlp, int(mlp.hs[0])):
                return f"interactions.{i}.{attr} is not zero for zero edge features (bias or activation)"
    if hasattr(model, "pair_repulsion"):
        if type(getattr(model, "pair_repulsion_fn", None)).__name__ != "ZBLBasis":
            return "pair repulsion is not mace's ZBLBasis"
    return None
