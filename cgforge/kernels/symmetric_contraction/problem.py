"""The symmetric-contraction problem (MACE's product basis) as plain values.

For every atom b (species e) and channel c, output irrep o (dimension d_o) is

    out_o[b, c, M] = sum_{nu=1..corr} sum_k W_{o,nu}[e, k, c] * sum_{i1..inu} U_{o,nu}[M, i1..inu, k]
                     * x[b, c, i1] * ... * x[b, c, inu]

with x[b, c, :] one channel of the node features across all input irreps (dimension D), and the U
tensors MACE computes (``mace.tools.cg.U_matrix_real``). The problem keeps the U tensors as they are
given (float64 numpy, always with the output axis, also for d_o = 1) and knows nothing of MACE
modules; ``mace_u_matrices`` recomputes MACE's U tensors from their definition for modules built
without a MACE instance (model knowledge: to move to cgforge/patches/mace/ with the state-dict adapter).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import cache
from math import sqrt

import numpy as np
import torch
from e3nn import o3

from ..core.cg import wigner_3j
from ..core.offsets import running_offsets

MAX_CORRELATION = 4  # beyond this the U tensors (D**nu entries per column) get unreasonably large


@dataclass(frozen=True)
class SCProblem:
    """irreps_in: C x (each coupling irrep); irreps_out: C x (each output irrep); U per output and degree.

    ``u[o][nu - 1]`` has shape [d_o, D, ..., D (nu times), K_{o,nu}]. ``num_elements`` is the number of
    species (rows of the weight tensors).
    """

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

    @classmethod
    def build(cls, irreps_in, irreps_out, correlation: int | tuple[int, ...], num_elements: int,
              u: list[list] | None = None) -> SCProblem:
        """Check the arguments; compute MACE's U tensors unless given (any array-likes, per output/degree)."""
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
        coupling = o3.Irreps([ir for _, ir in irreps_in])
        dim = coupling.dim
        tensors = []
        for o, (_, ir_out) in enumerate(irreps_out):
            per_nu = []
            for nu in range(1, correlation[o] + 1):
                if u is None:
                    t = mace_u_matrices(str(coupling), str(ir_out), nu)
                else:
                    t = u[o][nu - 1]
                    t = t.detach().cpu().double().numpy() if isinstance(t, torch.Tensor) else np.asarray(t, float)
                    if t.ndim == nu + 1 and ir_out.dim == 1:  # MACE squeezes the output axis of scalars
                        t = t[None]
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
        key = f"{irreps_in}|{irreps_out}|{correlation}|{int(num_elements)}|{digest.hexdigest()[:16]}"
        return cls(irreps_in, irreps_out, correlation, int(num_elements), tuple(tensors), key)


# ---------------------------------------------------------------------------------------------------
# MACE's U tensors from their definition: every chain of couplings ((x_i1 (x) x_i2 -> a) (x) x_i3 -> b) ...
# of the coupling irreps, with e3nn's wigner_3j in component normalisation, in MACE's column order.


def _chains(coupling: tuple[o3.Irrep, ...], degree: int, filter_mid: frozenset | None
            ) -> list[tuple[o3.Irrep, np.ndarray]]:
    """All coupling chains of `degree` inputs: (irrep, tensor [d, D**degree]), in MACE's order."""
    dim = sum(ir.dim for ir in coupling)
    if degree == 1:
        out, start = [], 0
        for ir in coupling:
            e = np.zeros((ir.dim, dim))
            e[:, start:start + ir.dim] = np.eye(ir.dim)
            out.append((ir, e))
            start += ir.dim
        return out
    result = []
    for ir_left, c_left in _chains(coupling, degree - 1, filter_mid):
        start = 0
        for ir in coupling:
            for ir_out in ir_left * ir:
                if filter_mid is not None and ir_out not in filter_mid:
                    continue
                cg = wigner_3j(ir_out.l, ir_left.l, ir.l) * sqrt(ir_out.dim)
                # [out, left dims..., this input's m] placed in this input's slice of the last axis
                block = np.einsum("jk,ijl->ikl", c_left, cg)
                full = np.zeros((ir_out.dim, c_left.shape[1], dim))
                full[:, :, start:start + ir.dim] = block
                result.append((ir_out, full.reshape(ir_out.dim, -1)))
            start += ir.dim
    result.sort(key=lambda t: t[0])  # stable: equal irreps keep their generation order, as in MACE
    return result


@cache
def _mace_u(coupling: str, ir_out: str, degree: int) -> np.ndarray:
    irreps = tuple(ir for _, ir in o3.Irreps(coupling))
    target = o3.Irrep(ir_out)
    # MACE restricts the intermediate irreps of 4-fold products to l < 12 with parity (-1)^l.
    filter_mid = frozenset(o3.Irrep(l, (-1) ** l) for l in range(12)) if degree == 4 else None
    dim = sum(ir.dim for ir in irreps)
    cols = [t for ir, t in _chains(irreps, degree, filter_mid) if ir == target]
    if not cols:  # no coupling reaches this irrep: one all-zero column, as MACE stores it
        return np.zeros((target.dim,) + (dim,) * degree + (1,))
    return np.stack(cols, axis=-1).reshape((target.dim,) + (dim,) * degree + (len(cols),))


def mace_u_matrices(coupling: str, ir_out: str, degree: int) -> np.ndarray:
    """MACE's U tensor (``U_matrix_real(coupling, ir_out, degree)[-1]``, reduced CG off), output axis kept.

    Shape [d_out, D, ..., D, K]; a copy, so callers may modify it.
    """
    return _mace_u(str(o3.Irreps(coupling)), str(o3.Irrep(ir_out)), int(degree)).copy()
