"""``KernelHarmonics``: the stand-in for an e3nn ``SphericalHarmonics`` module (``normalize=True``) that computes it
with ``cgforge.kernels.harmonics`` (torch's reference off CUDA); the state_dict does not change. Made by the
patches where ``KernelTuning.harmonics`` is set (``stand_in_for``); ``normalize=False`` keeps e3nn's module.
"""

from __future__ import annotations

import logging

import torch
from e3nn import o3

from cgforge.kernels.harmonics import HarmonicsPolynomials, harmonics, register

from .recognise import plain_module_name
from .stand_in import StandIn

log = logging.getLogger(__name__)


def is_e3nn_harmonics(module: torch.nn.Module) -> bool:
    """Whether ``module`` is e3nn's ``SphericalHarmonics``, from the installed e3nn or one inside a torch package
    (nequip's packaged models carry their own copy of e3nn, a class of another identity)."""
    cls = type(module)
    return cls.__name__ == "SphericalHarmonics" and plain_module_name(cls.__module__).startswith("e3nn.")


class KernelHarmonics(torch.nn.Module, StandIn):
    """e3nn's ``SphericalHarmonics(irreps, normalize=True, normalization=...)`` by cgforge's kernel: [..., 3] edge
    vectors in, [..., D] harmonics out (D = ``irreps_out.dim``), the same values and derivatives."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.polys = HarmonicsPolynomials.of(module)  # ValueError for a module that is not such a one
        self.key = register(self.polys)  # the ops' name for them, made here: torch.compile traces forward
        self.irreps_in = getattr(module, "irreps_in", o3.Irreps("1x1o"))
        self.irreps_out = module.irreps_out
        self.original = (module,)  # a tuple: not a submodule, not in the state_dict

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.key = register(self.polys)  # a loaded model: registered in this process

    def forward(self, vectors: torch.Tensor) -> torch.Tensor:
        flat = harmonics(vectors.reshape(-1, 3), self.polys, self.key)
        return flat.reshape(*vectors.shape[:-1], self.polys.dim)

    def self_check(self, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        vectors = self.random(generator, 7, 3)
        return self(vectors), self.original[0](vectors)

    def extra_repr(self) -> str:
        return f"{self.irreps_out}, by cgforge's kernel"


def stand_in_for(where: str, module: torch.nn.Module) -> KernelHarmonics | None:
    """The kernel's stand-in for the e3nn harmonics ``module`` at ``where``, or None (e3nn's module stays: the
    reason is logged) where the kernel cannot compute it."""
    try:
        return KernelHarmonics(module)
    except ValueError as err:
        log.info("cgforge: %s keeps e3nn's spherical harmonics: %s", where, err)
        return None
