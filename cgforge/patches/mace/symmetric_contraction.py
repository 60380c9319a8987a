"""MACE's symmetric contraction (mace-torch 0.3.16) over cgforge's kernels: its U tensors and state-dict layout.

``SymmetricContraction`` has ``mace.modules.SymmetricContraction``'s call (``forward(x [N, C, D], species)``,
species one-hot or indices) and state_dict (``contractions.{o}.weights_max``, ``.weights.{j}``, the U tensors and
flags, in MACE's order). The kernels and checks are ``SymmetricContractionBase``'s; this module supplies the
problem (U computed from its definition or read from a MACE module) and the weights.
"""

from __future__ import annotations

from functools import cache
from math import sqrt
from typing import Any

import numpy as np
import torch
from e3nn import o3

from cgforge.kernels.core.cg import wigner_3j
from cgforge.kernels.core.tuning import SCTuning
from cgforge.kernels.symmetric_contraction import SCProblem, SymmetricContractionBase

from ..torch_internals import children_dict, is_persistent, parameters_dict


class _Contraction(torch.nn.Module):
    """Holds one output irrep's tensors under MACE's names (no compute of its own)."""

    def __init__(self, parameters: list[tuple[str, torch.nn.Parameter]],
                 buffers: list[tuple[str, torch.Tensor, bool]], weights: torch.nn.ParameterList, correlation: int):
        super().__init__()
        for name, param in parameters:
            self.register_parameter(name, param)
        for name, buf, persistent in buffers:
            self.register_buffer(name, buf, persistent=persistent)
        self.weights = weights
        self.correlation = correlation

    def weight(self, nu: int) -> torch.Tensor:
        """Weights of degree nu, [E, K, C] (MACE: weights_max is the highest degree, weights[j] degree corr-1-j)."""
        return self.weights_max if nu == self.correlation else self.weights[self.correlation - 1 - nu]

    def u(self, nu: int) -> torch.Tensor:
        return getattr(self, f"U_matrix_{nu}")


class SymmetricContraction(SymmetricContractionBase):
    """out_o = sum_nu sum_k W_{o,nu}[species, k, c] U_{o,nu}[M, i.., k] x[c, i1] ... x[c, inu], as MACE."""

    def __init__(self, irreps_in: Any, irreps_out: Any, correlation: int, num_elements: int, *,
                 tuning: SCTuning | None = None, _contractions: list[_Contraction] | None = None):
        """``tuning``: the kernels' knobs (``SCTuning``; None: the defaults)."""
        super().__init__()
        self.tuning = tuning
        irreps_in, irreps_out = o3.Irreps(irreps_in), o3.Irreps(irreps_out)
        if _contractions is None:
            # validates the arguments and computes MACE's U tensors
            problem = mace_problem(irreps_in, irreps_out, correlation, num_elements)
            _contractions = [_fresh_contraction(problem, o) for o in range(len(irreps_out))]
        self.irreps_in, self.irreps_out = irreps_in, irreps_out
        self.num_elements = int(num_elements)
        self.contractions = torch.nn.ModuleList(_contractions)
        self._build()
        self.register_load_state_dict_post_hook(_rebuild_after_load)

    @classmethod
    def from_mace(cls, module: Any, tuning: SCTuning | None = None) -> SymmetricContraction:
        """Wrap a ``mace.modules.SymmetricContraction``, sharing its parameters and buffers (same state_dict);
        ``tuning``: the kernels' knobs (None: the defaults)."""
        contractions = getattr(module, "contractions", None)
        if not isinstance(contractions, torch.nn.ModuleList) or not hasattr(module, "irreps_out"):
            raise TypeError(f"from_mace expects a MACE SymmetricContraction, got {type(module).__name__}")
        if len(contractions) != len(module.irreps_out):
            raise ValueError(f"MACE SymmetricContraction has {len(contractions)} contractions for "
                             f"{len(module.irreps_out)} output irreps")
        adopted, num_elements = [], None
        for o, c in enumerate(contractions):
            corr = int(c.correlation)
            weights = getattr(c, "weights", None)
            if not isinstance(weights, torch.nn.ParameterList) or len(weights) != corr - 1:
                raise ValueError(f"contractions.{o}: expected internal weights (a ParameterList of "
                                 f"{corr - 1}), got {type(weights).__name__}")
            params = [(n, p) for n, p in c.named_parameters(recurse=False)]
            buffers = [(n, b, is_persistent(c, n)) for n, b in c.named_buffers(recurse=False)]
            names = {n for n, _ in params}
            missing = [f"U_matrix_{nu}" for nu in range(1, corr + 1) if not hasattr(c, f"U_matrix_{nu}")]
            if "weights_max" not in names or missing:
                raise ValueError(f"contractions.{o}: expected weights_max and U_matrix_1..{corr}")
            adopted.append(_Contraction(params, buffers, weights, corr))
            num_elements = int(c.weights_max.shape[0])
        return cls(module.irreps_in, module.irreps_out, 0, num_elements, tuning=tuning, _contractions=adopted)

    def _build(self, only_if_changed: bool = False) -> None:
        correlation = tuple(c.correlation for c in self.contractions)
        u = [[_with_output_axis(c.u(nu), nu, ir.dim) for nu in range(1, c.correlation + 1)]
             for c, (_, ir) in zip(self.contractions, self.irreps_out)]  # per output and degree
        problem = SCProblem.build(self.irreps_in, self.irreps_out, correlation, self.num_elements, u=u)
        if only_if_changed and problem.key() == self.problem.key():
            return
        shapes = [[tuple(c.weight(nu).shape) for nu in range(1, c.correlation + 1)] for c in self.contractions]
        for o, per_nu in enumerate(shapes):
            for nu, shape in enumerate(per_nu, start=1):
                expected = (problem.num_elements, problem.num_params(o, nu), problem.channels)
                if shape != expected:
                    raise ValueError(f"contractions.{o}: weights of degree {nu} have shape {list(shape)}, "
                                     f"expected {list(expected)}")
        self._plan(problem)

    def _reset_caches(self) -> None:
        super()._reset_caches()
        self._weight_refs: list | None = None

    def weight_tensors(self) -> list[torch.Tensor]:
        """MACE's weight tensors in degree order, found through nn.Module's attribute lookup only when the
        containers' entries changed (that lookup costs more than a small system's kernels)."""
        found = self._weight_refs
        if found is not None and all(d.get(k) is v for d, k, v in found):
            return [v for d, k, v in found if k != "weights"]
        found = []
        for c in self.contractions:
            found.append((children_dict(c), "weights", c.weights))
            for nu in range(1, c.correlation + 1):
                d, k = ((parameters_dict(c), "weights_max") if nu == c.correlation
                        else (parameters_dict(c.weights), str(c.correlation - 1 - nu)))
                found.append((d, k, d[k]))
        self._weight_refs = found
        return [v for d, k, v in found if k != "weights"]


def _rebuild_after_load(module: SymmetricContraction, incompatible_keys: Any) -> None:
    """Loaded U tensors may differ from those the kernels were made for (a plain function: picklable)."""
    module._build(only_if_changed=True)


def _with_output_axis(u: torch.Tensor, nu: int, out_dim: int) -> torch.Tensor:
    return u[None] if u.dim() == nu + 1 and out_dim == 1 else u  # MACE squeezes the output axis of scalars


def _fresh_contraction(problem: SCProblem, o: int) -> _Contraction:
    """New weights and U buffers laid out as mace-torch 0.3.16's Contraction registers them."""
    dtype = torch.get_default_dtype()
    corr = problem.correlation[o]
    e, c = problem.num_elements, problem.channels
    us = [torch.tensor(problem.u[o][nu - 1], dtype=dtype) for nu in range(1, corr + 1)]
    if problem.outputs[o].dim == 1:
        us = [u[0] for u in us]  # MACE squeezes the output axis of scalars
    nonzero = [bool(torch.any(u != 0)) for u in us]

    def init(nu: int) -> torch.nn.Parameter:
        k = us[nu - 1].shape[-1]
        return torch.nn.Parameter(torch.randn(e, k, c, dtype=dtype) / k)

    weights_max = init(corr)
    weights = [init(nu) for nu in range(corr - 1, 0, -1)]  # weights[j] is degree corr - 1 - j
    # MACE's zeroing: flag j marks U of degree j + 1 as all-zero and zeroes weights[j] (its indexing, kept)
    for j in range(corr - 1):
        if not nonzero[j]:
            weights[j] = torch.nn.Parameter(torch.zeros_like(weights[j]), requires_grad=False)
    if not nonzero[corr - 1]:
        weights_max = torch.nn.Parameter(torch.zeros_like(weights_max), requires_grad=False)
    buffers = [(f"U_matrix_{nu}", us[nu - 1], True) for nu in range(1, corr + 1)]
    buffers += [(f"weights_{j}_zeroed", torch.tensor(not nonzero[j]), True) for j in range(corr - 1)]
    buffers.append(("weights_max_zeroed", torch.tensor(not nonzero[corr - 1]), True))
    return _Contraction([("weights_max", weights_max)], buffers, torch.nn.ParameterList(weights), corr)


def mace_problem(irreps_in: Any, irreps_out: Any, correlation: int | tuple[int, ...], num_elements: int) -> SCProblem:
    """The problem of a MACE SymmetricContraction built from scratch: MACE's U tensors from their definition."""
    irreps_in, irreps_out, correlation, num_elements = SCProblem.check_arguments(
        irreps_in, irreps_out, correlation, num_elements)  # before the (slow) U tensors
    coupling = str(o3.Irreps([ir for _, ir in irreps_in]))
    u = [[mace_u_matrices(coupling, str(ir_out), nu) for nu in range(1, correlation[o] + 1)]
         for o, (_, ir_out) in enumerate(irreps_out)]
    return SCProblem.build(irreps_in, irreps_out, correlation, num_elements, u=u)


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
    """MACE's U tensor (``U_matrix_real(coupling, ir_out, degree)[-1]``, reduced CG off), output axis kept: a copy,
    shape [d_out, D, ..., D, K]."""
    return _mace_u(str(o3.Irreps(coupling)), str(o3.Irrep(ir_out)), int(degree)).copy()
