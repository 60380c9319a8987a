"""Plain-torch stand-ins for two e3nn layers whose autograd costs more memory traffic than their math.

Both compute what the e3nn module computes, from the e3nn module's own parameters and buffers (same
names, so the state_dict is unchanged), and keep the original for ``restore``.

- ``SplitLinear`` for ``o3.Linear``: e3nn's generated code takes each input irrep with ``narrow``, and
  autograd turns every ``narrow`` into a zero-filled full-width gradient plus one full-width ``add_`` per
  extra irrep. After MACE's convolution (10 irreps, [5184, 5120]) that is ~1.4 ms of an H100 step. One
  ``split`` has a single backward (a ``cat``).
- ``FoldedMLP`` for ``e3nn.nn.FullyConnectedNet`` (MACE's radial MLP): e3nn scales every hidden
  activation twice (the normalising constant of ``normalize2mom`` and ``sqrt(var_out)``), each a full pass
  over a [num_edges, width] tensor forward and backward. Those constants fold into the next layer's
  (tiny) weight matrix: only the GEMMs and the bare activation touch edge-sized tensors.

``wrap`` checks the stand-in against the original on a small random input and returns ``None`` (the
caller keeps the e3nn module) if the layer has a feature not handled here or the numbers differ.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from . import stand_in
from .radial_precision import radial_matmul
from .stand_in import restore_original


class SplitLinear(torch.nn.Module):
    """``o3.Linear`` with shared internal weights and no biases, its input split once."""

    def __init__(self, linear: torch.nn.Module) -> None:
        super().__init__()
        for name, param in linear.named_parameters(recurse=False):
            self.register_parameter(name, param)
        for name, buf in linear.named_buffers(recurse=False):
            self.register_buffer(name, buf, persistent=name not in linear._non_persistent_buffers_set)
        self.irreps_in, self.irreps_out = linear.irreps_in, linear.irreps_out
        self.in_dims = [mul_ir.dim for mul_ir in self.irreps_in]
        self.out_dims = [mul_ir.dim for mul_ir in self.irreps_out]
        # (i_in, i_out, weight offset, mul_in, mul_out, path weight) per instruction with weights
        self.paths: list[tuple[int, int, int, int, int, float]] = []
        offset = 0
        for ins in linear.instructions:
            mul_in, mul_out = ins.path_shape
            if mul_in * mul_out == 0:
                continue
            self.paths.append((ins.i_in, ins.i_out, offset, mul_in, mul_out, float(ins.path_weight)))
            offset += mul_in * mul_out
        self.original = (linear,)  # a tuple: not a submodule, not in the state_dict

    @classmethod
    def supports(cls, linear: torch.nn.Module) -> bool:
        return (
            getattr(linear, "f_in", None) is None
            and getattr(linear, "f_out", None) is None
            and getattr(linear, "internal_weights", False)
            and getattr(linear, "shared_weights", False)
            and all(ins.i_in >= 0 for ins in linear.instructions)
            and linear.weight.dim() == 1
            and sum(m.dim for m in linear.irreps_in) > 0
        )

    @classmethod
    def wrap(cls, linear: torch.nn.Module) -> SplitLinear | None:
        if not cls.supports(linear):
            return None
        stand_in = cls(linear)
        return _checked(stand_in, linear, sum(stand_in.in_dims))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch_shape = x.shape[:-1]
        x = x.reshape(-1, x.shape[-1])
        pieces = x.split(self.in_dims, dim=-1) if len(self.in_dims) > 1 else (x,)
        outs: list[torch.Tensor | None] = [None] * len(self.out_dims)
        for i_in, i_out, offset, mul_in, mul_out, path_weight in self.paths:
            w = self.weight.narrow(0, offset, mul_in * mul_out).view(mul_in, mul_out) * path_weight
            xi = pieces[i_in].reshape(x.shape[0], mul_in, -1)
            if xi.shape[2] == 1:
                y = xi.reshape(x.shape[0], mul_in) @ w
            else:  # [z, u, i] -> [z*i, u] @ [u, w] -> [z, w, i]: one GEMM, as e3nn's optimised einsum
                dim = xi.shape[2]
                y = (xi.transpose(1, 2).reshape(-1, mul_in) @ w).reshape(x.shape[0], dim, mul_out)
                y = y.transpose(1, 2).reshape(x.shape[0], mul_out * dim)
            outs[i_out] = y if outs[i_out] is None else outs[i_out] + y
        out = torch.cat(
            [o if o is not None else x.new_zeros(x.shape[0], d) for o, d in zip(outs, self.out_dims)], dim=-1
        )
        return out.reshape(*batch_shape, out.shape[-1])

    def restore(self) -> torch.nn.Module:
        return restore_original(self)

    def extra_repr(self) -> str:
        return f"{self.irreps_in} -> {self.irreps_out}, {len(self.paths)} paths"


class FoldedMLP(torch.nn.Module):
    """``e3nn.nn.FullyConnectedNet`` with the activations' scale factors folded into the next weights.

    ``precision``: how its products run (``radial_precision.MODES``; FP32 unless asked for)."""

    precision = "fp32"  # a class default: models pickled before the attribute existed read it too

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        for name, layer in net.named_children():  # layer0, layer1, ...: the same state_dict keys
            self.add_module(name, layer)
        self.hs = list(net.hs)
        self.original = (net,)

    @staticmethod
    def _activation(act: Any) -> tuple[Any, float]:
        """(bare function, its output scale) of e3nn's ``normalize2mom(f)`` (or of a plain function)."""
        if act is None:
            return None, 1.0
        if hasattr(act, "f") and hasattr(act, "cst"):
            return act.f, 1.0 if getattr(act, "_is_id", False) else float(act.cst)
        return act, 1.0

    @classmethod
    def supports(cls, net: torch.nn.Module) -> bool:
        layers = list(net.children())
        return bool(layers) and all(
            {"weight"} == {n for n, _ in layer.named_parameters()}
            and all(hasattr(layer, a) for a in ("h_in", "var_in", "var_out", "act"))
            for layer in layers
        )

    @classmethod
    def wrap(cls, net: torch.nn.Module) -> FoldedMLP | None:
        if not cls.supports(net):
            return None
        return _checked(cls(net), net, net.hs[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 1.0  # the previous activation's output scale, not yet applied
        for layer in self.children():
            f, cst = self._activation(layer.act)
            if f is None:
                w = layer.weight * (scale / math.sqrt(layer.h_in * layer.var_in / layer.var_out))
                x, scale = radial_matmul(x, w, self.precision), 1.0
            else:
                w = layer.weight * (scale / math.sqrt(layer.h_in * layer.var_in))
                x, scale = f(radial_matmul(x, w, self.precision)), cst * math.sqrt(layer.var_out)
        return x * scale if scale != 1.0 else x

    def restore(self) -> torch.nn.Module:
        (net,) = self.original
        for name, layer in self.named_children():
            net._modules[name] = layer
        return net

    def extra_repr(self) -> str:
        return f"hs={self.hs}, activation scales folded"


def _checked(stand_in: torch.nn.Module, original: torch.nn.Module, width: int) -> torch.nn.Module | None:
    """``stand_in`` if it matches ``original`` on a random input, else ``None`` with a warning."""
    param = next(iter(original.parameters()), None)
    device = param.device if param is not None else torch.device("cpu")
    dtype = param.dtype if param is not None else torch.get_default_dtype()
    generator = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(7, width, generator=generator, dtype=torch.float64).to(device=device, dtype=dtype)
    with torch.no_grad():
        want, got = original(x), stand_in(x)
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    if got.shape == want.shape and torch.allclose(got, want, rtol=tol, atol=tol * float(want.abs().max().clamp(min=1))):
        return stand_in
    warnings.warn(
        f"cgforge: kept e3nn's {type(original).__name__} ({original}): the plain-torch stand-in differs from it",
        stacklevel=3,
    )
    return None


def swap_in(model: torch.nn.Module) -> int:
    """Replace every e3nn ``o3.Linear`` and ``FullyConnectedNet`` in ``model`` by its stand-in. In place.

    Returns how many were replaced; a layer whose stand-in is unsupported or differs stays as it is.
    """
    from e3nn import o3
    from e3nn.nn import FullyConnectedNet

    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, o3.Linear):
                stand_in = SplitLinear.wrap(child)
            elif isinstance(child, FullyConnectedNet):
                stand_in = FoldedMLP.wrap(child)
            else:
                continue
            if stand_in is not None:
                parent._modules[name] = stand_in
                count += 1
    return count


def swap_out(model: torch.nn.Module, kinds: tuple[type, ...] = (SplitLinear, FoldedMLP)) -> int:
    """Put the e3nn originals of the ``kinds`` stand-ins back. In place; returns how many."""
    return stand_in.swap_out(model, kinds)
