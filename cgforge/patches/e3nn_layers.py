"""Plain-torch stand-ins for two e3nn layers whose autograd costs more memory traffic than their math, computed from
the e3nn module's own parameters and buffers (the same state_dict); the original is kept for ``restore``.

- ``SplitLinear`` for ``o3.Linear``: the input ``split`` once (e3nn's ``narrow`` per irrep makes a zero-filled
  full-width gradient each). With frozen weights on CUDA, maps of up to
  ``kernel_max_channels`` channels a block run as the ``irreps_linear`` kernel; wide inputs of many rows are
  mapped in row chunks (``_RowChunkedMap``, ``KernelTuning.rows``).
- ``FoldedMLP`` for ``e3nn.nn.FullyConnectedNet``: the activations' two scale factors folded into the next
  layer's weights, so only the GEMMs and the bare activations touch edge-sized tensors.

``wrap`` returns ``None`` (keep the e3nn module) for a layer it does not handle or whose stand-in fails
``stand_in.checked``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from cgforge.kernels import KernelTuning, RowPolicy
from cgforge.kernels.irreps_linear import IrrepsMap, LinearLaunch, apply_map, tile_rows, transpose_blocks

from . import stand_in
from .radial_precision import radial_matmul
from .stand_in import StandIn, checked
from .torch_internals import adopt, tensor_version

DEFAULT_KERNEL_MAX_CHANNELS = KernelTuning().linear_kernel_max_channels
DEFAULT_ROWS = RowPolicy()  # when frozen maps run in row chunks: ``KernelTuning.rows``


class _RowChunkedMap(torch.autograd.Function):
    """``layer``'s linear map (or its transpose) of ``x``, chunk by chunk of rows into one output; its backward is
    the transposed map (frozen weights), again row-chunked: differentiable to any order."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: SplitLinear, transpose: bool, rows: int) -> torch.Tensor:
        ctx.layer, ctx.transpose, ctx.rows = layer, transpose, rows
        width = sum(layer.in_dims if transpose else layer.out_dims)
        out = x.new_empty(x.shape[0], width)
        for start in range(0, x.shape[0], rows):
            layer.map_into(x[start:start + rows], out[start:start + rows], transpose)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN205
        return _RowChunkedMap.apply(grad, ctx.layer, not ctx.transpose, ctx.rows), None, None, None


class SplitLinear(torch.nn.Module, StandIn):
    """``o3.Linear`` with shared internal weights and no biases, its input split once."""

    # (weight's identity and version, [path weight * block]): map_into's cache, replaced (never mutated); a class
    # default, so models patched and pickled before it existed read it too
    _scaled: tuple = ((), [])
    # (key, (IrrepsMap, forward launch, backward launch)): the irreps_linear kernel's plan, replaced per weight version
    _kernel_plan: tuple = ((), None)

    kernel_max_channels = DEFAULT_KERNEL_MAX_CHANNELS  # the class's: modules pickled before it was an attribute
    rows = DEFAULT_ROWS  # likewise

    def __init__(self, linear: torch.nn.Module, kernel_max_channels: int = DEFAULT_KERNEL_MAX_CHANNELS,
                 rows: RowPolicy = DEFAULT_ROWS) -> None:
        super().__init__()
        adopt(self, linear)
        self.kernel_max_channels = int(kernel_max_channels)
        self.rows = rows
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
    def wrap(cls, linear: torch.nn.Module, where: str = "", kernel_max_channels: int = DEFAULT_KERNEL_MAX_CHANNELS,
             rows: RowPolicy = DEFAULT_ROWS) -> SplitLinear | None:
        return checked(cls(linear, kernel_max_channels, rows), where) if cls.supports(linear) else None

    def self_check(self, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.random(generator, 7, sum(self.in_dims))
        return self(x), self.original[0](x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch_shape = x.shape[:-1]
        x = x.reshape(-1, x.shape[-1])
        plan = self.kernel_plan(x)
        if plan is not None:
            m, forward, backward = plan
            out = apply_map(x, m, [forward._replace(count=x.shape[0])], [backward._replace(count=x.shape[0])])
        else:
            rows = self.chunk_rows(x)
            out = self._map(x) if rows is None else _RowChunkedMap.apply(x, self, False, rows)
        return out.reshape(*batch_shape, out.shape[-1])

    def __getstate__(self) -> dict:
        """The module's state without the kernel's plan (remade on first use: pickles name no more classes)."""
        state = dict(super().__getstate__())
        state.pop("_kernel_plan", None)
        return state

    def frozen(self) -> bool:
        """Whether this call needs no weight gradient and torch.compile is not tracing it."""
        return not (self.weight.requires_grad and torch.is_grad_enabled()) and not torch.compiler.is_compiling()

    def irreps_map(self) -> IrrepsMap:
        """The map's shape for the irreps_linear kernel (its blocks: ``_scaled_blocks`` end to end)."""
        return IrrepsMap.of(self.irreps_in, self.irreps_out, self.paths)

    def kernel_plan(self, x: torch.Tensor) -> tuple[IrrepsMap, LinearLaunch, LinearLaunch] | None:
        """The irreps_linear kernel's map and launches (rows to be set) for ``x`` [rows, dim], or None where the
        map runs as GEMMs (off CUDA, not ``frozen``, maps or dtypes the kernel does not take)."""
        if x.device.type != "cuda" or not self.frozen():
            return None
        w = self.weight
        key = (w.data_ptr(), tensor_version(w), w.dtype, x.dtype, x.device)
        if self._kernel_plan[0] != key:
            self._kernel_plan = (key, self.build_kernel_plan(x.dtype, x.device))
        return self._kernel_plan[1]

    def build_kernel_plan(self, dtype: torch.dtype, device: torch.device
                          ) -> tuple[IrrepsMap, LinearLaunch, LinearLaunch] | None:
        """``kernel_plan``'s value for the current weights, made on any device (tests check it on the CPU)."""
        m = self.irreps_map()
        if m.widest_block > self.kernel_max_channels or tile_rows(m, dtype) is None:
            return None
        with torch.no_grad():
            blocks = torch.cat([b.reshape(-1) for b in self._scaled_blocks()]).to(device=device, dtype=dtype)
        t = m.transpose()
        return (m, LinearLaunch(m.arrays(device), blocks, None, 0),
                LinearLaunch(t.arrays(device), transpose_blocks(m, blocks), None, 0))

    def chunk_rows(self, x: torch.Tensor) -> int | None:
        """Rows per ``map_into`` chunk for ``x`` [rows, dim] by ``self.rows`` (None: ``_map``, all rows with
        autograd), only where ``frozen`` (a weight gradient needs every row; Inductor plans its own memory)."""
        row_bytes = max(sum(self.in_dims), sum(self.out_dims)) * x.element_size()
        total, rows = x.shape[0] * row_bytes, self.rows
        if total < rows.map_into_above_bytes or not self.frozen():
            return None
        return max(x.shape[0], 1) if total <= rows.chunked_above_bytes else max(rows.chunk_bytes // row_bytes, 1)

    def _map(self, x: torch.Tensor, transpose: bool = False) -> torch.Tensor:
        """The map of ``x`` [rows, dim in] (or, ``transpose``, its transpose: [rows, dim out] -> [rows, dim in])."""
        in_dims, out_dims = (self.out_dims, self.in_dims) if transpose else (self.in_dims, self.out_dims)
        pieces = x.split(in_dims, dim=-1) if len(in_dims) > 1 else (x,)
        outs: list[torch.Tensor | None] = [None] * len(out_dims)
        blocks = self._scaled_blocks() if self.frozen() else [None] * len(self.paths)  # None: scaled below, in autograd
        for (i_in, i_out, offset, mul_in, mul_out, path_weight), block in zip(self.paths, blocks, strict=True):
            w = block if block is not None else (
                self.weight.narrow(0, offset, mul_in * mul_out).view(mul_in, mul_out) * path_weight)
            if transpose:
                i_in, i_out, mul_in, mul_out, w = i_out, i_in, mul_out, mul_in, w.t()
            y = path_matmul(pieces[i_in], mul_in, w, mul_out)
            outs[i_out] = y if outs[i_out] is None else outs[i_out] + y
        return cat_irreps(outs, out_dims, x)

    @property
    def out_width(self) -> int:
        """Width of the output rows (``map_into``'s)."""
        return sum(self.out_dims)

    def _scaled_blocks(self) -> list[torch.Tensor]:
        """Each path's [mul_in, mul_out] block times its path weight, made once per weight version."""
        w = self.weight
        key = (w.data_ptr(), tensor_version(w), w.dtype, w.device)
        if self._scaled[0] != key:
            with torch.no_grad():
                blocks = [w.narrow(0, offset, mul_in * mul_out).view(mul_in, mul_out) * path_weight
                          for _, _, offset, mul_in, mul_out, path_weight in self.paths]
            self._scaled = (key, blocks)
        return self._scaled[1]

    def map_into(self, x: torch.Tensor, out: torch.Tensor, transpose: bool = False) -> None:
        """``out[:] = _map(x, transpose)`` without autograd, written into ``out`` [rows, width] (rows of a wider
        tensor may do): scalar irreps by GEMMs in ``out``'s columns, l > 0 ones through component-major ``Segments``."""
        in_dims, out_dims = (self.out_dims, self.in_dims) if transpose else (self.in_dims, self.out_dims)
        if x.dim() != 2 or out.dim() != 2 or x.shape[1] != sum(in_dims) or out.shape != (x.shape[0], sum(out_dims)):
            raise ValueError(f"map_into: x {tuple(x.shape)} and out {tuple(out.shape)} for a map "
                             f"{sum(in_dims)} -> {sum(out_dims)} wide")
        rows = x.shape[0]
        paths = [(i_out, i_in, mul_out, mul_in, w.t()) if transpose else (i_in, i_out, mul_in, mul_out, w)
                 for (i_in, i_out, _, mul_in, mul_out, _), w in zip(self.paths, self._scaled_blocks(), strict=True)]
        in_segments, in_slot = _vector_segments(in_dims, [(i, m) for i, _, m, _, _ in paths])
        out_segments, out_slot = _vector_segments(out_dims, [(o, m) for _, o, _, m, _ in paths])
        out_starts = [sum(out_dims[:i]) for i in range(len(out_dims))]
        written: set[int] = set()  # output irreps (scalar or segment) summed so far
        with torch.no_grad():
            _, xs = to_segments(x, in_segments)
            partial = x.new_empty(rows * out_segments.width)
            ys = out_segments.views(partial, rows)
            for i_in, i_out, _, _, w in paths:
                if i_in not in in_slot:  # strided rows on both sides: the GEMM reads x's and writes out's columns
                    xi = x.narrow(1, sum(in_dims[:i_in]), in_dims[i_in])
                    target = out.narrow(1, out_starts[i_out], out_dims[i_out])
                    target.addmm_(xi, w, beta=1 if i_out in written else 0)  # beta 0: out's old values unread
                elif i_out in written:
                    ys[out_slot[i_out]].addmm_(xs[in_slot[i_in]], w)
                else:
                    torch.mm(xs[in_slot[i_in]], w, out=ys[out_slot[i_out]])
                written.add(i_out)
            from_segments(partial, out_segments, out)
            for i_out, width in enumerate(out_dims):
                if i_out not in written:
                    out.narrow(1, out_starts[i_out], width).zero_()

    def extra_repr(self) -> str:
        return f"{self.irreps_in} -> {self.irreps_out}, {len(self.paths)} paths"


class FoldedMLP(torch.nn.Module, StandIn):
    """``e3nn.nn.FullyConnectedNet`` with the activations' scale factors folded into the next weights.
    ``precision``: how its products run (``radial_precision.MODES``)."""

    precision = "fp32"  # a class default: models pickled before the attribute existed read it too

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        adopt(self, net, children=True)  # layer0, layer1, ...: the same state_dict keys
        self.hs = list(net.hs)
        self.original = (net,)

    @classmethod
    def supports(cls, net: torch.nn.Module) -> bool:
        layers = list(net.children())
        return bool(layers) and all(
            {"weight"} == {n for n, _ in layer.named_parameters()}
            and all(hasattr(layer, a) for a in ("h_in", "var_in", "var_out", "act"))
            for layer in layers
        )

    @classmethod
    def wrap(cls, net: torch.nn.Module, where: str = "") -> FoldedMLP | None:
        return checked(cls(net), where) if cls.supports(net) else None

    def self_check(self, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.random(generator, 7, self.hs[0])
        return self(x), self.original[0](x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 1.0  # the previous activation's output scale, not yet applied
        for layer in self.children():
            f, cst = bare_activation(layer.act)
            if f is None:
                w = layer.weight * (scale / math.sqrt(layer.h_in * layer.var_in / layer.var_out))
                x, scale = radial_matmul(x, w, self.precision), 1.0
            else:
                w = layer.weight * (scale / math.sqrt(layer.h_in * layer.var_in))
                x, scale = f(radial_matmul(x, w, self.precision)), cst * math.sqrt(layer.var_out)
        return x * scale if scale != 1.0 else x

    def extra_repr(self) -> str:
        return f"hs={self.hs}, activation scales folded"


def swap_in(model: torch.nn.Module, kernel_max_channels: int = DEFAULT_KERNEL_MAX_CHANNELS,
            rows: RowPolicy = DEFAULT_ROWS) -> int:
    """Replace every e3nn ``o3.Linear`` and ``FullyConnectedNet`` in ``model`` by its checked stand-in, in place
    (``kernel_max_channels``, ``rows``: ``KernelTuning``'s); returns how many."""
    from e3nn import o3
    from e3nn.nn import FullyConnectedNet

    def make(where: str, child: torch.nn.Module) -> StandIn | None:
        if isinstance(child, o3.Linear) and SplitLinear.supports(child):
            return SplitLinear(child, kernel_max_channels, rows)
        if isinstance(child, FullyConnectedNet) and FoldedMLP.supports(child):
            return FoldedMLP(child)
        return None

    return len(stand_in.swap_in(model, make))


def swap_out(model: torch.nn.Module, kinds: tuple[type, ...] = (SplitLinear, FoldedMLP)) -> int:
    """Put the e3nn originals of the ``kinds`` stand-ins back. In place; returns how many."""
    return stand_in.swap_out(model, kinds)


def bare_activation(act: Any) -> tuple[Any, float]:
    """(bare function, its output scale) of e3nn's ``normalize2mom(f)`` (or of a plain function or None)."""
    if act is not None and hasattr(act, "f") and hasattr(act, "cst"):
        return act.f, 1.0 if getattr(act, "_is_id", False) else float(act.cst)
    return act, 1.0


def path_matmul(piece: torch.Tensor, mul_in: int, w: torch.Tensor, mul_out: int) -> torch.Tensor:
    """``piece`` [rows, mul_in * dim] (an irrep, channel outermost) times the [mul_in, mul_out] block ``w`` per
    component: [rows, mul_out * dim]."""
    rows = piece.shape[0]
    xi = piece.reshape(rows, mul_in, -1)
    if xi.shape[2] == 1:
        return xi.reshape(rows, mul_in) @ w
    dim = xi.shape[2]  # [z, u, i] -> [z*i, u] @ [u, w] -> [z, w, i]: one GEMM, as e3nn's optimised einsum
    y = (xi.transpose(1, 2).reshape(-1, mul_in) @ w).reshape(rows, dim, mul_out)
    return y.transpose(1, 2).reshape(rows, mul_out * dim)


def cat_irreps(outs: list[torch.Tensor | None], dims: list[int], like: torch.Tensor) -> torch.Tensor:
    """The irreps ``outs`` side by side, zeros ([rows, dim] of ``like``'s rows) for those never written (None)."""
    return torch.cat([o if o is not None else like.new_zeros(like.shape[0], d) for o, d in zip(outs, dims)], dim=-1)


@dataclass(frozen=True)
class Segments:
    """Irrep blocks of one side of a map, each (first column, mul, 2l + 1), as component-major segments: for
    ``rows`` rows, block k's [rows * (2l + 1), mul] matrix (what a GEMM over its channels reads) starts at element
    ``rows * offsets[k]`` of one buffer of ``rows * width`` values."""

    blocks: tuple[tuple[int, int, int], ...]

    @property
    def offsets(self) -> tuple[int, ...]:
        at, out = 0, []
        for _, m, d in self.blocks:
            out.append(at)
            at += m * d
        return tuple(out)

    @property
    def width(self) -> int:
        return sum(m * d for _, m, d in self.blocks)

    def views(self, buffer: torch.Tensor, rows: int) -> list[torch.Tensor]:
        """Each block's [rows * (2l + 1), mul] matrix in ``buffer`` [rows * width]."""
        return [buffer.narrow(0, rows * o, rows * m * d).view(rows * d, m)
                for (_, m, d), o in zip(self.blocks, self.offsets, strict=True)]


def to_segments(x: torch.Tensor, segments: Segments) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``x`` [rows, width] (rows may be strided) -> (buffer, ``segments.views``): each block transposed to [rows *
    (2l + 1), mul], one copy a block."""
    rows = x.shape[0]
    buffer = x.new_empty(rows * segments.width)
    views = segments.views(buffer, rows)
    for (c, m, d), v in zip(segments.blocks, views, strict=True):
        v.view(rows, d, m).copy_(x.narrow(1, c, m * d).view(rows, m, d).transpose(1, 2))
    return buffer, views


def from_segments(buffer: torch.Tensor, segments: Segments, out: torch.Tensor) -> None:
    """Write ``buffer``'s segments into ``out`` [rows, width]'s columns (e3nn's layout; rows may be strided)."""
    rows = out.shape[0]
    for (c, m, d), v in zip(segments.blocks, segments.views(buffer, rows), strict=True):
        out.narrow(1, c, m * d).view(rows, m, d).copy_(v.view(rows, d, m).transpose(1, 2))


def _vector_segments(dims: list[int], used: list[tuple[int, int]]) -> tuple[Segments, dict[int, int]]:
    """The ``Segments`` of the l > 0 irreps among ``used`` (index, mul) of a side ``dims`` wide each, each once,
    in order, and each one's slot in them."""
    starts = [sum(dims[:i]) for i in range(len(dims))]
    vectors = sorted({(i, m) for i, m in used if dims[i] != m})
    return (Segments(tuple((starts[i], m, dims[i] // m) for i, m in vectors)),
            {i: slot for slot, (i, _) in enumerate(vectors)})
