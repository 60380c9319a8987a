"""Put cgforge's fused convolution into NequIP models (nequip >= 0.19).

Every NequIP convolution is a ``nequip.nn._tp_scatter_base.TensorProductScatter``::

    forward(x, edge_attr, edge_weight, edge_dst, edge_src):
        return scatter(tp(x[edge_src], edge_attr, edge_weight), edge_dst, dim_size=len(x))

with ``tp`` an e3nn "uvu" ``TensorProduct`` with per-edge weights. That is exactly cgforge's
``Convolution`` with sender = ``edge_src`` and receiver = ``edge_dst``, so patching swaps each such
module for a ``CgforgeTensorProductScatter`` that keeps the original ``tp`` submodule (state dicts match
both ways) and calls the fused kernel. All layers of one model share one ``ConvGraph`` per call.
Each self-connection ``sc`` (a FullyConnectedTensorProduct with the type embedding) becomes a
``species_linear`` stand-in: one linear map per atom type in cgforge's calculator, e3nn's code otherwise;
e3nn ``Linear`` layers become ``e3nn_layers.SplitLinear`` (same numbers, less autograd traffic), and the
radial MLPs' linear layers ``radial_precision.RadialLinear`` (the same, with an optional TF32 mode).

Three ways in:
- the ``enable_cgforge`` model modifier (registered by ``nequip_modifier`` through nequip's
  ``nequip.extension`` entry point), for nequip configs and tools;
- ``load_nequip(path)`` for ``.ckpt`` and ``.nequip.zip`` files. A packaged model carries its own copies
  of nequip's and e3nn's classes (``<torch_package_0>.nequip...``), which an ``isinstance`` check against
  the installed nequip misses: modules are matched by qualified class name and structure instead, and the
  result is checked against the unpatched model on a small structure;
- ``save_patched_nequip(model_or_path, out)`` writes a patched ``.nequip.zip`` (cgforge is an external
  module of that package, so it loads wherever cgforge is installed). The input is never touched.

nequip's compiled outputs (AOTInductor ``.nequip.pt2``, TorchScript ``.nequip.pth``) cannot call kernels
launched from Python: they are refused with ``CompiledModelError`` naming the supported route.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import re
import tempfile
import zipfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cgforge import kernels

from . import e3nn_layers, radial_precision, species_linear
from .graph_cache import CallGraphCache
from .mace import UnsupportedModelError, parse_device, parse_dtype

try:
    from nequip.nn._tp_scatter_base import TensorProductScatter
except ImportError as _err:  # pragma: no cover - depends on the environment
    raise ImportError(
        "cgforge's NequIP adapter needs nequip >= 0.19 (pip install 'cgforge[nequip]')"
    ) from _err

log = logging.getLogger(__name__)

__all__ = [
    "CgforgeTensorProductScatter",
    "CompiledModelError",
    "UnsupportedModelError",
    "enable_cgforge",
    "is_compiled_nequip_file",
    "is_nequip_file",
    "is_patched",
    "load_nequip",
    "patch",
    "save_patched_nequip",
    "unpatch",
]

CHECKPOINT_SUFFIX = ".ckpt"
PACKAGE_SUFFIX = ".nequip.zip"
COMPILED_SUFFIXES = (".nequip.pt2", ".nequip.pth")
SOLE_MODEL = "sole_model"  # nequip's key for the model of a single-model checkpoint or package

_SCATTER_MODULE = "nequip.nn._tp_scatter_base"
_SCATTER_CLASS = "TensorProductScatter"
_SCATTER_ARGS = ("self", "x", "edge_attr", "edge_weight", "edge_dst", "edge_src")
_E3NN_TP_MODULE = "e3nn.o3._tensor_product._tensor_product"
_PACKAGE_PREFIX = re.compile(r"^<torch_package_\d+>\.")

# Relative error (norm of difference / norm of reference) allowed between patched and unpatched outputs.
_VERIFY_RTOL = {torch.float64: 1e-9, torch.float32: 1e-4}

_SUPPORTED_ROUTE = (
    "cgforge's kernels are launched from Python, so a compiled .nequip.pt2/.nequip.pth cannot hold them. "
    "Run the eager model instead: load the .ckpt or .nequip.zip with cgforge.patches.load(...) or the "
    "cgforge ASE calculator, or write a patched package with `cgforge patch IN OUT.nequip.zip`"
)


class CompiledModelError(ValueError):
    """A compiled NequIP model (or a compile workflow) where cgforge needs an eager one."""


# ---------------------------------------------------------------------------------------------
# Files


def is_nequip_file(path: str | os.PathLike) -> bool:
    """True for a file ``load_nequip`` reads: a ``.ckpt`` or a ``.nequip.zip`` (by name, else by contents).

    Compiled models (``.nequip.pt2``/``.nequip.pth``) are not: see ``is_compiled_nequip_file``.
    """
    name = os.fspath(path).lower()
    if name.endswith(COMPILED_SUFFIXES):
        return False
    if name.endswith((CHECKPOINT_SUFFIX, PACKAGE_SUFFIX)):
        return True
    return _zip_kind(os.fspath(path)) == "package"


def is_compiled_nequip_file(path: str | os.PathLike) -> bool:
    """True for nequip-compile output (AOTInductor ``.nequip.pt2``, TorchScript ``.nequip.pth``)."""
    return os.fspath(path).lower().endswith(COMPILED_SUFFIXES)


def _zip_kind(path: str) -> str | None:
    """ "package" for a nequip package, "torch" for a torch.save zip (a .ckpt), None otherwise."""
    try:
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
    except (zipfile.BadZipFile, OSError):
        return None
    if any(n.endswith("/model/package_metadata.txt") for n in names):
        return "package"
    if any(n.endswith("/data.pkl") for n in names):
        return "torch"
    return None


def _check_input(path: str | os.PathLike) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path: expected a file path (str or os.PathLike), got {type(path).__name__}")
    p = Path(path)
    if is_compiled_nequip_file(p):
        raise CompiledModelError(
            f"{p}: a compiled NequIP model (nequip-compile output): {_SUPPORTED_ROUTE} "
            "(the file it was compiled from)"
        )
    if not p.exists():
        raise FileNotFoundError(f"NequIP model not found: {p}")
    if p.is_dir():
        raise IsADirectoryError(f"path: {p} is a directory, expected a .ckpt or .nequip.zip file")
    name = p.name.lower()
    kind = _zip_kind(str(p))
    if name.endswith(PACKAGE_SUFFIX):
        if kind != "package":
            raise ValueError(
                f"{p}: not a NequIP package (expected a zip with model/package_metadata.txt, as "
                "nequip-package writes)"
            )
    elif name.endswith(CHECKPOINT_SUFFIX):
        if kind == "package":
            raise ValueError(
                f"{p}: this is a NequIP package; give it the {PACKAGE_SUFFIX} suffix nequip needs"
            )
        if kind != "torch" and not _is_legacy_torch_pickle(p):
            raise ValueError(f"{p}: not a torch checkpoint (expected the .ckpt nequip-train writes)")
    else:
        raise ValueError(f"path: {p}: expected a NequIP {CHECKPOINT_SUFFIX} or {PACKAGE_SUFFIX} file")
    return p


def _is_legacy_torch_pickle(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == b"\x80\x02"  # torch's pre-zip format starts with a protocol-2 pickle


# ---------------------------------------------------------------------------------------------
# Recognising NequIP's convolution (installed or packaged class)


def _plain_module_name(name: str) -> str:
    """``<torch_package_3>.nequip.nn.x`` -> ``nequip.nn.x``: where a packaged class came from."""
    return _PACKAGE_PREFIX.sub("", name)


def _is_scatter_class(cls: type) -> bool:
    return cls.__name__ == _SCATTER_CLASS and _plain_module_name(cls.__module__) == _SCATTER_MODULE


def _is_plain_scatter(module: torch.nn.Module) -> bool:
    """The unmodified nequip convolution, from the installed nequip or from a package."""
    return _is_scatter_class(type(module))


def _is_other_scatter(module: torch.nn.Module) -> bool:
    """Another acceleration's subclass (OpenEquivariance, cuEquivariance): not ours to replace."""
    cls = type(module)
    return (
        not _is_scatter_class(cls)
        and not isinstance(module, CgforgeTensorProductScatter)
        and any(_is_scatter_class(base) for base in cls.__mro__[1:])
    )


def _check_scatter(where: str, module: torch.nn.Module) -> None:
    """Structure of nequip 0.19's TensorProductScatter, so a look-alike is not replaced blindly."""
    cls = type(module)
    params = tuple(inspect.signature(cls.forward).parameters)
    if params != _SCATTER_ARGS:
        raise UnsupportedModelError(
            f"{where}: {cls.__module__}.{cls.__qualname__}.forward takes {params}, expected {_SCATTER_ARGS} "
            "(nequip 0.19's TensorProductScatter)"
        )
    for attr in ("feature_irreps_in", "irreps_edge_attr", "irreps_mid", "instructions", "model_dtype", "tp"):
        if not hasattr(module, attr):
            raise UnsupportedModelError(
                f"{where}: TensorProductScatter without .{attr}: unknown nequip version"
            )
    tp = module.tp
    tp_cls = type(tp)
    if tp_cls.__name__ != "TensorProduct" or _plain_module_name(tp_cls.__module__) != _E3NN_TP_MODULE:
        raise UnsupportedModelError(
            f"{where}.tp: expected an e3nn TensorProduct, got {tp_cls.__module__}.{tp_cls.__qualname__}"
        )
    if tp.internal_weights or tp.shared_weights:
        raise UnsupportedModelError(
            f"{where}.tp: expected per-edge weights (shared_weights=False, internal_weights=False)"
        )
    if module.model_dtype not in _VERIFY_RTOL:
        raise UnsupportedModelError(f"{where}: model_dtype {module.model_dtype}; cgforge supports float32/64")


def _scatter_sites(root: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str, torch.nn.Module]]:
    """(path, parent, attribute, module) of every NequIP convolution under ``root``, all checked."""
    sites = []
    for parent_name, parent in root.named_modules():
        for name, child in parent.named_children():
            where = f"{parent_name}.{name}" if parent_name else name
            if isinstance(child, CgforgeTensorProductScatter):
                sites.append((where, parent, name, child))
            elif _is_other_scatter(child):
                cls = type(child)
                raise UnsupportedModelError(
                    f"{where}: already uses another convolution ({cls.__qualname__}); load the model "
                    "without that modifier (enable_OpenEquivariance/enable_CuEquivariance) to use cgforge"
                )
            elif _is_plain_scatter(child):
                _check_scatter(where, child)
                sites.append((where, parent, name, child))
    return sites


# ---------------------------------------------------------------------------------------------
# One graph per model call, shared by the layers





# ---------------------------------------------------------------------------------------------
# The replacement module


class CgforgeTensorProductScatter(TensorProductScatter):
    """nequip's TensorProductScatter running cgforge's fused ``Convolution``.

    Keeps the original ``tp`` (the e3nn TensorProduct and its buffers) as a submodule, so state dicts are
    interchangeable with the plain model, and the original module (not as a submodule) for ``unpatch``.
    The kernel module is rebuilt from ``tp`` when unpickled rather than pickled: a packaged model's ``tp``
    comes from the package's own e3nn, which the kernel's problem description must not be mixed with.
    """

    def __init__(self, original: torch.nn.Module, graphs: CallGraphCache) -> None:
        torch.nn.Module.__init__(self)  # not TensorProductScatter.__init__: it would build a second e3nn TP
        self.feature_irreps_in = original.feature_irreps_in
        self.irreps_edge_attr = original.irreps_edge_attr
        self.irreps_mid = original.irreps_mid
        self.instructions = original.instructions
        self.model_dtype = original.model_dtype
        self.tp = original.tp
        self.conv = _convolution(original.tp)
        self.graphs = graphs
        self.original = (original,)

    def forward(
        self,
        x: torch.Tensor,
        edge_attr: torch.Tensor,
        edge_weight: torch.Tensor,
        edge_dst: torch.Tensor,
        edge_src: torch.Tensor,
    ) -> torch.Tensor:
        graph = self.graphs.get(edge_src, edge_dst, x.shape[0])
        dtype = self.model_dtype  # explicit casts as nequip's other accelerations do (AMP)
        return self.conv(
            x.to(dtype).contiguous(),
            edge_attr.to(dtype).contiguous(),
            edge_weight.to(dtype).contiguous(),
            graph,
        )

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_modules"] = {k: v for k, v in self._modules.items() if k != "conv"}
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.conv = _convolution(self.tp)

    def extra_repr(self) -> str:
        return f"cgforge: {self.tp.irreps_in1} x {self.tp.irreps_in2} -> {self.tp.irreps_out}"


def _convolution(tp: torch.nn.Module) -> kernels.Convolution:
    conv = kernels.Convolution.from_e3nn(tp)
    if conv.weight_numel != tp.weight_numel:
        raise UnsupportedModelError(
            f"cgforge Convolution has weight_numel {conv.weight_numel}, "
            f"the e3nn TensorProduct {tp.weight_numel}"
        )
    return conv


# ---------------------------------------------------------------------------------------------
# Patch / unpatch / the modifier


def _roots(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The models that get called: each entry of nequip's ModuleDict, or the model itself."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a NequIP model (torch.nn.Module), got {type(model).__name__}")
    if isinstance(model, torch.nn.ModuleDict):
        return list(model.values())
    return [model]


def patch(model: torch.nn.Module) -> torch.nn.Module:
    """Swap every NequIP convolution for cgforge's fused one. In place, idempotent; returns ``model``.

    ``model`` is a GraphModel or nequip's ModuleDict of them, from the installed nequip or a package.
    Everything is checked before anything changes: ``UnsupportedModelError`` (a ValueError) names the
    first module cgforge cannot take, and the model is left as it was.
    """
    plans = []
    for root in _roots(model):
        sites = _scatter_sites(root)
        if not sites:
            cls = type(root)
            raise UnsupportedModelError(
                f"model: no NequIP convolution (nequip.nn TensorProductScatter) found in "
                f"{cls.__module__}.{cls.__qualname__}; cgforge patches NequIP GNN models"
            )
        graphs = _graph_cache(root) or CallGraphCache()
        new = {}
        for where, _parent, _name, module in sites:
            if isinstance(module, CgforgeTensorProductScatter):
                continue
            try:
                new[where] = CgforgeTensorProductScatter(module, graphs)
            except (ValueError, TypeError, NotImplementedError) as err:
                raise UnsupportedModelError(
                    f"{where} ({module.tp}): cgforge cannot build this convolution: {err}"
                ) from err
        plans.append((root, sites, graphs, new))
    for root, sites, graphs, new in plans:
        for where, parent, name, module in sites:
            if where in new:
                parent._modules[name] = new[where]
            else:
                module.graphs = graphs
        swapped = species_linear.swap_in(root, "sc", graphs)
        e3nn_layers.swap_in(root)
        radial_precision.swap_in(root, "edge_mlp")
        _install_hook(root, graphs)
        if new:
            log.info("cgforge: patched %d NequIP convolutions and %d self-connections", len(new), swapped)
    return model


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Put the original convolutions back (no cgforge objects left). In place; returns ``model``."""
    for root in _roots(model):
        for _where, parent, name, module in _scatter_sites(root):
            if isinstance(module, CgforgeTensorProductScatter):
                (original,) = module.original
                original.tp = module.tp  # as moved / converted since patching
                parent._modules[name] = original
        species_linear.swap_out(root)
        e3nn_layers.swap_out(root)
        radial_precision.swap_out(root)
        _remove_hooks(root)
    return model


def is_patched(model: torch.nn.Module) -> bool:
    return any(isinstance(m, CgforgeTensorProductScatter) for m in model.modules())


def enable_cgforge(model: torch.nn.Module) -> torch.nn.Module:
    """The body of the ``enable_cgforge`` model modifier: refuse compile workflows, then ``patch``."""
    from nequip.scripts._workflow_utils import get_workflow_state

    if get_workflow_state() == "compile":
        raise CompiledModelError(f"enable_cgforge cannot be used in nequip-compile: {_SUPPORTED_ROUTE}")
    if any(getattr(m, "is_compile_graph_model", False) for m in model.modules()):
        raise CompiledModelError(
            "enable_cgforge: this model is built for train-time torch.compile (compile_mode: compile); "
            "cgforge patches eager models, use compile_mode: eager"
        )
    return patch(model)


def _graph_cache(root: torch.nn.Module) -> CallGraphCache | None:
    for m in root.modules():
        if isinstance(m, CgforgeTensorProductScatter):
            return m.graphs
    return None


def _install_hook(root: torch.nn.Module, graphs: CallGraphCache) -> None:
    if not any(hook is graphs for hook in root._forward_pre_hooks.values()):
        _remove_hooks(root)
        root.register_forward_pre_hook(graphs)


def _remove_hooks(root: torch.nn.Module) -> None:
    for key in [k for k, hook in root._forward_pre_hooks.items() if isinstance(hook, CallGraphCache)]:
        del root._forward_pre_hooks[key]


# ---------------------------------------------------------------------------------------------
# Checking a patched model against the plain one


def probe_structure(model: torch.nn.Module, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """A small non-periodic cluster for ``model`` (every type present, every atom within r_max of the others).

    Returns a nequip AtomicDataDict (positions, atom types, edge_index) on ``device``.
    """
    from nequip.data import AtomicDataDict, compute_neighborlist_, from_dict

    metadata = _metadata(model)
    type_names = metadata["type_names"].split(" ")
    r_max = float(metadata["r_max"])
    n = max(8, len(type_names))
    side = math.ceil(n ** (1 / 3))
    grid = np.stack(np.meshgrid(*[np.arange(side)] * 3, indexing="ij"), -1).reshape(-1, 3)[:n]
    rng = np.random.default_rng(0)
    pos = grid * (0.45 * r_max / max(side - 1, 1)) + rng.normal(scale=0.03 * r_max, size=(n, 3))
    data = from_dict({"pos": pos, "atom_types": np.arange(n, dtype=np.int64) % len(type_names)})
    data = compute_neighborlist_(data, r_max=r_max)
    return AtomicDataDict.to_(data, torch.device(device))


def _metadata(model: torch.nn.Module) -> dict[str, str]:
    try:
        metadata = model.metadata
    except AttributeError:
        metadata = None
    if not isinstance(metadata, dict) or "type_names" not in metadata or "r_max" not in metadata:
        cls = type(model)
        raise UnsupportedModelError(
            f"model: expected a nequip GraphModel (with .metadata type_names and r_max), got "
            f"{cls.__module__}.{cls.__qualname__}"
        )
    return metadata


def _energy_forces(
    model: torch.nn.Module, data: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.enable_grad():
        out = model(dict(data))
    return out["total_energy"].detach(), out["forces"].detach()


def _relative_error(new: torch.Tensor, ref: torch.Tensor) -> float:
    scale = max(float(ref.double().norm()), 1e-30)
    return float((new.double() - ref.double()).norm()) / scale


def verify_patch(model: torch.nn.Module) -> float:
    """Compare ``model`` patched and unpatched on ``probe_structure``; raise if they disagree.

    Works on a patched or plain model (GraphModel) and leaves it patched. Returns the largest relative
    error (energy or forces).
    """
    device = next((t.device for t in model.parameters()), torch.device("cpu"))
    data = probe_structure(model, device)
    if is_patched(model):
        unpatch(model)
    try:
        ref = _energy_forces(model, data)
    except Exception as err:
        raise UnsupportedModelError(
            f"could not run the model on a small test structure to verify the patch ({type(err).__name__}: "
            f"{err}); pass verify=False to skip the check"
        ) from err
    patch(model)
    new = _energy_forces(model, data)
    rtol = _VERIFY_RTOL[model.model_dtype]
    errors = [_relative_error(a, b) for a, b in zip(new, ref)]
    if not all(e <= rtol for e in errors):  # also catches NaN
        unpatch(model)
        raise UnsupportedModelError(
            f"cgforge's convolution changed the model's outputs on a test structure: relative error "
            f"energy {errors[0]:.3g}, forces {errors[1]:.3g} (allowed {rtol:g}); the model was left unpatched"
        )
    return max(errors)


# ---------------------------------------------------------------------------------------------
# Loading


def load_nequip(
    path: str | os.PathLike,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    *,
    model_name: str = SOLE_MODEL,
    verify: bool = True,
    patched: bool = True,
) -> torch.nn.Module:
    """Load a NequIP ``.ckpt`` or ``.nequip.zip`` and return its model patched, in eval mode, on ``device``.

    ``dtype`` None keeps the model's precision; a NequIP model is built for one ``model_dtype``, so asking
    for another raises ``ValueError``. ``model_name`` picks a model of a multi-model file. ``verify``
    compares patched and unpatched energies and forces on a small structure. ``patched=False`` returns the
    model as nequip builds it. The file's zip checksums are checked first (a damaged file raises
    ``ValueError``). Like nequip's own loaders, this initialises nequip's global state (float64 default
    dtype, TF32 off).
    """
    from cgforge.patches import verify_checksums

    p = _check_input(path)
    verify_checksums(p)  # nequip's loaders would not notice a damaged weight tensor
    device = parse_device(device)
    dtype = parse_dtype(dtype)
    if not isinstance(model_name, str):
        raise TypeError(f"model_name: expected a str, got {type(model_name).__name__}")
    models = _load_models(p)
    if model_name not in models:
        raise ValueError(f"model_name: {p} has no model {model_name!r}; it has {sorted(models.keys())}")
    model = models[model_name]
    _check_dtype(model, dtype)
    model.eval()
    model.to(device)
    if not patched:
        return unpatch(model)  # a file written patched (enable_cgforge modifier) holds cgforge layers
    if verify:
        verify_patch(model)
    else:
        patch(model)
    return model


def _load_models(path: Path) -> torch.nn.ModuleDict:
    """nequip's ModuleDict of eager models, unpatched, on the CPU."""
    from nequip.model.saved_models.load_utils import load_saved_model
    from nequip.utils.global_state import set_global_state

    set_global_state()
    try:
        models = load_saved_model(str(path), compile_mode="eager", model_key=None)
    except Exception as err:
        kind = "package" if path.name.lower().endswith(PACKAGE_SUFFIX) else "checkpoint"
        raise ValueError(
            f"{path}: could not load it as a NequIP {kind} ({type(err).__name__}: {err})"
        ) from err
    if not isinstance(models, torch.nn.ModuleDict):
        raise UnsupportedModelError(
            f"{path}: expected nequip's ModuleDict of models, got {type(models).__name__}"
        )
    return models


def _check_dtype(model: torch.nn.Module, dtype: torch.dtype | None) -> None:
    model_dtype = getattr(model, "model_dtype", None)
    if dtype is not None and dtype != model_dtype:
        raise ValueError(
            f"dtype: this NequIP model is built for {model_dtype} (its model_dtype) and cannot be converted "
            f"to {dtype}; pass dtype=None, or train/build it with "
            f"model_dtype: {str(dtype).replace('torch.', '')}"
        )


# ---------------------------------------------------------------------------------------------
# Saving a patched package


def save_patched_nequip(
    model_or_path: torch.nn.Module | str | os.PathLike,
    out_path: str | os.PathLike,
    *,
    force: bool = False,
) -> Path:
    """Write a patched NequIP package (``.nequip.zip``) and return its path. Never touches the input.

    ``model_or_path``: a ``.ckpt``/``.nequip.zip`` path (every model in it is patched and checked against
    the unpatched one), or a NequIP GraphModel / ModuleDict (patched in place if not yet). The package holds
    the eager model with cgforge as an external module: ``load_nequip``, nequip's ``ModelFromPackage`` and
    nequip's ASE calculator load it wherever cgforge is installed. It cannot be ``nequip-compile``d.
    """
    out = _check_output(out_path, force)
    if isinstance(model_or_path, (str, os.PathLike)):
        src = _check_input(model_or_path)
        if out.exists() and os.path.samefile(src, out):
            raise ValueError(f"output: {out} is the input file; cgforge never writes over its input")
        contents = _contents_from_file(src)
    elif isinstance(model_or_path, torch.nn.Module):
        contents = _contents_from_model(model_or_path)
    else:
        raise TypeError(
            "model_or_path: expected a NequIP model or a .ckpt/.nequip.zip path, "
            f"got {type(model_or_path).__name__}"
        )
    _write_package(out, contents)
    return out


def _check_output(out_path: str | os.PathLike, force: bool) -> Path:
    if not isinstance(out_path, (str, os.PathLike)):
        raise TypeError(f"output: expected a file path, got {type(out_path).__name__}")
    out = Path(out_path)
    if not out.name.lower().endswith(PACKAGE_SUFFIX):
        raise ValueError(
            f"output: {out} must end with {PACKAGE_SUFFIX} (cgforge writes NequIP models as packages)"
        )
    if out.is_dir():
        raise IsADirectoryError(f"output: {out} is a directory, expected a file name")
    if out.exists() and not force:
        raise FileExistsError(f"output: {out} exists; use force=True (--force) to overwrite it")
    if not out.parent.is_dir():
        raise FileNotFoundError(f"output: directory {out.parent} does not exist")
    return out


class _PackageContents:
    """What goes into the package: the models, example data, text resources and the importers to use."""

    def __init__(
        self, models: torch.nn.ModuleDict, example_data: dict, config: str, metadata: dict, importers: tuple
    ) -> None:
        self.models, self.example_data, self.config = models, example_data, config
        self.metadata, self.importers = metadata, importers


def _contents_from_file(src: Path) -> _PackageContents:
    import yaml
    from nequip.utils.global_state import set_global_state

    set_global_state()
    if src.name.lower().endswith(PACKAGE_SUFFIX):
        imp = _package_importer(src)
        with _package_warnings_suppressed():
            try:
                metadata = yaml.safe_load(imp.load_text("model", "package_metadata.txt"))
                config = imp.load_text("model", "config.yaml")
                example_data = imp.load_pickle("model", "example_data.pkl", map_location="cpu")
                models = imp.load_pickle("model", "eager_model.pkl", map_location="cpu")
            except Exception as err:
                raise ValueError(
                    f"{src}: could not read the NequIP package ({type(err).__name__}: {err})"
                ) from err
        importers = (imp,)
    else:
        models, importers = _load_checkpoint_for_packaging(src)
        example_data = None
        config = _checkpoint_config(src)
        metadata = {}
    for name, model in models.items():
        model.eval()
        verify_patch(model)
        log.info("cgforge: patched and checked model %r of %s", name, src)
    if example_data is None:
        example_data = probe_structure(next(iter(models.values())))
    return _PackageContents(models, example_data, config, _package_metadata(models, metadata), importers)


def _contents_from_model(model: torch.nn.Module) -> _PackageContents:
    models = model if isinstance(model, torch.nn.ModuleDict) else torch.nn.ModuleDict({SOLE_MODEL: model})
    for m in models.values():
        _metadata(m)
    patch(models)
    importers = _importers_of(models)
    config = "# written by cgforge.patches.nequip.save_patched_nequip from an in-memory model\n"
    example_data = probe_structure(next(iter(models.values())))
    return _PackageContents(models, example_data, config, _package_metadata(models, {}), importers)


def _load_checkpoint_for_packaging(src: Path) -> tuple[torch.nn.ModuleDict, tuple]:
    """Load a .ckpt as nequip-package does, so a checkpoint fine-tuned from a package keeps its importer."""
    from nequip.model.saved_models import package as nequip_package
    from nequip.scripts._workflow_utils import get_workflow_state, set_workflow_state

    previous = get_workflow_state()
    set_workflow_state("package")
    try:
        models = _load_models(src)
        imp = nequip_package._get_shared_importer()
    finally:
        nequip_package._PACKAGE_TIME_SHARED_IMPORTER = None
        set_workflow_state(previous)
    return models, (imp,) if imp is not None else ()


def _checkpoint_config(src: Path) -> str:
    from omegaconf import OmegaConf

    ckpt = torch.load(src, map_location="cpu", weights_only=False)
    info = dict(ckpt["hyper_parameters"]["info_dict"])
    info.pop("versions", None)
    return OmegaConf.to_yaml(info)


def _importers_of(models: torch.nn.Module) -> tuple:
    """The torch.package importers the model's classes come from (at most one, as in nequip-package)."""
    from torch.package.package_importer import _package_imported_modules

    found = []
    for m in models.modules():
        module = _package_imported_modules.get(type(m).__module__)
        if module is not None and not any(module.__loader__ is imp for imp in found):
            found.append(module.__loader__)
    if len(found) > 1:
        raise UnsupportedModelError("model: its classes come from several NequIP packages; cannot package it")
    return tuple(found)


def _package_metadata(models: torch.nn.ModuleDict, previous: dict) -> dict:
    from nequip.scripts._package_utils import _EXTERNAL_MODULES
    from nequip.utils.versions import get_current_code_versions
    from nequip.utils.versions.version_utils import get_version_safe

    type_names = next(iter(models.values())).type_names
    externals = sorted(set(_EXTERNAL_MODULES) | {"cgforge"})
    metadata = dict(previous)
    metadata.update(
        {
            "versions": get_current_code_versions(verbose=False),
            "external_modules": {k: get_version_safe(k) for k in externals},
            "package_version_id": max(2, int(previous.get("package_version_id", 2))),
            "available_models": ["eager"],  # compiled variants cannot hold cgforge's kernels
            "atom_types": dict(enumerate(type_names)),
            "cgforge": {"patched": True, "version": get_version_safe("cgforge")},
        }
    )
    return metadata


def _package_importer(path: Path) -> Any:
    with _package_warnings_suppressed():
        try:
            return torch.package.PackageImporter(str(path))
        except Exception as err:
            raise ValueError(
                f"{path}: could not open the NequIP package ({type(err).__name__}: {err})"
            ) from err


def _package_warnings_suppressed(loading: bool = True) -> ExitStack:
    """nequip's package-loading context (CPU storages when ``loading``), quiet about torch.package noise."""
    from nequip.model.saved_models.package import (
        _cpu_deserialize_always,
        _suppress_package_importer_exporter_warnings,
    )

    stack = ExitStack()
    stack.enter_context(_suppress_package_importer_exporter_warnings())
    if loading:
        stack.enter_context(_cpu_deserialize_always())
    # the exporter asks each importer in turn for a class and logs every miss as a warning
    importer_log = logging.getLogger("torch.package.importer")
    level = importer_log.level
    importer_log.setLevel(logging.ERROR)
    stack.callback(importer_log.setLevel, level)
    return stack


def _write_package(out: Path, contents: _PackageContents) -> None:
    """Export like nequip-package (same intern/extern/mock lists), plus cgforge as an external module."""
    import yaml
    from nequip.scripts._package_utils import _EXTERNAL_MODULES, _INTERNAL_MODULES, _MOCK_MODULES

    internal = {m for m in _INTERNAL_MODULES if not (m == "cgforge" or m.startswith("cgforge."))}
    external = set(_EXTERNAL_MODULES) | {"cgforge"}
    devices = {name: _device_of(m) for name, m in contents.models.items()}
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        importers = contents.importers + (torch.package.importer.sys_importer,)
        with (
            _package_warnings_suppressed(loading=False),
            torch.package.PackageExporter(tmp, importer=importers) as exp,
        ):
            exp.mock([f"{m}.**" for m in sorted(_MOCK_MODULES)])
            exp.extern([f"{m}.**" for m in sorted(external)])
            exp.intern([f"{m}.**" for m in sorted(internal)])
            exp.save_pickle(
                "model",
                "example_data.pkl",
                {k: v.cpu() for k, v in contents.example_data.items()},
                dependencies=True,
            )
            exp.save_text("model", "config.yaml", contents.config)
            exp.save_text(
                "model", "package_metadata.txt", yaml.dump(contents.metadata, default_flow_style=False)
            )
            exp.save_pickle("model", "eager_model.pkl", contents.models.to("cpu"), dependencies=True)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, out)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    finally:
        for name, device in devices.items():
            contents.models[name].to(device)
    log.info("cgforge: wrote patched NequIP package %s", out)


def _device_of(model: torch.nn.Module) -> torch.device:
    return next((t.device for t in model.parameters()), torch.device("cpu"))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
