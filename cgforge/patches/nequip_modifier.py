"""cgforge's ``nequip.extension`` entry point: registers the ``enable_cgforge`` model modifier.

nequip imports ``init_always`` entry points while ``nequip`` itself is being imported and finds modifiers as
``@model_modifier`` classmethods on a model's modules: the modifier is attached to ``TensorProductScatter``, in
every NequIP model. Runs inside ``import nequip``, so it imports only two nequip modules and ``cgforge.patches``
(no family code, no kernels: ``tests/patches/test_families.py`` checks).
"""

from __future__ import annotations

from typing import Any

from nequip.nn._tp_scatter_base import TensorProductScatter
from nequip.nn.model_modifier_utils import model_modifier

MODIFIER_NAME = "enable_cgforge"


def _enable_cgforge(cls: type, model: Any) -> Any:
    """Use cgforge's fused convolution (JIT CUDA kernels for the e3nn tensor product + scatter; a torch reference on
    CPU) in every NequIP convolution: same state_dict, energies and forces. Eager models only: `nequip-compile`
    cannot hold kernels launched from Python; run the eager model or a package (`cgforge patch IN OUT.nequip.zip`)."""
    from .nequip import enable_cgforge  # lazy: keeps `import nequip` light

    return enable_cgforge(model)


def register() -> None:
    """Attach the modifier to nequip's TensorProductScatter (idempotent)."""
    if MODIFIER_NAME in TensorProductScatter.__dict__:
        return
    modifier = model_modifier(
        persistent=False,  # an acceleration: same outputs, so never baked into `nequip-package` builds
        private=False,
        unsupported_devices=[],  # CPU runs the torch reference
        supported_compile_modes=[],  # eager only, see the docstring above
    )(classmethod(_enable_cgforge))
    setattr(TensorProductScatter, MODIFIER_NAME, modifier)


register()
