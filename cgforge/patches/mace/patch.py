"""Put cgforge's fused convolution into MACE models (mace-torch 0.3.x).

A block with a ``conv_fusion`` attribute calls ``conv_tp(node_feats, edge_attrs, tp_weights, edge_index)`` and
expects the messages summed per receiver: patching sets it and swaps ``conv_tp`` for a ``FusedConvTP``; the
contractions, linears, radial MLPs, ``skip_tp`` and ``reshape_irreps`` get stand-ins too (``stand_in``).
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

import torch
from e3nn import o3

from cgforge import kernels

from .. import e3nn_layers, species_linear, stand_in
from ..common import UnsupportedModelError, parse_device, parse_dtype, verify_checksums
from ..graph_cache import CallGraphCache
from ..harmonics import KernelHarmonics, is_e3nn_harmonics
from ..harmonics import stand_in_for as harmonics_stand_in
from ..radial_table import TableWeights
from ..recognise import is_mace_model
from ..stand_in import StandIn, convolution_check
from ..streaming import DeferredWeights, stream
from ..torch_internals import adopt, remove_forward_pre_hooks
from . import legacy as mace_legacy
from . import reshape
from .radial_table import set_radial_table
from .row_chunks import set_row_chunks
from .streaming import mark_linear_applied, set_streaming
from .symmetric_contraction import SymmetricContraction

log = logging.getLogger(__name__)

# Interaction blocks of mace-torch 0.3.16 whose forward has the conv_fusion branch.
SUPPORTED_INTERACTIONS = tuple(f"RealAgnostic{kind}InteractionBlock" for kind in (
    "", "Residual", "Density", "DensityResidual", "AttResidual", "ResidualNonLinear"))
_FUSION_TAG = "cgforge"


class GraphCache(CallGraphCache):
    """MACE's per-call graph: every interaction block gets the same ``edge_index`` tensor."""

    def get(self, edge_index: torch.Tensor, num_nodes: int) -> Any:  # type: ignore[override]
        return super().get(edge_index[0], edge_index[1], num_nodes)


class FusedConvTP(torch.nn.Module, StandIn):
    """MACE's ``conv_tp`` with the conv_fusion call signature, backed by ``cgforge.kernels.Convolution``."""

    streams_edges = True  # mace/streaming.streaming_blocks asks this rather than importing the class

    reads_tables = True  # takes TableWeights: the block's radial table, read inside the kernels
    row_chunk: int | None = None  # a class default too: models pickled before the attribute existed read it
    rows = kernels.RowPolicy()  # when the rows go in chunks (row_chunks.chunk_rows_for); likewise a class default

    def __init__(self, e3nn_tp: o3.TensorProduct, graphs: GraphCache, tuning: kernels.TPTuning | None = None,
                 rows: kernels.RowPolicy = rows) -> None:
        super().__init__()
        self.conv = kernels.Convolution.from_e3nn(e3nn_tp, tuning=tuning)
        self.rows = rows
        if self.conv.weight_numel != e3nn_tp.weight_numel:
            raise UnsupportedModelError(
                f"cgforge Convolution has weight_numel {self.conv.weight_numel}, the e3nn TensorProduct "
                f"{e3nn_tp.weight_numel}"
            )
        for name in ("weight_numel", "irreps_in1", "irreps_in2", "irreps_out", "instructions", "shared_weights",
                     "internal_weights"):
            setattr(self, name, getattr(e3nn_tp, name))
        # Adopt the e3nn module's buffers and its (weightless) generated submodules under the same names:
        # the state_dict keeps exactly the keys, order and values of the TensorProduct it replaces.
        if any(True for _ in e3nn_tp.parameters()):
            raise UnsupportedModelError("conv_tp has parameters; MACE passes its weights per edge")
        adopt(self, e3nn_tp, children=True)
        self.graphs = graphs
        self.chunk_edges: int | None = None  # edges per chunk while streaming (streaming.set_streaming)
        # While streaming: the block's next linear layer, applied per chunk inside the convolution (a tuple:
        # not a submodule, so the state_dict is unchanged; streaming.set_streaming sets it)
        self.fused_linear: tuple[torch.nn.Module, ...] = ()
        # Stored path, table read in the kernels, with the linear fused: rows per chunk (row_chunks.set_row_chunks)
        self.row_chunk: int | None = None
        # A tuple, so not a submodule again; shares the adopted submodules, which .to() moves in place.
        self.original = (e3nn_tp,)

    def forward(self, node_feats: torch.Tensor, edge_attrs: torch.Tensor, tp_weights: torch.Tensor,
                edge_index: torch.Tensor) -> torch.Tensor:
        graph = self.graphs.get(edge_index, node_feats.shape[0])
        # the block's next linear when this convolution applies it (streaming, row chunks): the result is tagged
        linear = self.fused_linear[0] if self.fused_linear else None
        if isinstance(tp_weights, TableWeights):  # the block's radial table, read inside the kernels
            args = (node_feats.contiguous(), edge_attrs.contiguous(), tp_weights.lengths, tp_weights.coeffs,
                    tp_weights.r_max, graph)
            if linear is not None and self.row_chunk is not None and graph.deterministic and not (
                    torch.is_grad_enabled() and any(p.requires_grad for p in linear.parameters())):
                # (a trained linear's gradient needs its whole input: whole rows then)
                out = self.conv.forward_table_rows(*args, linear, self.row_chunk)
            else:
                out = self.conv.forward_table(*args)
                out = out if linear is None else linear(out)
        elif isinstance(tp_weights, DeferredWeights):  # streaming: the radial MLP runs per chunk of edges
            out = stream(self.conv, node_feats.contiguous(), edge_attrs, tp_weights, graph, self.chunk_edges,
                         out_fn=linear)
        else:  # the attention block passes a column slice of a wider tensor; the kernels need dense rows
            out = self.conv(node_feats.contiguous(), edge_attrs.contiguous(), tp_weights.contiguous(), graph)
            out = out if linear is None else linear(out)
        return out if linear is None else mark_linear_applied(out, linear)

    def self_check(self, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return convolution_check(self, generator, self.conv, self.original[0])

    def extra_repr(self) -> str:
        return f"{self.irreps_in1} x {self.irreps_in2} -> {self.irreps_out}, weight_numel={self.weight_numel}"


class FusedSymmetricContraction(SymmetricContraction, StandIn):
    """MACE's product-basis ``SymmetricContraction`` on cgforge's kernels, holding the original's parameters and
    buffers under their names (``SymmetricContraction.from_mace``)."""

    @classmethod
    def wrap(cls, original: torch.nn.Module, tuning: kernels.SCTuning | None = None) -> FusedSymmetricContraction:
        fused = cls.from_mace(original, tuning)
        fused.original = (original,)
        return fused

    def self_check(self, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.problem
        x = self.random(generator, 5, p.channels, p.in_dim)
        species = torch.arange(5, device=x.device) % p.num_elements
        one_hot = torch.nn.functional.one_hot(species, p.num_elements).to(x.dtype)  # MACE's node_attrs
        return self(x, species), self.original[0](x, one_hot)


def _describe(obj: Any) -> str:
    cls = type(obj)
    if isinstance(obj, dict):
        keys = ", ".join(sorted(map(str, obj))[:6])
        return f"a dict with keys [{keys}] (a state_dict or training checkpoint, not a whole model)"
    return f"{cls.__module__}.{cls.__qualname__}"


def interaction_blocks(model: Any) -> list[torch.nn.Module]:
    """The model's interaction blocks, after checking that every one can be patched."""
    if not is_mace_model(model):
        raise TypeError(f"model: expected a MACE model (a mace.modules.models class with .interactions), got "
                        f"{_describe(model)}")
    blocks = list(model.interactions)
    for i, block in enumerate(blocks):
        _check_block(f"interactions.{i}", block)
    return blocks


def _check_block(where: str, block: torch.nn.Module) -> None:
    cls = type(block)
    name = f"{cls.__module__}.{cls.__qualname__}"
    if cls.__module__ != "mace.modules.blocks" or cls.__name__ not in SUPPORTED_INTERACTIONS:
        raise UnsupportedModelError(f"{where}: interaction block {name} is not supported by cgforge "
                                    f"(supported: {', '.join(SUPPORTED_INTERACTIONS)})")
    tp = getattr(block, "conv_tp", None)
    if isinstance(tp, FusedConvTP):
        return
    if hasattr(block, "conv_fusion"):
        raise UnsupportedModelError(
            f"{where}: {cls.__name__} already uses another fused convolution ({type(tp).__qualname__}, "
            f"conv_fusion={block.conv_fusion!r}); convert the model back to e3nn first "
            "(mace.cli.convert_cueq_e3nn / convert_oeq_e3nn)"
        )
    if type(tp) is not o3.TensorProduct:
        raise UnsupportedModelError(f"{where}.conv_tp: expected an e3nn o3.TensorProduct, got {_describe(tp)} "
                                    "(cuEquivariance/OpenEquivariance models: convert back to e3nn first)")
    if tp.internal_weights or tp.shared_weights:
        raise UnsupportedModelError(f"{where}.conv_tp: expected per-edge weights (shared_weights=False, "
                                    "internal_weights=False)")


def patch(model: torch.nn.Module, *, tuning: kernels.KernelTuning | None = None) -> torch.nn.Module:
    """Swap every interaction block's convolution (and the other stand-ins) in, in place, idempotent (blocks patched
    before keep their ``tuning``). ``UnsupportedModelError`` names the first unsupported block (model untouched)."""
    blocks = interaction_blocks(model)
    graphs = _graph_cache(model) or GraphCache()
    tuning = tuning if tuning is not None else kernels.KernelTuning()
    fused = stand_in.swap_in(model, _fused_maker(graphs, tuning))  # raises before any change: model untouched
    for block in blocks:
        if isinstance(block.conv_tp, FusedConvTP):
            block.conv_fusion = _FUSION_TAG
            block.conv_tp.graphs = graphs  # one cache per model, also after copy.deepcopy of a block
    layers = e3nn_layers.swap_in(model, tuning.linear_kernel_max_channels, tuning.rows)
    layers += species_linear.swap_in(model, "skip_tp", graphs, tuning.linear_kernel_max_channels)
    layers += reshape.swap_in(model)
    graphs.install(model)
    if fused:
        log.info("cgforge: patched %d MACE convolutions and product blocks and %d e3nn layers", len(fused), layers)
    return model


def _fused_maker(graphs: GraphCache, tuning: kernels.KernelTuning) -> stand_in.Maker:
    """The walker's maker of the fused convolutions (``interactions.i.conv_tp``), symmetric contractions
    (``products.i.symmetric_contractions``) and, with ``tuning.harmonics``, the edge harmonics
    (``spherical_harmonics``); raises ``UnsupportedModelError`` for one cgforge cannot build."""

    def make(where: str, child: torch.nn.Module) -> StandIn | None:
        if where == "spherical_harmonics" and tuning.harmonics and is_e3nn_harmonics(child):
            return harmonics_stand_in(where, child)
        parent, _, name = where.rpartition(".")
        kind, _, index = parent.partition(".")
        if not index.isdigit():  # only the direct children of interactions[i] and products[i]
            return None
        if kind == "interactions" and name == "conv_tp" and not isinstance(child, FusedConvTP):
            try:
                return FusedConvTP(child, graphs, tuning.tp, tuning.rows)
            except (ValueError, TypeError, NotImplementedError) as err:
                raise UnsupportedModelError(f"{where} ({child}): cgforge cannot build this convolution: {err}") from err
        if kind == "products" and name == "symmetric_contractions" and not isinstance(child, FusedSymmetricContraction):
            cls = type(child)
            if cls.__module__ != "mace.modules.symmetric_contraction" or cls.__name__ != "SymmetricContraction":
                raise UnsupportedModelError(f"{where}: expected mace's SymmetricContraction, got {_describe(child)} "
                                            "(cuEquivariance/OpenEquivariance models: convert back to e3nn first)")
            try:
                return FusedSymmetricContraction.wrap(child, tuning.sc)
            except (ValueError, TypeError, RuntimeError, NotImplementedError) as err:
                raise UnsupportedModelError(f"{where}: cgforge cannot build this contraction: {err}") from err
        return None

    return make


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Turn a patched model back into a plain MACE model (no cgforge objects left). In place."""
    if not is_mace_model(model):
        raise TypeError(f"model: expected a MACE model, got {_describe(model)}")
    blocks = list(model.interactions)
    for i, block in enumerate(blocks):
        if isinstance(getattr(block, "conv_tp", None), FusedConvTP) and block.conv_fusion != _FUSION_TAG:
            raise UnsupportedModelError(f"interactions.{i}: conv_fusion={block.conv_fusion!r} was not set by cgforge")
    set_row_chunks(model, None)
    set_streaming(model, None)
    set_radial_table(model, False)
    stand_in.swap_out(model, (FusedConvTP, FusedSymmetricContraction, KernelHarmonics))
    for block in blocks:
        if getattr(block, "conv_fusion", None) == _FUSION_TAG:
            del block.conv_fusion
    e3nn_layers.swap_out(model)
    species_linear.swap_out(model)
    reshape.swap_out(model)
    remove_forward_pre_hooks(model, GraphCache)
    return model


def is_patched(model: torch.nn.Module) -> bool:
    return is_mace_model(model) and (
        any(isinstance(getattr(b, "conv_tp", None), FusedConvTP) for b in model.interactions)
        or any(isinstance(getattr(b, "symmetric_contractions", None), FusedSymmetricContraction)
               for b in getattr(model, "products", []))
    )


def _graph_cache(model: torch.nn.Module) -> GraphCache | None:
    for block in model.interactions:
        tp = getattr(block, "conv_tp", None)
        if isinstance(tp, FusedConvTP):
            return tp.graphs
    return None


def upgrade_old_attributes(model: torch.nn.Module) -> list[str]:
    """Give models pickled by older mace-torch the buffers 0.3.16 reads (``r_max``, ``atomic_numbers``,
    ``num_interactions`` as tensors, ``heads``). Returns what changed."""
    changed = []
    any_param = next(model.parameters(), None)
    device = any_param.device if any_param is not None else torch.device("cpu")

    def as_buffer(name: str, value: Any, dtype: torch.dtype) -> None:
        if name in model.__dict__:
            del model.__dict__[name]
        model.register_buffer(name, torch.as_tensor(value, dtype=dtype, device=device))
        changed.append(name)

    r_max = getattr(model, "r_max", None)
    if r_max is None and hasattr(model, "radial_embedding"):
        r_max = getattr(model.radial_embedding.cutoff_fn, "r_max", None)
    if r_max is None:
        raise UnsupportedModelError("model has no r_max (neither attribute nor radial cutoff)")
    if not isinstance(r_max, torch.Tensor):
        as_buffer("r_max", float(r_max), torch.float64)
    numbers = getattr(model, "atomic_numbers", None)
    if numbers is None:
        raise UnsupportedModelError("model has no atomic_numbers: cannot tell which elements it knows")
    if not isinstance(numbers, torch.Tensor):
        as_buffer("atomic_numbers", [int(z) for z in numbers], torch.int64)
    n = getattr(model, "num_interactions", None)
    if not isinstance(n, torch.Tensor):
        as_buffer("num_interactions", len(model.interactions) if n is None else int(n), torch.int64)
    if not hasattr(model, "heads"):
        model.heads = ["Default"]
        changed.append("heads")
    if changed:
        warnings.warn(f"MACE model pickled by an older mace-torch: upgraded {', '.join(changed)} in memory "
                      "(save it again to keep the upgrade)", UserWarning, stacklevel=3)
    return changed


def load_mace(path: str | os.PathLike, device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None,
              *, patched: bool = True, tuning: kernels.KernelTuning | None = None) -> torch.nn.Module:
    """Load a MACE ``.model`` (a whole pickled model, mace-torch 0.3.x), patched or plain, on ``device``, in ``dtype``
    (None: the file's); with ``tuning`` a file saved patched is patched again (None: it keeps its kernels)."""
    device = parse_device(device)
    dtype = parse_dtype(dtype)
    if os.path.isfile(path):
        verify_checksums(path)  # torch.load would not notice a damaged weight tensor
    model = mace_legacy.load_pickle(path, map_location="cpu")
    if not is_mace_model(model):
        raise UnsupportedModelError(f"{os.fspath(path)}: expected a whole pickled MACE model (the .model file "
                                    f"mace_run_train writes), found {_describe(model)}")
    upgrade_old_attributes(model)
    if patched:
        if tuning is not None and is_patched(model):
            unpatch(model)
        patch(model, tuning=tuning)
    if dtype is not None:
        model.to(dtype=dtype)
    return model.to(device=device)
