"""Write a patched NequIP package (``.nequip.zip``) from a model or a file; the input is never touched.

cgforge is an external module of that package, so it loads wherever cgforge is installed. This writer
uses nequip's packaging internals (its module lists, shared importer and workflow state) and torch.package's
private ``_package_imported_modules``: all of it is in this module, pinned to nequip 0.19.
"""

from __future__ import annotations

import logging
import os
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cgforge.atomic import atomic_path, check_new_file

from ..common import UnsupportedModelError
from .files import PACKAGE_SUFFIX, SOLE_MODEL, check_input, load_models
from .patch import patch
from .verify import model_metadata, probe_structure, verify_patch

log = logging.getLogger(__name__)


def save_patched_nequip(model_or_path: torch.nn.Module | str | os.PathLike, out_path: str | os.PathLike, *,
                        force: bool = False) -> Path:
    """Write a patched NequIP package (``.nequip.zip``, cgforge an external module) and return its path.
    ``model_or_path``: a ``.ckpt``/``.nequip.zip`` path (never touched; every model patched and checked against the
    unpatched one), or a NequIP GraphModel / ModuleDict (patched in place if not yet)."""
    out = _check_output(out_path, force)
    if isinstance(model_or_path, (str, os.PathLike)):
        src = check_input(model_or_path)
        if out.exists() and os.path.samefile(src, out):
            raise ValueError(f"output: {out} is the input file; cgforge never writes over its input")
        contents = _contents_from_file(src)
    elif isinstance(model_or_path, torch.nn.Module):
        contents = _contents_from_model(model_or_path)
    else:
        raise TypeError(f"model_or_path: expected a NequIP model or a .ckpt/.nequip.zip path, got "
                        f"{type(model_or_path).__name__}")
    _write_package(out, contents)
    return out


def _check_output(out_path: str | os.PathLike, force: bool) -> Path:
    if not isinstance(out_path, (str, os.PathLike)):
        raise TypeError(f"output: expected a file path, got {type(out_path).__name__}")
    out = Path(out_path)
    if not out.name.lower().endswith(PACKAGE_SUFFIX):
        raise ValueError(f"output: {out} must end with {PACKAGE_SUFFIX} (cgforge writes NequIP models as packages)")
    return check_new_file(out, force=force, what="output")


@dataclass
class _PackageContents:
    """What goes into the package: the models, example data, text resources and the importers to use."""

    models: torch.nn.ModuleDict
    example_data: dict
    config: str
    metadata: dict
    importers: tuple


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
                raise ValueError(f"{src}: could not read the NequIP package ({type(err).__name__}: {err})") from err
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
        model_metadata(m)
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
        models = load_models(src)
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
    return {**previous,
            "versions": get_current_code_versions(verbose=False),
            "external_modules": {k: get_version_safe(k) for k in externals},
            "package_version_id": max(2, int(previous.get("package_version_id", 2))),
            "available_models": ["eager"],  # compiled variants cannot hold cgforge's kernels
            "atom_types": dict(enumerate(type_names)),
            "cgforge": {"patched": True, "version": get_version_safe("cgforge")}}


def _package_importer(path: Path) -> Any:
    with _package_warnings_suppressed():
        try:
            return torch.package.PackageImporter(str(path))
        except Exception as err:
            raise ValueError(f"{path}: could not open the NequIP package ({type(err).__name__}: {err})") from err


def _package_warnings_suppressed(loading: bool = True) -> ExitStack:
    """nequip's package-loading context (CPU storages when ``loading``), quiet about torch.package noise."""
    from nequip.model.saved_models.package import _cpu_deserialize_always, _suppress_package_importer_exporter_warnings

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
    try:
        importers = contents.importers + (torch.package.importer.sys_importer,)
        with (atomic_path(out) as tmp, _package_warnings_suppressed(loading=False),
              torch.package.PackageExporter(tmp, importer=importers) as exp):
            exp.mock([f"{m}.**" for m in sorted(_MOCK_MODULES)])
            exp.extern([f"{m}.**" for m in sorted(external)])
            exp.intern([f"{m}.**" for m in sorted(internal)])
            exp.save_pickle("model", "example_data.pkl", {k: v.cpu() for k, v in contents.example_data.items()},
                            dependencies=True)
            exp.save_text("model", "config.yaml", contents.config)
            exp.save_text("model", "package_metadata.txt", yaml.dump(contents.metadata, default_flow_style=False))
            exp.save_pickle("model", "eager_model.pkl", contents.models.to("cpu"), dependencies=True)
    finally:
        for name, device in devices.items():
            contents.models[name].to(device)
    log.info("cgforge: wrote patched NequIP package %s", out)


def _device_of(model: torch.nn.Module) -> torch.device:
    return next((t.device for t in model.parameters()), torch.device("cpu"))
