"""e3nn's ``Gate`` (NequIP's equivariant nonlinearity) as one kernel forward and one backward.

``FusedGate`` reads the layer off the e3nn module as a ``kernels.gate.GateTable`` (the extraction run on column
numbers, the elementwise product on unit vectors, each activation with e3nn's normalising constant). Activations
other than ``kernels.gate.ACTIVATIONS`` keep the e3nn module. The state_dict is the original's.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from cgforge.kernels.gate import ACTIVATIONS, GateArrays, GateTable, gate

from . import stand_in
from .e3nn_layers import bare_activation
from .stand_in import StandIn, checked
from .torch_internals import adopt

_ARRAYS = GateArrays._fields


def _activation_code(act: Any) -> tuple[int, float] | None:
    """(code in ACTIVATIONS, output scale) of one of e3nn's activations (``normalize2mom(f)``, a bare function or
    None: identity), or None where the kernels have no such function."""
    if act is None:
        return 0, 1.0
    f, scale = bare_activation(act)
    names = {torch.nn.functional.silu: "silu", torch.nn.SiLU: "silu", torch.tanh: "tanh",
             torch.nn.functional.tanh: "tanh", torch.nn.Tanh: "tanh", torch.sigmoid: "sigmoid",
             torch.nn.functional.sigmoid: "sigmoid", torch.nn.Sigmoid: "sigmoid"}
    name = names.get(f) or (names.get(type(f)) if isinstance(f, torch.nn.Module) else None)
    return None if name is None else (ACTIVATIONS.index(name), scale)


def _scalar_codes(activation: torch.nn.Module) -> list[tuple[int, float]] | None:
    """Per column of an e3nn ``Activation`` over scalars: (code, scale); None if one is not the kernels'."""
    columns = []
    for (mul, ir), act in zip(activation.irreps_in, activation.acts):
        code = _activation_code(act)
        if code is None or (ir.l != 0 and act is not None):
            return None
        columns += [code] * (mul * ir.dim)
    return columns


def gate_table(module: torch.nn.Module) -> GateTable | None:
    """The ``GateTable`` of an e3nn ``Gate``, or None where the kernels cannot evaluate it."""
    scalar_codes = _scalar_codes(module.act_scalars)
    gate_codes = _scalar_codes(module.act_gates)
    if scalar_codes is None or gate_codes is None:
        return None
    scalars, gates, gated = _extract(module)
    src, gate_col = list(scalars), [-1] * len(scalars)
    code, scale = [c for c, _ in scalar_codes], [s for _, s in scalar_codes]
    if gated:
        pairs = _gate_of_each_column(module, len(gates), len(gated))
        if pairs is None:
            return None
        for j, (k, factor) in enumerate(pairs):
            src.append(gated[j])
            gate_col.append(gates[k])
            code.append(gate_codes[k][0])
            scale.append(gate_codes[k][1] * factor)
    if not src:
        return None
    return GateTable(module.irreps_in.dim, tuple(src), tuple(gate_col), tuple(code), tuple(scale))


def _placement(module: torch.nn.Module) -> tuple[torch.device, torch.dtype]:
    """Where the module's floating tensors live (the CPU and torch's default dtype if it has none)."""
    tensors = [t for t in module.state_dict().values() if t.is_floating_point()]
    return (tensors[0].device, tensors[0].dtype) if tensors else (torch.device("cpu"), torch.get_default_dtype())


def _extract(module: torch.nn.Module) -> tuple[list[int], list[int], list[int]]:
    """The input column of each scalar, gate and gated value: the module's own extraction of the column numbers
    (exact in any float dtype for the widths of real layers)."""
    device, dtype = _placement(module)
    with torch.no_grad():
        columns = torch.arange(module.irreps_in.dim, device=device, dtype=dtype).unsqueeze(0)
        parts = module.sc(columns)
    return tuple(p.reshape(-1).round().long().tolist() for p in parts)


def _gate_of_each_column(module: torch.nn.Module, gates: int, gated: int) -> list[tuple[int, float]] | None:
    """(gate index, coefficient) of each gated column: a float64 copy of the elementwise product applied to
    all-ones gated values and each unit gate vector. None unless every column has exactly one gate."""
    product = copy.deepcopy(module.mul).to(device="cpu", dtype=torch.float64)
    with torch.no_grad():
        values = product(torch.ones(gates, gated, dtype=torch.float64), torch.eye(gates, dtype=torch.float64))
    nonzero = values != 0  # [gate k, column j]
    if not bool((nonzero.sum(0) == 1).all()):
        return None
    which = nonzero.int().argmax(0).tolist()
    return [(k, float(values[k, j])) for j, k in enumerate(which)]


class FusedGate(torch.nn.Module, StandIn):
    """e3nn ``Gate`` by cgforge's gate kernels (module doc): the same numbers and state_dict."""

    def __init__(self, module: torch.nn.Module, table: GateTable) -> None:
        super().__init__()
        adopt(self, module, children=True)
        self.irreps_in, self.irreps_out = module.irreps_in, module.irreps_out
        self.table = table
        for name, array in zip(_ARRAYS, table.arrays(*_placement(module))):
            self.register_buffer(f"gate_{name}", array, persistent=False)
        self.original = (module,)

    @classmethod
    def wrap(cls, module: torch.nn.Module, where: str = "") -> FusedGate | None:
        """A checked stand-in for ``module``, or None (the e3nn module stays)."""
        table = gate_table(module)
        return None if table is None else checked(cls(module, table), where)

    def arrays(self) -> GateArrays:
        return GateArrays(*(getattr(self, f"gate_{name}") for name in _ARRAYS))

    def self_check(self, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.random(generator, 7, self.irreps_in.dim) * 2
        return self(x), self.original[0](x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        arrays = self.arrays()
        if arrays.scale.dtype != x.dtype:
            arrays = arrays._replace(scale=arrays.scale.to(x.dtype))
        batch = x.shape[:-1]
        out = gate(x.reshape(-1, x.shape[-1]), arrays)
        return out.reshape(*batch, out.shape[-1])

    def extra_repr(self) -> str:
        return f"{self.irreps_in} -> {self.irreps_out}, one kernel each way"


def is_e3nn_gate(module: torch.nn.Module) -> bool:
    """Whether ``module`` is an e3nn ``Gate``: the installed e3nn's, or the copy a torch.package archive of a NequIP
    model carries (its own module path, the same class)."""
    cls = type(module)
    return cls.__name__ == "Gate" and cls.__module__.endswith("e3nn.nn._gate") and all(
        hasattr(module, a) for a in ("sc", "act_scalars", "act_gates", "mul", "irreps_in"))


def swap_in(model: torch.nn.Module) -> int:
    """Replace every e3nn ``Gate`` of ``model`` the kernels can evaluate by a ``FusedGate``, in place; how many."""
    def make(where: str, child: torch.nn.Module) -> StandIn | None:
        if not is_e3nn_gate(child):
            return None
        table = gate_table(child)
        return None if table is None else FusedGate(child, table)

    return len(stand_in.swap_in(model, make))


def swap_out(model: torch.nn.Module) -> int:
    """Put the e3nn originals of the ``FusedGate`` stand-ins back. In place; returns how many."""
    return stand_in.swap_out(model, (FusedGate,))
