"""The symmetric-contraction problem (a product basis) as plain values: for atom b (species e), channel c, output o

    out_o[b, c, M] = sum_{nu=1..corr} sum_k W_{o,nu}[e, k, c] * sum_{i1..inu} U_{o,nu}[M, i1..inu, k]
                     * x[b, c, i1] * ... * x[b, c, inu]

with x[b, c, :] one channel of the node features (dimension D) and U given by the caller.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import torch
from e3nn import o3

from ..core.offsets import running_offsets

MAX_CORRELATION = 4  # beyond this the U tensors (D**nu entries per column) get unreasonably large


@dataclass(frozen=True)
class SCProblem:
    """irreps_in: C x (each coupling irrep); irreps_out: C x (each output irrep); ``u[o][nu - 1]``: U of output o and
    degree nu, [d_o, D, ..., D (nu times), K_{o,nu}]; ``num_elements``: the species (rows of the weights)."""

    irreps_in: o3.Irreps
    irreps_out: o3.Irreps
    correlation: tuple[int, ...]
    num_elements: int
    u: tuple[tuple[np.ndarray, ...], ...] = field(repr=False, compare=False)
    _key: str = field(default="", repr=False)

    @property
    def channels(self) -> int:
        return self.irreps_in[0].mul

    @property
    def coupling(self) -> tuple[o3.Irrep, ...]:
        """The input irreps of one channel, in order (MACE's ``coupling_irreps``)."""
        return tuple(ir for _, ir in self.irreps_in)

    @property
    def coupling_offsets(self) -> tuple[int, ...]:
        return running_offsets(ir.dim for ir in self.coupling)

    @property
    def in_dim(self) -> int:
        """D: the per-channel input dimension (16 for 0e+1o+2e+3o)."""
        return sum(ir.dim for ir in self.coupling)

    @property
    def outputs(self) -> tuple[o3.Irrep, ...]:
        return tuple(ir for _, ir in self.irreps_out)

    @property
    def out_dim(self) -> int:
        return self.irreps_out.dim

    def num_params(self, o: int, nu: int) -> int:
        """K_{o,nu}: the number of weights per species and channel of output o at degree nu."""
        return int(self.u[o][nu - 1].shape[-1])

    def key(self) -> str:
        return self._key

    @staticmethod
    def check_arguments(irreps_in, irreps_out, correlation: int | tuple[int, ...], num_elements: int
                        ) -> tuple[o3.Irreps, o3.Irreps, tuple[int, ...], int]:
        """The arguments checked and normalised (correlation one int per output irrep); clear errors."""
        irreps_in, irreps_out = o3.Irreps(irreps_in), o3.Irreps(irreps_out)
        if len(irreps_in) == 0 or len(irreps_out) == 0:
            raise ValueError(f"irreps_in and irreps_out must not be empty, got {irreps_in!r} -> {irreps_out!r}")
        muls = {mul for mul, _ in irreps_in} | {mul for mul, _ in irreps_out}
        if len(muls) != 1 or 0 in muls:
            raise ValueError("irreps_in and irreps_out must have one and the same nonzero multiplicity (the "
                             f"channels) for every irrep, got {irreps_in} -> {irreps_out}")
        if isinstance(correlation, (int, np.integer)) and not isinstance(correlation, bool):
            correlation = (int(correlation),) * len(irreps_out)
        correlation = tuple(int(c) for c in correlation)
        if len(correlation) != len(irreps_out) or not all(1 <= c <= MAX_CORRELATION for c in correlation):
            raise ValueError(f"correlation must be an int in [1, {MAX_CORRELATION}] (or one per output irrep), "
                             f"got {correlation!r}")
        if not isinstance(num_elements, (int, np.integer)) or num_elements < 1:
            raise ValueError(f"num_elements must be a positive int, got {num_elements!r}")
        return irreps_in, irreps_out, correlation, int(num_elements)

    @classmethod
    def build(cls, irreps_in, irreps_out, correlation: int | tuple[int, ...], num_elements: int,
              u: list[list]) -> SCProblem:
        """Check the arguments and the U tensors (any array-likes, ``u[o][nu - 1]``, output axis included)."""
        irreps_in, irreps_out, correlation, num_elements = cls.check_arguments(
            irreps_in, irreps_out, correlation, num_elements)
        if u is None or len(u) != len(irreps_out):
            raise ValueError(f"u must hold one list of U tensors per output irrep ({len(irreps_out)}), "
                             f"got {None if u is None else len(u)}")
        dim = o3.Irreps([ir for _, ir in irreps_in]).dim
        tensors = []
        for o, (_, ir_out) in enumerate(irreps_out):
            if len(u[o]) != correlation[o]:
                raise ValueError(f"u[{o}] must hold {correlation[o]} tensors (degrees 1..{correlation[o]}), "
                                 f"got {len(u[o])}")
            per_nu = []
            for nu in range(1, correlation[o] + 1):
                t = u[o][nu - 1]
                t = t.detach().cpu().double().numpy() if isinstance(t, torch.Tensor) else np.asarray(t, float)
                expected = (ir_out.dim,) + (dim,) * nu
                if t.ndim != nu + 2 or t.shape[:-1] != expected:
                    raise ValueError(f"u[{o}][{nu - 1}] must have shape {list(expected)} + [K], got {list(t.shape)}")
                per_nu.append(np.ascontiguousarray(t, dtype=np.float64))
            tensors.append(tuple(per_nu))
        digest = hashlib.sha1()
        for per_nu in tensors:
            for t in per_nu:
                digest.update(str(t.shape).encode())
                digest.update(t.tobytes())
        key = f"{irreps_in}|{irreps_out}|{correlation}|{num_elements}|{digest.hexdigest()[:16]}"
        return cls(irreps_in, irreps_out, correlation, num_elements, tuple(tensors), key)
