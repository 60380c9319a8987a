"""The model families cgforge patches (MACE, NequIP): one ``Family`` object each, registered here.

    model = families.load("water.model", device="cuda", dtype="float32")   # a file or a module, patched
    family = families.family_of(model)                                     # families.MACE
    family.unpatch(model); family.save(model, "plain.model", patched=False)

The one place that tells a MACE model or file from a NequIP one; a family's package is imported only when one of
its models is loaded, patched, saved or run.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .common import parse_device, parse_dtype
from .recognise import is_mace_model, is_nequip_model, is_nequip_package, other_file_message, zip_names

if TYPE_CHECKING:  # the kernels load when a model is patched, not when this module is imported
    from cgforge.kernels.core.tuning import KernelTuning

# nequip-compile / TorchScript / AOTInductor outputs: no family reads them (cgforge's kernels are launched
# from Python, which a compiled model cannot call)
COMPILED_SUFFIXES = (".nequip.pth", ".nequip.pt2", ".pt2")


@dataclass(frozen=True)
class Family:
    """One model family: how to recognise its modules and files, and its load, patch, unpatch, save, adapter.
    ``package``: its code (imported on first use); ``suffixes``: the file names it reads, ``writes`` those ``save``
    writes."""

    name: str
    title: str
    package: str
    suffixes: tuple[str, ...]
    writes: tuple[str, ...]
    written_as: str
    adapter_options: tuple[str, ...]

    # -- recognising (never imports the family's package) --------------------------------------

    def owns(self, module: Any) -> bool:
        """True when ``module`` is a model of this family (the installed classes or a packaged copy)."""
        raise NotImplementedError

    def owns_name(self, path: str | os.PathLike) -> bool:
        """True when the file name of ``path`` ends with one of this family's suffixes (and is no compiled
        model); the file need not exist."""
        name = os.path.basename(os.fspath(path)).lower()
        return name.endswith(self.suffixes) and not name.endswith(COMPILED_SUFFIXES)

    def sniffs(self, path: str | os.PathLike) -> bool:
        """True when the contents of the existing file ``path`` look like this family's (any name)."""
        raise NotImplementedError

    # -- the family's code (imports its package) ------------------------------------------------

    def load(self, path: str | os.PathLike, device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None,
             *, patch: bool = True, tuning: KernelTuning | None = None) -> torch.nn.Module:
        """The model in the checkpoint ``path`` (zip checksums checked first), in eval mode on ``device``, patched
        (``patch``, with ``tuning``) or as the family builds it, in ``dtype`` (None: the file's)."""
        raise NotImplementedError

    def prepare(self, model: torch.nn.Module, device: str | torch.device = "cpu",
                dtype: str | torch.dtype | None = None, *, patch: bool = True,
                tuning: KernelTuning | None = None) -> torch.nn.Module:
        """``model`` made ready as ``load`` makes a file's (upgraded, in ``dtype``, on ``device``, patched in place
        with ``tuning`` when ``patch``; a patched model keeps its kernels); returns it."""
        raise NotImplementedError

    def patch(self, model: torch.nn.Module) -> torch.nn.Module:
        """Swap cgforge's kernels into ``model``, in place and idempotent; returns it."""
        return self._code().patch(model)

    def unpatch(self, model: torch.nn.Module) -> torch.nn.Module:
        """Undo ``patch`` in place: the model no longer refers to cgforge; returns it."""
        return self._code().unpatch(model)

    def is_patched(self, model: torch.nn.Module) -> bool:
        """True when ``model`` runs cgforge's kernels in at least one of its layers."""
        return bool(self._code().is_patched(model))

    def check_output(self, path: str | os.PathLike, *, patched: bool = True, what: str = "output") -> None:
        """Raise ValueError naming ``what`` unless ``save`` can write a (``patched`` or plain) model of this family
        to ``path``; checks the name only, so that callers check it before loading anything."""
        name = os.path.basename(os.fspath(path)).lower()
        if not name.endswith(self.writes) or name.endswith(COMPILED_SUFFIXES):
            raise ValueError(f"{what}: {path} must end with {', '.join(self.writes)} (cgforge writes {self.title} "
                             f"models as {self.written_as})")

    def save(self, source: torch.nn.Module | str | os.PathLike, path: str | os.PathLike, *, force: bool = False,
             patched: bool = True, device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None) -> Path:
        """Write ``source`` (a model, patched or unpatched in place as ``patched`` says, or a checkpoint file, never
        modified) to ``path`` atomically, not over a file unless ``force``; returns the path."""
        raise NotImplementedError

    def adapter(self, model: torch.nn.Module, device: torch.device, **options: Any) -> Any:
        """The runtime's ``ModelAdapter`` of ``model`` on ``device``. ``options``: ``head`` (MACE) and ``type_map``
        (NequIP: {chemical symbol: type name}); a value for the other family's option raises ValueError."""
        for key, value in options.items():
            if value is None or key in self.adapter_options:
                continue
            owner = next((f.title for f in FAMILIES if key in f.adapter_options), None)
            if owner is None:
                raise TypeError(f"adapter: unknown option {key!r}")
            raise ValueError(f"{key}: only for {owner} models")
        return self._adapter(model, device, **{k: options.get(k) for k in self.adapter_options})

    def _adapter(self, model: torch.nn.Module, device: torch.device, **options: Any) -> Any:
        raise NotImplementedError

    def _code(self) -> Any:
        import importlib

        return importlib.import_module(self.package)


class _MaceFamily(Family):
    def owns(self, module: Any) -> bool:
        return is_mace_model(module)

    def sniffs(self, path: str | os.PathLike) -> bool:
        """A torch.save zip (a pickled whole model) that is not a NequIP package."""
        names = zip_names(path)
        return any(n.endswith("/data.pkl") for n in names) and not is_nequip_package(names)

    def load(self, path: str | os.PathLike, device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None,
             *, patch: bool = True, tuning: KernelTuning | None = None) -> torch.nn.Module:
        """A MACE ``.model`` (mace-torch 0.3.x; e3nn 0.4 pickles and older attributes upgraded in memory)."""
        quiet_mace_import()
        from .mace import load_mace

        return load_mace(path, device=device, dtype=dtype, patched=patch, tuning=tuning).eval()

    def prepare(self, model: torch.nn.Module, device: str | torch.device = "cpu",
                dtype: str | torch.dtype | None = None, *, patch: bool = True,
                tuning: KernelTuning | None = None) -> torch.nn.Module:
        from .mace import patch as patch_model
        from .mace import upgrade_old_attributes

        upgrade_old_attributes(model)
        if patch:
            patch_model(model, tuning=tuning)
        dtype = parse_dtype(dtype)
        if dtype is not None:
            model.to(dtype=dtype)
        return model.to(parse_device(device))

    def save(self, source: torch.nn.Module | str | os.PathLike, path: str | os.PathLike, *, force: bool = False,
             patched: bool = True, device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None) -> Path:
        """A whole-model pickle, which ``torch.load``, mace-torch's tools and MACECalculator load."""
        from cgforge.atomic import atomic_save

        self.check_output(path, patched=patched)
        model = load(source, device, dtype, patch=patched) if isinstance(source, (str, os.PathLike)) else source
        if not self.owns(model):
            raise TypeError(f"model: expected a MACE model, got {_class_name(model)}")
        model = self.patch(model) if patched else self.unpatch(model)
        return atomic_save(model, path, force=force)

    def _adapter(self, model: torch.nn.Module, device: torch.device, **options: Any) -> Any:
        from .mace.adapter import MaceAdapter

        return MaceAdapter(model, device, options["head"])


class _NequipFamily(Family):
    def owns(self, module: Any) -> bool:
        return is_nequip_model(module)

    def sniffs(self, path: str | os.PathLike) -> bool:
        """A nequip-package archive (a zip holding ``model/package_metadata.txt``)."""
        return is_nequip_package(zip_names(path))

    def load(self, path: str | os.PathLike, device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None,
             *, patch: bool = True, tuning: KernelTuning | None = None) -> torch.nn.Module:
        """A NequIP ``.ckpt`` or ``.nequip.zip`` (its sole model, checked against the plain one once patched); another
        ``dtype`` than its ``model_dtype`` raises ValueError; ``tuning.sc`` does not apply."""
        from .nequip import load_nequip

        return load_nequip(path, device=device, dtype=dtype, patched=patch, tuning=tuning)

    def prepare(self, model: torch.nn.Module, device: str | torch.device = "cpu",
                dtype: str | torch.dtype | None = None, *, patch: bool = True,
                tuning: KernelTuning | None = None) -> torch.nn.Module:
        from .nequip import check_dtype
        from .nequip import patch as patch_model

        check_dtype(model, parse_dtype(dtype))
        model.eval().to(parse_device(device))
        return patch_model(model, tuning=tuning) if patch else model

    def save(self, source: torch.nn.Module | str | os.PathLike, path: str | os.PathLike, *, force: bool = False,
             patched: bool = True, device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None) -> Path:
        """A patched ``.nequip.zip`` package (every model of a file patched and checked), written from the CPU in
        the model's ``model_dtype`` (``device`` unused; a ``dtype`` raises ValueError)."""
        self.check_output(path, patched=patched)
        if dtype is not None:
            raise ValueError("dtype: a NequIP model keeps the model_dtype it was built with; leave dtype "
                             "(--dtype) out")
        from .nequip import save_patched_nequip

        return save_patched_nequip(source, path, force=force)

    def check_output(self, path: str | os.PathLike, *, patched: bool = True, what: str = "output") -> None:
        if not patched:
            raise ValueError("cgforge writes plain MACE .model files only, and this NequIP model is not one (the "
                             ".ckpt or .nequip.zip a patched package was made from is the plain file)")
        super().check_output(path, patched=patched, what=what)

    def _adapter(self, model: torch.nn.Module, device: torch.device, **options: Any) -> Any:
        from .nequip.adapter import NequipAdapter

        return NequipAdapter(model, device, options["type_map"])


MACE: Family = _MaceFamily(name="mace", title="MACE", package="cgforge.patches.mace",
                           suffixes=(".model", ".pt", ".pth"), writes=(".model", ".pt", ".pth"),
                           written_as="pickled .model files, which MACE's tools load", adapter_options=("head",))
NEQUIP: Family = _NequipFamily(name="nequip", title="NequIP", package="cgforge.patches.nequip",
                               suffixes=(".ckpt", ".nequip.zip"), writes=(".nequip.zip",),
                               written_as="nequip packages", adapter_options=("type_map",))
FAMILIES: tuple[Family, ...] = (MACE, NEQUIP)


def family_of(module: Any) -> Family:
    """The family of the model ``module``; TypeError naming its class when no family owns it."""
    for family in FAMILIES:
        if family.owns(module):
            return family
    titles = " or ".join(f.title for f in FAMILIES)
    raise TypeError(f"model: expected a {titles} model, got {_class_name(module)}")


def family_for_file(path: str | os.PathLike) -> Family:
    """The family that reads the checkpoint ``path``: by its suffix, else by its contents. ValueError for a
    compiled model or a file no family recognises, FileNotFoundError for a missing one no suffix claims."""
    path = os.fspath(path)
    if os.path.basename(path).lower().endswith(COMPILED_SUFFIXES):
        raise ValueError(f"{path}: a compiled (TorchScript/AOTInductor) model; cgforge patches eager models: "
                         "give the .ckpt or .nequip.zip it was compiled from")
    for family in FAMILIES:
        if family.owns_name(path):
            return family
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint not found: {path}")
    for family in FAMILIES:
        if os.path.isfile(path) and family.sniffs(path):
            return family
    expected = " or ".join(f"a {f.title} {'/'.join(f.suffixes)} file" for f in FAMILIES)
    raise ValueError(other_file_message(path, f"a checkpoint ({expected})")
                     or f"{path}: cannot tell the checkpoint type (found {_describe_file(path)}); expected {expected}")


def load(source: str | os.PathLike | torch.nn.Module, device: str | torch.device = "cpu",
         dtype: str | torch.dtype | None = None, *, patch: bool = True,
         tuning: KernelTuning | None = None) -> torch.nn.Module:
    """A MACE or NequIP model ready to run, from a checkpoint path (``Family.load``) or a module of either family
    (``Family.prepare``, patched in place). ``dtype``: None (the model's) or float32/float64 (NequIP: its
    ``model_dtype`` only); ``tuning``: the defaults for a module already patched. A file that fails to load raises
    ValueError naming it."""
    check_tuning(tuning, patch)
    device, dtype = parse_device(device), parse_dtype(dtype)
    if isinstance(source, torch.nn.Module):
        family = family_of(source)
        if tuning is not None and tuning != type(tuning)() and family.is_patched(source):
            raise ValueError("tuning: the module was patched already (its kernels carry the tuning they were built "
                             "with); unpatch it first (families.family_of(model).unpatch(model)) or leave tuning out")
        return family.prepare(source, device, dtype, patch=patch, tuning=tuning)
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"model: expected a checkpoint path or a MACE/NequIP torch module, got "
                        f"{type(source).__name__}")
    family = family_for_file(source)
    with _warnings_naming(os.fspath(source)):
        try:
            return family.load(source, device, dtype, patch=patch, tuning=tuning)
        except (ValueError, TypeError, OSError):
            raise
        except Exception as err:  # a damaged file fails deep inside torch.load / pickle
            raise ValueError(f"{os.fspath(source)}: could not load it as a {family.title} checkpoint "
                             f"({type(err).__name__}: {err})") from err


def check_tuning(tuning: object, patch: bool | None = True) -> None:
    """``tuning`` is None or a ``KernelTuning`` (else TypeError), and not given with ``patch=False`` (ValueError);
    ``patch`` None (decided later) is not checked."""
    if tuning is None:
        return
    from cgforge.kernels.core.tuning import KernelTuning, SCTuning, TPTuning

    if not isinstance(tuning, KernelTuning):
        hint = (f" (wrap it: KernelTuning({'tp' if isinstance(tuning, TPTuning) else 'sc'}=...))"
                if isinstance(tuning, TPTuning | SCTuning) else "")
        raise TypeError(f"tuning: expected a cgforge.kernels.KernelTuning or None, got {type(tuning).__name__}{hint}")
    if patch is False:
        raise ValueError("tuning and patch=False: a kernel tuning is for cgforge's kernels, which patch=False does "
                         "not use; leave one out")


def quiet_mace_import() -> None:
    """Import mace-torch's ``mace.tools.cg`` without the line it prints when cuEquivariance (which cgforge never
    uses) is not installed; other output is printed as usual."""
    if "mace.tools.cg" in sys.modules:
        return
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            import mace.tools.cg  # noqa: F401
    except ImportError:
        pass
    finally:
        rest = [line for line in printed.getvalue().splitlines() if "cuequivariance" not in line]
        if rest:
            print("\n".join(rest))


@contextlib.contextmanager
def _warnings_naming(source: str) -> Iterator[None]:
    """Warnings raised inside are issued again as if raised by ``source`` (a file name) at line 0: one line each."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for w in caught:
        warnings.warn_explicit(w.message, w.category, filename=source, lineno=0)


def _describe_file(path: str) -> str:
    from .mace.legacy import describe_file  # the error path only: imports the MACE package

    return describe_file(path)


def _class_name(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"
