"""Read torch pickles written with e3nn 0.4 under the installed e3nn (0.5/0.6), without patching e3nn.

Most MACE ``.model`` files hold e3nn 0.4 objects (mace-torch pins e3nn 0.4.4), whose pickled state e3nn 0.6
cannot read. Inside one ``torch.load`` call an Unpickler hands out stand-in classes for the affected e3nn
classes; each stand-in is then rebuilt with the installed e3nn, its tensors copied over, and the result checked
against the 0.4 TorchScript code stored in the file. A state already in the installed format loads as usual.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import os
import pickle
import types
import warnings
import zipfile
from collections.abc import Callable, Iterator
from typing import Any

import torch
from e3nn import nn as e3nn_nn
from e3nn import o3
from e3nn.util.codegen import CodeGenMixin

from ..recognise import other_file_message
from ..torch_internals import buffers_dict, parameters_dict, replace_child

log = logging.getLogger(__name__)


class LegacyCheckpointError(ValueError):
    """A checkpoint that cannot be read, or holds e3nn objects cgforge cannot rebuild."""


class _LegacyE3nnModule(torch.nn.Module):
    """Holds the pickled state of an e3nn module written by e3nn 0.4 until it is rebuilt."""

    _cgforge_target: type = torch.nn.Module

    def __setstate__(self, state: dict) -> None:
        target = self._cgforge_target
        if _is_current_format(target, state):
            # Written by the installed e3nn (or compatible): become the real class and load normally.
            self.__class__ = target
            target.__setstate__(self, state)
            return
        state = dict(state)
        codegen = state.pop("__codegen__", None) or {}
        torch.nn.Module.__setstate__(self, state)
        self._legacy_codegen = dict(codegen)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self._cgforge_target.__qualname__} from an e3nn 0.4 pickle was not rebuilt; "
                           "load the file with cgforge.patches.load()")


_SHIMS: dict[type, type] = {}


def _is_current_format(target: type, state: dict) -> bool:
    if issubclass(target, CodeGenMixin):
        codegen = state.get("__codegen__")
        return codegen is None or all(isinstance(v, tuple) and len(v) == 2 for v in codegen.values())
    if issubclass(target, o3.SphericalHarmonics):
        return "sph_func" in state
    if issubclass(target, e3nn_nn.Activation):
        return "paths" in state
    return True


class _ScopedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        cls = super().find_class(module, name)
        if not (module.startswith("e3nn.") and isinstance(cls, type)
                and issubclass(cls, (CodeGenMixin, o3.SphericalHarmonics, e3nn_nn.Activation))):
            return cls
        if cls not in _SHIMS:
            _SHIMS[cls] = type(f"Legacy{cls.__name__}", (_LegacyE3nnModule,), {"_cgforge_target": cls})
        return _SHIMS[cls]


def _pickle_module() -> types.ModuleType:
    """A pickle-module look-alike for ``torch.load(pickle_module=...)``."""
    mod = types.ModuleType("cgforge_e3nn04_pickle")
    mod.Unpickler = _ScopedUnpickler
    mod.Pickler = pickle.Pickler
    mod.load = lambda f, **kw: _ScopedUnpickler(f, **kw).load()
    mod.loads = lambda b, **kw: _ScopedUnpickler(io.BytesIO(b), **kw).load()
    mod.dump = pickle.dump
    mod.dumps = pickle.dumps
    return mod


def describe_file(path: str | os.PathLike) -> str:
    """A short description of what a file looks like, for error messages."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError as err:
        return f"unreadable ({err.strerror})"
    if not head:
        return "an empty file"
    if head.startswith(b"PK\x03\x04"):
        return "a zip archive"
    if head[:1] == b"\x80":
        return "a raw pickle stream"
    if head.startswith(b"\x89HDF"):
        return "an HDF5 file"
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        return f"binary data starting with {head[:8]!r}"
    first = text.strip().splitlines()[0][:40] if text.strip() else ""
    return f"a text file starting with {first!r}"


def _is_torchscript_archive(path: str) -> bool:
    try:
        with zipfile.ZipFile(path) as zf:
            return any(n.endswith("/constants.pkl") for n in zf.namelist())
    except (zipfile.BadZipFile, OSError):
        return False


def load_pickle(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> Any:
    """``torch.load`` a whole pickled object, accepting e3nn 0.4 modules inside it. ``FileNotFoundError`` for a missing
    path, ``LegacyCheckpointError`` naming what was found for anything that is no readable torch pickle."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if os.path.isdir(path):
        raise LegacyCheckpointError(f"{path}: is a directory, expected a checkpoint file")
    if _is_torchscript_archive(path):
        raise LegacyCheckpointError(f"{path}: a TorchScript (compiled) model; cgforge patches the eager model "
                                    "(mace_run_train writes both: use NAME.model, not NAME_compiled.model)")
    other = other_file_message(path, "a MACE checkpoint")  # a NequIP package, an ML-IAP file: say so
    if other is not None:
        raise LegacyCheckpointError(other)
    try:
        obj = torch.load(path, map_location=map_location, pickle_module=_pickle_module(), weights_only=False)
    except (pickle.UnpicklingError, EOFError, RuntimeError, OSError, ValueError) as err:
        raise LegacyCheckpointError(
            f"{path}: not a readable torch checkpoint (found {describe_file(path)}; "
            f"torch.load said: {str(err).splitlines()[0] if str(err) else type(err).__name__})"
        ) from err
    except (AttributeError, ModuleNotFoundError, ImportError) as err:
        raise LegacyCheckpointError(f"{path}: the pickle refers to code that is not installed here ({err})") from err
    if isinstance(obj, torch.nn.Module):
        rebuild_legacy_modules(obj)
    return obj


def rebuild_legacy_modules(root: torch.nn.Module) -> int:
    """Replace every e3nn 0.4 stand-in under ``root`` by a rebuilt module. Returns how many."""
    legacy = [(name, mod) for name, mod in root.named_modules() if isinstance(mod, _LegacyE3nnModule)]
    if isinstance(root, _LegacyE3nnModule):
        raise LegacyCheckpointError("the checkpoint is a bare e3nn 0.4 module; cgforge expects a model")
    rebuilt = {name: _rebuild(name, mod) for name, mod in legacy}  # all or nothing
    for name, new in rebuilt.items():
        parent_name, _, child = name.rpartition(".")
        parent = root.get_submodule(parent_name) if parent_name else root
        replace_child(parent, child, new)
    if rebuilt:
        log.info("rebuilt %d e3nn 0.4 modules with the installed e3nn", len(rebuilt))
    return len(rebuilt)


def _rebuild(name: str, old: _LegacyE3nnModule) -> torch.nn.Module:
    target = old._cgforge_target
    device, dtype = _placement(old)
    for base, builder in _BUILDERS:
        if issubclass(target, base):
            # e3nn bakes constants (CG coefficients) in the default dtype: build in the model's dtype
            # so that a float64 model keeps float64-exact constants.
            with _default_dtype(dtype):
                new = builder(old)
            break
    else:
        raise LegacyCheckpointError(f"{name}: e3nn 0.4 {target.__module__}.{target.__qualname__} cannot be rebuilt "
                                    "by cgforge (supported: TensorProduct and subclasses, Linear, SphericalHarmonics, "
                                    "Activation)")
    new.to(device=device, dtype=dtype)
    _copy_tensors(name, old, new)
    new.train(old.training)
    _verify_against_legacy_code(name, old, new)
    return new


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _placement(module: torch.nn.Module) -> tuple[torch.device, torch.dtype]:
    tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
    floating = [t for t in tensors if t.is_floating_point()]
    device = tensors[0].device if tensors else torch.device("cpu")
    return device, floating[0].dtype if floating else torch.get_default_dtype()


def _copy_tensors(name: str, old: torch.nn.Module, new: torch.nn.Module) -> None:
    """Move the pickled parameters and buffers into the rebuilt module (same names, same shapes)."""
    for slots in (parameters_dict, buffers_dict):
        for key, tensor in slots(old).items():
            fresh = slots(new).get(key)
            if tensor is None or fresh is None:
                if tensor is not None or fresh is not None:
                    raise LegacyCheckpointError(f"{name}.{key}: in only one of old and rebuilt module")
                continue
            if fresh.shape != tensor.shape:
                raise LegacyCheckpointError(f"{name}.{key}: pickled shape {tuple(tensor.shape)} but the rebuilt "
                                            f"module has {tuple(fresh.shape)}")
            slots(new)[key] = tensor
    missing = set(parameters_dict(new)) - set(parameters_dict(old))
    if missing:
        raise LegacyCheckpointError(f"{name}: rebuilt module has parameters not pickled: {sorted(missing)}")


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-300)


def _rebuild_tensor_product(old: Any) -> torch.nn.Module:
    target = old._cgforge_target
    if target.forward is not o3.TensorProduct.forward:  # e.g. TensorSquare: its own inputs and state
        raise LegacyCheckpointError(f"e3nn 0.4 {target.__qualname__} cannot be rebuilt by cgforge")
    new = target.__new__(target)
    # The pickled path weights already include e3nn's normalisation; with both normalisations set to
    # "none" e3nn uses sqrt(given weight), so give it the square.
    o3.TensorProduct.__init__(
        new, old.irreps_in1, old.irreps_in2, old.irreps_out,
        [(i.i_in1, i.i_in2, i.i_out, i.connection_mode, i.has_weight, i.path_weight**2) for i in old.instructions],
        irrep_normalization="none", path_normalization="none", internal_weights=old.internal_weights,
        shared_weights=old.shared_weights, compile_right="_compiled_main_right" in old._legacy_codegen)
    for a, b in zip(old.instructions, new.instructions, strict=True):
        if a.path_weight < 0 or not _close(a.path_weight, b.path_weight) or tuple(a.path_shape) != tuple(b.path_shape):
            raise LegacyCheckpointError(f"TensorProduct instruction {a} could not be reproduced (got {b})")
    return new


def _rebuild_linear(old: Any) -> torch.nn.Module:
    target = old._cgforge_target
    pairs = [(i.i_in, i.i_out) for i in old.instructions if i.i_in != -1]
    biases = [any(i.i_in == -1 and i.i_out == k for i in old.instructions) for k in range(len(old.irreps_out))]
    weight = parameters_dict(old).get("weight", buffers_dict(old).get("weight"))
    f_in = f_out = None
    if weight is not None and weight.dim() == 3:
        f_in, f_out = int(weight.shape[0]), int(weight.shape[1])
    for path_normalization in ("element", "path"):
        new = target.__new__(target)
        o3.Linear.__init__(new, old.irreps_in, old.irreps_out, f_in=f_in, f_out=f_out,
                           internal_weights=old.internal_weights, shared_weights=old.shared_weights,
                           instructions=pairs, biases=biases, path_normalization=path_normalization)
        if len(new.instructions) == len(old.instructions) and all(
            (a.i_in, a.i_out, tuple(a.path_shape)) == (b.i_in, b.i_out, tuple(b.path_shape))
            and _close(a.path_weight, b.path_weight)
            for a, b in zip(old.instructions, new.instructions, strict=True)
        ):
            return new
    raise LegacyCheckpointError(f"Linear {old.irreps_in} -> {old.irreps_out}: its path weights match neither "
                                "'element' nor 'path' normalisation of the installed e3nn")


def _rebuild_spherical_harmonics(old: Any) -> torch.nn.Module:
    return old._cgforge_target(list(old._ls_list), normalize=old.normalize, normalization=old.normalization,
                               irreps_in=old.irreps_in)


def _rebuild_activation(old: Any) -> torch.nn.Module:
    # The activations are pickled modules (normalize2mom); keep them rather than re-normalising.
    new = old._cgforge_target.__new__(old._cgforge_target)
    torch.nn.Module.__init__(new)
    new.irreps_in = old.irreps_in
    new.irreps_out = old.irreps_out
    new.acts = old.acts
    new.paths = [(mul, (l, p), act) for (mul, (l, p)), act in zip(new.irreps_in, new.acts, strict=True)]
    return new


_BUILDERS: list[tuple[type, Callable[[Any], torch.nn.Module]]] = [(o3.TensorProduct, _rebuild_tensor_product),
                                                                  (o3.Linear, _rebuild_linear),
                                                                  (o3.SphericalHarmonics, _rebuild_spherical_harmonics),
                                                                  (e3nn_nn.Activation, _rebuild_activation)]


# Checking a rebuilt module against the TorchScript that e3nn 0.4 generated and pickled


def _verify_against_legacy_code(name: str, old: _LegacyE3nnModule, new: torch.nn.Module) -> None:
    codegen = getattr(old, "_legacy_codegen", {})
    fname = next((f for f in _PROBES if f in codegen), None)
    if fname is None:
        return
    make_inputs = _PROBES[fname]
    device, dtype = _placement(new)
    try:
        with _torchscript_deprecation_quiet():
            legacy_fn = torch.jit.load(io.BytesIO(codegen[fname]), map_location=device)
    except Exception as err:  # noqa: BLE001 - any failure only skips the extra check
        log.warning("%s: could not load the e3nn 0.4 code to cross-check the rebuild (%s)", name, err)
        return
    gen = torch.Generator().manual_seed(0)
    inputs = tuple(t.to(device, dtype) for t in make_inputs(new, gen))
    try:
        with _default_dtype(dtype), _torchscript_deprecation_quiet():  # e3nn 0.4's code makes some constants
            expected = legacy_fn(*inputs)                                # in the default dtype
    except Exception as err:  # noqa: BLE001
        log.warning("%s: the e3nn 0.4 code did not run here, cross-check skipped (%s)", name, err)
        return
    got = getattr(new, fname)(*inputs)
    scale = expected.abs().max().item() if expected.numel() else 0.0
    err = (got - expected).abs().max().item() if expected.numel() else 0.0
    tolerance = 1e-9 if dtype == torch.float64 else 1e-4
    if err > tolerance * max(scale, 1.0):
        raise LegacyCheckpointError(f"{name}: rebuilt {type(new).__name__} differs from the pickled e3nn 0.4 code "
                                    f"(max abs difference {err:.3g})")


@contextlib.contextmanager
def _torchscript_deprecation_quiet() -> Iterator[None]:
    """No "torch.jit.load is deprecated" warning per rebuilt module: the e3nn 0.4 code is TorchScript by nature."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.jit")
        yield


def _tp_inputs(tp: Any, gen: torch.Generator) -> tuple:
    batch = 3
    x1 = torch.randn(batch, tp.irreps_in1.dim, generator=gen, dtype=torch.float64)
    x2 = torch.randn(batch, tp.irreps_in2.dim, generator=gen, dtype=torch.float64)
    if tp.internal_weights:
        return x1, x2, tp.weight.detach().cpu()
    shape = (tp.weight_numel,) if tp.shared_weights else (batch, tp.weight_numel)
    return x1, x2, torch.randn(*shape, generator=gen, dtype=torch.float64)


def _linear_inputs(lin: Any, gen: torch.Generator) -> tuple:
    batch = 3
    x = torch.randn(batch, lin.irreps_in.dim, generator=gen, dtype=torch.float64)
    if lin.internal_weights:
        return x, lin.weight.detach().cpu(), lin.bias.detach().cpu()
    return (x, torch.randn(batch, lin.weight_numel, generator=gen, dtype=torch.float64),
            torch.randn(batch, lin.bias_numel, generator=gen, dtype=torch.float64))


# Generated function name -> inputs for it; the same signature in e3nn 0.4 and 0.6.
_PROBES: dict[str, Callable[[Any, torch.Generator], tuple]] = {"_compiled_main_left_right": _tp_inputs,
                                                               "_compiled_main": _linear_inputs}
