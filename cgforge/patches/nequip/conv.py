"""NequIP's convolution and cgforge's stand-in for it.

Every NequIP convolution is a ``TensorProductScatter``, ``scatter(tp(x[edge_src], edge_attr, edge_weight),
edge_dst)`` with ``tp`` an e3nn "uvu" ``TensorProduct``: cgforge's ``Convolution`` with sender ``edge_src``,
receiver ``edge_dst``. Modules are matched by class name and structure (packages carry their own classes).
"""

from __future__ import annotations

import inspect

import torch

from cgforge import kernels

from ..common import UnsupportedModelError
from ..graph_cache import CallGraphCache
from ..radial_table import TableWeights
from ..recognise import plain_module_name
from ..stand_in import StandIn, convolution_check
from ..streaming import DeferredWeights, stream
from ..torch_internals import state_without

try:
    from nequip.nn._tp_scatter_base import TensorProductScatter
except ImportError as _err:  # pragma: no cover - depends on the environment
    raise ImportError("cgforge's NequIP adapter needs nequip >= 0.19 (pip install 'cgforge[nequip]')") from _err

_SCATTER_MODULE = "nequip.nn._tp_scatter_base"
_SCATTER_CLASS = "TensorProductScatter"
_SCATTER_ARGS = ("self", "x", "edge_attr", "edge_weight", "edge_dst", "edge_src")
_E3NN_TP_MODULE = "e3nn.o3._tensor_product._tensor_product"


def _is_scatter_class(cls: type) -> bool:
    return cls.__name__ == _SCATTER_CLASS and plain_module_name(cls.__module__) == _SCATTER_MODULE


def _check_scatter(where: str, module: torch.nn.Module) -> None:
    """Structure of nequip 0.19's TensorProductScatter, so a look-alike is not replaced blindly."""
    cls = type(module)
    params = tuple(inspect.signature(cls.forward).parameters)
    if params != _SCATTER_ARGS:
        raise UnsupportedModelError(f"{where}: {cls.__module__}.{cls.__qualname__}.forward takes {params}, expected "
                                    f"{_SCATTER_ARGS} (nequip 0.19's TensorProductScatter)")
    for attr in ("feature_irreps_in", "irreps_edge_attr", "irreps_mid", "instructions", "model_dtype", "tp"):
        if not hasattr(module, attr):
            raise UnsupportedModelError(f"{where}: TensorProductScatter without .{attr}: unknown nequip version")
    tp = module.tp
    tp_cls = type(tp)
    if tp_cls.__name__ != "TensorProduct" or plain_module_name(tp_cls.__module__) != _E3NN_TP_MODULE:
        raise UnsupportedModelError(f"{where}.tp: expected an e3nn TensorProduct, got "
                                    f"{tp_cls.__module__}.{tp_cls.__qualname__}")
    if tp.internal_weights or tp.shared_weights:
        raise UnsupportedModelError(f"{where}.tp: expected per-edge weights (shared_weights=False, "
                                    "internal_weights=False)")
    if module.model_dtype not in (torch.float32, torch.float64):
        raise UnsupportedModelError(f"{where}: model_dtype {module.model_dtype}; cgforge supports float32/64")


def scatter_sites(root: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str, torch.nn.Module]]:
    """(path, parent, attribute, module) of every NequIP convolution under ``root``, all checked."""
    sites = []
    for parent_name, parent in root.named_modules():
        for name, child in parent.named_children():
            where = f"{parent_name}.{name}" if parent_name else name
            if isinstance(child, CgforgeTensorProductScatter):
                sites.append((where, parent, name, child))
            elif _is_scatter_class(type(child)):  # the installed nequip's or a package's
                _check_scatter(where, child)
                sites.append((where, parent, name, child))
            elif any(_is_scatter_class(base) for base in type(child).__mro__[1:]):  # OpenEquivariance, cuEquivariance
                raise UnsupportedModelError(f"{where}: already uses another convolution ({type(child).__qualname__}); "
                                            "load the model without that modifier (enable_OpenEquivariance/"
                                            "enable_CuEquivariance) to use cgforge")
    return sites


class CgforgeTensorProductScatter(TensorProductScatter, StandIn):
    """nequip's TensorProductScatter running cgforge's fused ``Convolution``.

    Keeps the original ``tp`` as a submodule (the same state_dict) and the original module (not a submodule) for
    ``unpatch``. The kernel module is rebuilt from ``tp`` when unpickled, not pickled (a package's ``tp`` is of the
    package's own e3nn)."""

    reads_tables = True  # takes TableWeights: the block's radial table, read inside the kernels

    tuning: kernels.TPTuning | None = None  # a class default: modules pickled before tuning existed have none

    def __init__(self, original: torch.nn.Module, graphs: CallGraphCache,
                 tuning: kernels.TPTuning | None = None) -> None:
        torch.nn.Module.__init__(self)  # not TensorProductScatter.__init__: it would build a second e3nn TP
        for name in ("feature_irreps_in", "irreps_edge_attr", "irreps_mid", "instructions", "model_dtype", "tp"):
            setattr(self, name, getattr(original, name))
        self.tuning = tuning
        self.conv = _convolution(original.tp, tuning)
        self.graphs = graphs
        self.chunk_edges: int | None = None  # edges per chunk while streaming (streaming.set_streaming)
        self.original = (original,)

    def forward(self, x: torch.Tensor, edge_attr: torch.Tensor, edge_weight: torch.Tensor, edge_dst: torch.Tensor,
                edge_src: torch.Tensor) -> torch.Tensor:
        graph = self.graphs.get(edge_src, edge_dst, x.shape[0])
        dtype = self.model_dtype  # explicit casts as nequip's other accelerations do (AMP)
        if isinstance(edge_weight, TableWeights):  # the block's radial table of x = r / r_max, read in the kernels
            return self.conv.forward_table(x.to(dtype).contiguous(), edge_attr.to(dtype).contiguous(),
                                           edge_weight.lengths, edge_weight.coeffs, edge_weight.r_max, graph)
        if isinstance(edge_weight, DeferredWeights):  # streaming: the edge MLP runs per chunk of edges
            return stream(self.conv, x.to(dtype).contiguous(), edge_attr.to(dtype), edge_weight, graph,
                          self.chunk_edges)
        return self.conv(x.to(dtype).contiguous(), edge_attr.to(dtype).contiguous(), edge_weight.to(dtype).contiguous(),
                         graph)

    def __getstate__(self) -> dict:
        return state_without(self, "conv")

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.conv = _convolution(self.tp, self.tuning)

    def check_placement(self) -> tuple[torch.device, torch.dtype]:
        return super().check_placement()[0], self.model_dtype

    def self_check(self, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return convolution_check(self, generator, self.conv, self.tp)

    def extra_repr(self) -> str:
        return f"cgforge: {self.tp.irreps_in1} x {self.tp.irreps_in2} -> {self.tp.irreps_out}"


def _convolution(tp: torch.nn.Module, tuning: kernels.TPTuning | None = None) -> kernels.Convolution:
    conv = kernels.Convolution.from_e3nn(tp, tuning)
    if conv.weight_numel != tp.weight_numel:
        raise UnsupportedModelError(f"cgforge Convolution has weight_numel {conv.weight_numel}, the e3nn "
                                    f"TensorProduct {tp.weight_numel}")
    return conv
