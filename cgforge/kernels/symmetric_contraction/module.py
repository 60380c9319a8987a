"""`SymmetricContraction`: MACE's product-basis contraction with generated kernels.

Same call as ``mace.modules.SymmetricContraction``: ``forward(x [N, C, D], species)`` with x one
channel-major block of node features (what ``EquivariantProductBasisBlock`` passes) and species a
one-hot (or any [N, E] float tensor whose argmax is the species, as MACE's node_attrs) or an integer
index [N]; returns [N, sum_o C * (2 l_o + 1)]. The state_dict is MACE's:
``contractions.{o}.weights_max`` [E, K, C] (the highest degree), ``contractions.{o}.weights.{j}``
(degree correlation - 1 - j), the U tensors ``contractions.{o}.U_matrix_{nu}`` and the zeroed flags,
in MACE's order, so state dicts move between the two freely.

The species' weights enter through W' = A W (a small float64 matmul per call, cached while no weight
requires grad); the kernels evaluate a reduced basis (see schedule). The species is taken as a
constant: no gradient flows to a one-hot ``species`` (MACE's node_attrs), as in cuEquivariance's path.
"""

from __future__ import annotations

from typing import Any

import torch
from e3nn import o3

from ..core.checks import FLOAT_DTYPES
from ..core.tuning import SCTuning
from . import ops as sc_ops
from .problem import SCProblem, mace_u_matrices


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


class SymmetricContraction(torch.nn.Module):
    """out_o = sum_nu sum_k W_{o,nu}[species, k, c] U_{o,nu}[M, i.., k] x[c, i1] ... x[c, inu], as MACE."""

    tuning: SCTuning | None = None  # a class default: modules pickled before tuning existed have none

    def __init__(self, irreps_in: Any, irreps_out: Any, correlation: int, num_elements: int, *,
                 tuning: SCTuning | None = None, _contractions: list[_Contraction] | None = None):
        """``tuning``: the kernels' knobs (None: defaults, or the CGFORGE_SC_* sweep variables)."""
        super().__init__()
        self.tuning = tuning
        irreps_in, irreps_out = o3.Irreps(irreps_in), o3.Irreps(irreps_out)
        if _contractions is None:
            # validates the arguments and computes MACE's U tensors
            problem = SCProblem.build(irreps_in, irreps_out, correlation, num_elements)
            _contractions = [_fresh_contraction(problem, o) for o in range(len(irreps_out))]
        self.irreps_in, self.irreps_out = irreps_in, irreps_out
        self.num_elements = int(num_elements)
        self.contractions = torch.nn.ModuleList(_contractions)
        self._build()
        self.register_load_state_dict_post_hook(_rebuild_after_load)

    @classmethod
    def from_mace(cls, module: Any) -> SymmetricContraction:
        """Wrap a ``mace.modules.SymmetricContraction``, sharing its parameters and buffers (same state_dict)."""
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
            buffers = [(n, b, n not in c._non_persistent_buffers_set) for n, b in c.named_buffers(recurse=False)]
            names = {n for n, _ in params}
            missing = [f"U_matrix_{nu}" for nu in range(1, corr + 1) if not hasattr(c, f"U_matrix_{nu}")]
            if "weights_max" not in names or missing:
                raise ValueError(f"contractions.{o}: expected weights_max and U_matrix_1..{corr}")
            adopted.append(_Contraction(params, buffers, weights, corr))
            num_elements = int(c.weights_max.shape[0])
        return cls(module.irreps_in, module.irreps_out, 0, num_elements, _contractions=adopted)

    # ------------------------------------------------------------------ problem and plan

    def _u_tensors(self) -> list[list[torch.Tensor]]:
        return [[c.u(nu) for nu in range(1, c.correlation + 1)] for c in self.contractions]

    def _build(self, only_if_changed: bool = False) -> None:
        correlation = tuple(c.correlation for c in self.contractions)
        problem = SCProblem.build(self.irreps_in, self.irreps_out, correlation, self.num_elements,
                                  u=self._u_tensors())
        if only_if_changed and problem.key() == self.problem.key():
            return
        shapes = [[tuple(c.weight(nu).shape) for nu in range(1, c.correlation + 1)] for c in self.contractions]
        for o, per_nu in enumerate(shapes):
            for nu, shape in enumerate(per_nu, start=1):
                expected = (problem.num_elements, problem.num_params(o, nu), problem.channels)
                if shape != expected:
                    raise ValueError(f"contractions.{o}: weights of degree {nu} have shape {list(shape)}, "
                                     f"expected {list(expected)}")
        self.problem = problem
        self.key = sc_ops.register(problem, self.tuning)
        self._transform: dict[torch.device, torch.Tensor] = {}
        self._cached: tuple | None = None
        self._weight_refs: list | None = None

    def __setstate__(self, state: dict) -> None:  # unpickled in a new process: register again
        super().__setstate__(state)
        self.key = sc_ops.register(self.problem, self.tuning)
        self._transform, self._cached, self._weight_refs = {}, None, None

    @property
    def schedule(self):
        return sc_ops.get(self.key).schedule

    def _weights(self) -> list[torch.Tensor]:
        """MACE's weight tensors in degree order, found through nn.Module's attribute lookup only when the
        containers' entries changed (that lookup costs more than a small system's kernels)."""
        found = self._weight_refs
        if found is not None and all(d.get(k) is v for d, k, v in found):
            return [v for d, k, v in found if k != "weights"]
        found = []
        for c in self.contractions:
            found.append((c._modules, "weights", c.weights))
            for nu in range(1, c.correlation + 1):
                d, k = ((c._parameters, "weights_max") if nu == c.correlation
                        else (c.weights._parameters, str(c.correlation - 1 - nu)))
                found.append((d, k, d[k]))
        self._weight_refs = found
        return [v for d, k, v in found if k != "weights"]

    def transformed_weights(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """W' [E, R, C] = A @ W (in float64, then cast), W the concatenated MACE weights [E, K, C]."""
        weights = self._weights()
        grads = torch.is_grad_enabled() and any(w.requires_grad for w in weights)
        if not grads and not torch.compiler.is_compiling():
            stamp = (dtype, device, tuple((w.data_ptr(), w._version) for w in weights))
            if self._cached is not None and self._cached[0] == stamp:
                return self._cached[1]
        a = self._transform.get(device)
        if a is None:
            a = torch.as_tensor(self.schedule.transform_matrix(), dtype=torch.float64, device=device)
            self._transform[device] = a
        w = torch.cat(weights, dim=1).to(device=device, dtype=torch.float64)
        wp = torch.matmul(a, w).to(dtype)
        if not grads and not torch.compiler.is_compiling():
            self._cached = (stamp, wp)
        return wp

    # ------------------------------------------------------------------ forward

    def forward(self, x: torch.Tensor, species: torch.Tensor) -> torch.Tensor:
        p = self.problem
        _check_x(x, p.channels, p.in_dim)
        index = _species_index(species, x.shape[0], p.num_elements, x.device)
        wp = self.transformed_weights(x.dtype, x.device)
        return sc_ops.contraction(x, index, wp, self.key)

    def compile_kernels(self, device: torch.device | str, dtype: torch.dtype) -> None:
        """Compile (or load from cache) the CUDA kernels now rather than at the first call."""
        device = torch.device(device)
        if device.type == "cuda":
            plan = sc_ops.get(self.key)
            for which in sc_ops.KERNELS:
                plan.kernel(dtype, which, device)

    def extra_repr(self) -> str:
        p = self.problem
        return (f"{p.irreps_in} -> {p.irreps_out}, correlation={p.correlation}, num_elements={p.num_elements}")


def _rebuild_after_load(module: SymmetricContraction, incompatible_keys: Any) -> None:
    """Loaded U tensors may differ from those the kernels were made for (a plain function: picklable)."""
    module._build(only_if_changed=True)


def _check_x(x: torch.Tensor, channels: int, dim: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"x must be float32 or float64, got {x.dtype}")
    if x.dim() != 3 or x.shape[1] != channels or x.shape[2] != dim:
        raise ValueError(f"x must have shape [N, {channels}, {dim}] (channels, then the irreps of one channel), "
                         f"got {list(x.shape)}")


def _species_index(species: torch.Tensor, n: int, num_elements: int, device: torch.device) -> torch.Tensor:
    if not isinstance(species, torch.Tensor):
        raise TypeError(f"species must be a torch.Tensor (one-hot [N, E] or index [N]), got {type(species).__name__}")
    if species.device != device:
        raise ValueError(f"species is on {species.device} but x is on {device}: both must match")
    if species.is_floating_point():
        if species.dim() != 2 or species.shape[0] != n or species.shape[1] != num_elements:
            raise ValueError(f"one-hot species must have shape [{n}, {num_elements}], got {list(species.shape)}")
        if n == 0:
            return torch.zeros(0, dtype=torch.int32, device=device)
        return species.detach().argmax(dim=-1).to(torch.int32)
    if species.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"species index must be int32 or int64, got {species.dtype}")
    if species.dim() != 1 or species.shape[0] != n:
        raise ValueError(f"species index must have shape [{n}], got {list(species.shape)}")
    if species.device.type == "cpu" and n and (int(species.min()) < 0 or int(species.max()) >= num_elements):
        raise ValueError(f"species index must lie in [0, {num_elements}), got values in "
                         f"[{int(species.min())}, {int(species.max())}]")
    return species.to(torch.int32)


def _fresh_contraction(problem: SCProblem, o: int) -> _Contraction:
    """New weights and U buffers laid out as mace-torch 0.3.16's Contraction registers them."""
    dtype = torch.get_default_dtype()
    corr = problem.correlation[o]
    e, c = problem.num_elements, problem.channels
    us = [torch.as_tensor(mace_u_matrices(str(o3.Irreps([ir for ir in problem.coupling])),
                                          str(problem.outputs[o]), nu), dtype=dtype)
          for nu in range(1, corr + 1)]
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


__all__ = ["SymmetricContraction"]
