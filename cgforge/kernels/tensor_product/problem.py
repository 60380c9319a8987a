"""The tensor-product problem: irreps, instructions and normalisation, as plain values.

Conventions are e3nn's exactly (`o3.TensorProduct`): mul_ir layout, weights flattened per
instruction in instruction order with shape `path_shape`, and each instruction's coefficient
(`path_weight`) already holding the irrep and path normalisation, as e3nn stores it.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import sqrt
from typing import Any

from e3nn import o3

from ..core.errors import UnsupportedProblemError
from ..core.offsets import running_offsets

SUPPORTED_MODES = ("uvu", "uvw")
MAX_L = 6


@dataclass(frozen=True)
class Instruction:
    """One path in1[i_in1] x in2[i_in2] -> out[i_out]; `path_weight` includes all normalisation."""

    i_in1: int
    i_in2: int
    i_out: int
    mode: str
    has_weight: bool
    path_weight: float
    path_shape: tuple[int, ...]

    @property
    def weight_numel(self) -> int:
        n = 1
        for s in self.path_shape:
            n *= s
        return n if self.has_weight else 0


@dataclass(frozen=True)
class TPProblem:
    irreps_in1: o3.Irreps
    irreps_in2: o3.Irreps
    irreps_out: o3.Irreps
    instructions: tuple[Instruction, ...]
    shared_weights: bool = False

    @property
    def weight_numel(self) -> int:
        return sum(ins.weight_numel for ins in self.instructions)

    @property
    def weight_offsets(self) -> tuple[int, ...]:
        return running_offsets(ins.weight_numel for ins in self.instructions)

    def key(self) -> str:
        """A stable text identity of the problem (used to name ops' problem registry entries)."""
        ins = ";".join(f"{i.i_in1},{i.i_in2},{i.i_out},{i.mode},{int(i.has_weight)},{i.path_weight!r}"
                       for i in self.instructions)
        return f"{self.irreps_in1}|{self.irreps_in2}|{self.irreps_out}|{ins}|{int(self.shared_weights)}"

    @classmethod
    def from_e3nn(cls, tp: Any) -> TPProblem:
        """Read an `e3nn.o3.TensorProduct` instance (its instructions hold the final path weights)."""
        if not hasattr(tp, "instructions") or not hasattr(tp, "irreps_in1"):
            raise TypeError(f"expected an e3nn o3.TensorProduct, got {type(tp).__name__}")
        instructions = tuple(Instruction(int(i.i_in1), int(i.i_in2), int(i.i_out), str(i.connection_mode),
                                         bool(i.has_weight), float(i.path_weight), tuple(int(s) for s in i.path_shape))
                             for i in tp.instructions)
        problem = cls(o3.Irreps(tp.irreps_in1), o3.Irreps(tp.irreps_in2), o3.Irreps(tp.irreps_out), instructions,
                      bool(tp.shared_weights))
        problem.validate()
        return problem

    @classmethod
    def build(cls, irreps_in1: Any, irreps_in2: Any, irreps_out: Any, instructions: list, shared_weights: bool = False,
              irrep_normalization: str = "component", path_normalization: str = "element") -> TPProblem:
        """Same arguments as `o3.TensorProduct`; normalisation computed as e3nn does."""
        irreps_in1, irreps_in2, irreps_out = (_irreps(a, n) for a, n in (
            (irreps_in1, "irreps_in1"), (irreps_in2, "irreps_in2"), (irreps_out, "irreps_out")))
        if irrep_normalization not in ("component", "norm", "none"):
            raise ValueError(f"irrep_normalization must be 'component', 'norm' or 'none', got {irrep_normalization!r}")
        if path_normalization not in ("element", "path", "none"):
            raise ValueError(f"path_normalization must be 'element', 'path' or 'none', got {path_normalization!r}")
        raw = []
        for k, ins in enumerate(instructions):
            if len(ins) not in (5, 6):
                raise ValueError(f"instruction {k} must be (i_in1, i_in2, i_out, mode, has_weight[, path_weight]), "
                                 f"got {ins!r}")
            i1, i2, io, mode, has_weight = ins[:5]
            weight = float(ins[5]) if len(ins) == 6 else 1.0
            if mode not in SUPPORTED_MODES:
                raise ValueError(f"instruction {k}: connection mode {mode!r} is not supported "
                                 f"(supported: {', '.join(SUPPORTED_MODES)})")
            for idx, irreps, name in ((i1, irreps_in1, "i_in1"), (i2, irreps_in2, "i_in2"), (io, irreps_out, "i_out")):
                if not 0 <= int(idx) < len(irreps):
                    raise ValueError(f"instruction {k}: {name}={idx} out of range for {len(irreps)} irreps")
            m1, m2, mo = irreps_in1[i1].mul, irreps_in2[i2].mul, irreps_out[io].mul
            shape = (m1, m2, mo) if mode == "uvw" else (m1, m2)
            raw.append((int(i1), int(i2), int(io), mode, bool(has_weight), weight, shape))

        def num_elements(r: tuple) -> int:
            return irreps_in1[r[0]].mul * irreps_in2[r[1]].mul if r[3] == "uvw" else irreps_in2[r[1]].mul

        final = []
        for r in raw:
            ir1, ir2, iro = irreps_in1[r[0]].ir, irreps_in2[r[1]].ir, irreps_out[r[2]].ir
            alpha = {"component": iro.dim, "norm": ir1.dim * ir2.dim, "none": 1}[irrep_normalization]
            if path_normalization == "element":
                x = sum(num_elements(s) for s in raw if s[2] == r[2])
            elif path_normalization == "path":
                x = num_elements(r) * sum(1 for s in raw if s[2] == r[2])  # as e3nn: paths into this output
            else:
                x = 1
            if x > 0:
                alpha /= x
            alpha *= r[5]
            final.append(Instruction(r[0], r[1], r[2], r[3], r[4], sqrt(alpha), r[6]))
        problem = cls(irreps_in1, irreps_in2, irreps_out, tuple(final), bool(shared_weights))
        problem.validate()
        return problem

    def validate(self) -> None:
        """Raise UnsupportedProblemError (a ValueError) naming the first thing this project's kernels cannot do."""
        for irreps, name in ((self.irreps_in1, "irreps_in1"), (self.irreps_in2, "irreps_in2"),
                             (self.irreps_out, "irreps_out")):
            for mul, ir in irreps:
                if ir.l > MAX_L:
                    raise UnsupportedProblemError(f"{name} contains {mul}x{ir}: l={ir.l} exceeds the supported "
                                                  f"maximum l={MAX_L}")
        for k, ins in enumerate(self.instructions):
            if ins.mode not in SUPPORTED_MODES:
                raise UnsupportedProblemError(f"instruction {k}: connection mode {ins.mode!r} is not supported "
                                 f"(supported: {', '.join(SUPPORTED_MODES)})")
            mi1, mi2, mo = self.irreps_in1[ins.i_in1], self.irreps_in2[ins.i_in2], self.irreps_out[ins.i_out]
            if mi1.ir.p * mi2.ir.p != mo.ir.p or not abs(mi1.ir.l - mi2.ir.l) <= mo.ir.l <= mi1.ir.l + mi2.ir.l:
                raise UnsupportedProblemError(f"instruction {k}: {mi1.ir} x {mi2.ir} cannot produce {mo.ir} "
                                              "(selection rule)")
            if ins.mode == "uvu" and mi1.mul != mo.mul:
                raise UnsupportedProblemError(f"instruction {k}: mode 'uvu' needs in1 multiplicity {mi1.mul} == out "
                                 f"multiplicity {mo.mul}")
            if ins.mode == "uvw" and not ins.has_weight:
                raise UnsupportedProblemError(f"instruction {k}: mode 'uvw' needs a weight (has_weight=True)")


def _irreps(value: Any, name: str) -> o3.Irreps:
    try:
        return o3.Irreps(value)
    except Exception as exc:  # e3nn raises several types for a bad string
        raise ValueError(f"{name}: cannot parse {value!r} as irreps ({exc})") from exc
