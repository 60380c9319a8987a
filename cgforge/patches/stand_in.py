"""One protocol for every module cgforge swaps into a model, one walker, one self-check policy.

A ``StandIn`` holds the original's tensors under their names (its state_dict is the original's), keeps the
original in ``original`` (not a submodule), gives it back with its current tensors (``restore``) and compares
itself with it on a small random input (``self_check``). ``checked`` refuses, with a warning, a candidate that
differs (beyond 1e-10 in float64, 1e-4 in float32, relative) or raises. ``swap_in`` makes every candidate before
changing anything, then checks and swaps; ``swap_out`` restores.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from .torch_internals import give_back, replace_child

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4}
CHECK_SEED = 0  # the self-check's inputs come from their own generator: the global RNG is left alone


class StandIn:
    """Mixin of every stand-in module (see the module docstring). Subclasses set ``self.original = (module,)``
    and implement ``self_check``; ``restore`` is the same for all."""

    original: tuple[torch.nn.Module]

    def restore(self) -> torch.nn.Module:
        """The original module, given the tensors as moved/converted since patching."""
        (original,) = self.original
        return give_back(self, original)

    def self_check(self, generator: torch.Generator) -> tuple[Any, Any]:
        """(this module's output, the original's output) on a small random input drawn from ``generator``."""
        raise NotImplementedError(f"{type(self).__name__} must implement self_check")

    def check_placement(self) -> tuple[torch.device, torch.dtype]:
        """Where the self-check's inputs live: the device and floating dtype of the original's tensors."""
        (original,) = self.original
        tensors = [t for t in (*original.parameters(), *original.buffers()) if t.is_floating_point()]
        if not tensors:
            return torch.device("cpu"), torch.get_default_dtype()
        return tensors[0].device, tensors[0].dtype

    def random(self, generator: torch.Generator, *shape: int) -> torch.Tensor:
        """Standard-normal values (drawn in float64 on the CPU, the same on every device) where the original lives."""
        device, dtype = self.check_placement()
        return torch.randn(*shape, generator=generator, dtype=torch.float64).to(device=device, dtype=dtype)


def convolution_check(stand_in: StandIn, generator: torch.Generator, conv: Any, tp: torch.nn.Module
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``self_check`` of a fused convolution (MACE's ``FusedConvTP``, NequIP's scatter): ``conv`` on a random
    graph of 5 nodes and 9 edges, against the e3nn TensorProduct ``tp`` per edge summed per receiver."""
    from cgforge.kernels import ConvGraph

    num_nodes, num_edges = 5, 9
    x = stand_in.random(generator, num_nodes, tp.irreps_in1.dim)
    sender, receiver = torch.randint(0, num_nodes, (2, num_edges), generator=generator).to(x.device)
    attrs = stand_in.random(generator, num_edges, tp.irreps_in2.dim)
    weights = stand_in.random(generator, num_edges, tp.weight_numel)
    want = x.new_zeros(num_nodes, tp.irreps_out.dim).index_add_(0, receiver, tp(x[sender], attrs, weights))
    return conv(x, attrs, weights, ConvGraph(sender, receiver, num_nodes)), want


def _mismatch(got: Any, want: Any, dtype: torch.dtype) -> str | None:
    """Why ``got`` differs from ``want`` (tensors or tuples of them), or None."""
    if isinstance(want, (tuple, list)):
        if not isinstance(got, (tuple, list)) or len(got) != len(want):
            return f"returns {type(got).__name__} where the original returns {len(want)} outputs"
        return next((m for g, w in zip(got, want) if (m := _mismatch(g, w, dtype)) is not None), None)
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        shape = list(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        return f"output shape {shape}, the original's {list(want.shape)}"
    tol = TOLERANCE.get(dtype, 1e-4)
    scale = float(want.abs().max()) if want.numel() else 0.0
    diff = float((got - want).abs().max()) if want.numel() else 0.0
    if not diff <= tol * max(scale, 1.0):  # `not <=`: a NaN is a mismatch
        return f"output differs by {diff:.3g} (largest value {scale:.3g}, tolerance {tol:g} relative)"
    return None


def checked(stand_in: StandIn, where: str = "") -> StandIn | None:
    """``stand_in`` if it computes what its original does on a small random input, else ``None`` with a
    warning naming the module (``where``: its path in the model) and the error: the caller keeps the original."""
    (original,) = stand_in.original
    name = f"{where} ({type(original).__name__})" if where else type(original).__name__
    generator = torch.Generator(device="cpu").manual_seed(CHECK_SEED)
    try:
        with torch.no_grad():
            got, want = stand_in.self_check(generator)
        error = _mismatch(got, want, stand_in.check_placement()[1])
    except Exception as err:  # noqa: BLE001 - any failure of the stand-in means: keep the original
        error = f"{type(err).__name__}: {err}"
    if error is None:
        return stand_in
    warnings.warn(f"cgforge: kept the original {name}: its stand-in {type(stand_in).__name__} failed the "
                  f"check at patch time: {error}", stacklevel=3)
    return None


Maker = Callable[[str, torch.nn.Module], "StandIn | None"]


def swap_in(model: torch.nn.Module, make: Maker) -> list[str]:
    """Replace each child ``c`` (at path ``p``) of every module of ``model`` for which ``make(p, c)`` returns a
    stand-in, once that stand-in passed ``checked``. All candidates are made before anything changes, so a
    maker that raises leaves the model as it was. Returns the paths replaced."""
    planned = []
    for parent_path, parent in model.named_modules():
        for name, child in parent.named_children():
            path = f"{parent_path}.{name}" if parent_path else name
            candidate = make(path, child)
            if candidate is not None:
                planned.append((path, parent, name, candidate))
    swapped = []
    for path, parent, name, candidate in planned:
        if checked(candidate, path) is not None:
            replace_child(parent, name, candidate)
            swapped.append(path)
    return swapped


def swap_out(model: torch.nn.Module, kinds: tuple[type, ...]) -> int:
    """Put the originals of the ``kinds`` stand-ins back (tensors as moved/converted since), in place; how many."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, kinds):
                replace_child(parent, name, child.restore())
                count += 1
    return count
