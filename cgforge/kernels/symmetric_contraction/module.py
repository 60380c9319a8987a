"""`SymmetricContractionBase`: a torch module that runs a symmetric-contraction problem on its weights.

A subclass holds the weights in its model's layout and supplies them through ``weight_tensors()`` in (output,
degree) order, each [E, K_{o,nu}, C]. ``forward(x [N, C, D], species)``, species a one-hot (or [N, E] floats,
argmax taken) or indices [N], returns [N, sum_o C (2 l_o + 1)]; the weights enter as W' = A W (cached while no
weight requires grad). No gradient flows to ``species``.
"""

from __future__ import annotations

import torch

from ..core.checks import check_float
from ..core.tuning import SCTuning
from . import ops as sc_ops
from .problem import SCProblem
from .schedule import SCSchedule


class SymmetricContractionBase(torch.nn.Module):
    """out_o = sum_nu sum_k W_{o,nu}[species, k, c] U_{o,nu}[M, i.., k] x[c, i1] ... x[c, inu]. A subclass calls
    ``_plan(problem)`` once it holds its weights (and when the U tensors change) and implements ``weight_tensors()``."""

    tuning: SCTuning | None = None  # a class default: modules pickled before tuning existed have none
    problem: SCProblem
    key: str

    def weight_tensors(self) -> list[torch.Tensor]:
        """The weights W_{o,nu} [E, K_{o,nu}, C] in (output, degree) order."""
        raise NotImplementedError(f"{type(self).__name__} must implement weight_tensors()")

    def _plan(self, problem: SCProblem) -> None:
        """Register the problem's kernels (with ``self.tuning``) and forget what was derived from the old."""
        self.problem = problem
        self.key = sc_ops.register(problem, self.tuning)
        self._reset_caches()

    def _reset_caches(self) -> None:
        self._transform: dict[torch.device, torch.Tensor] = {}
        self._cached: tuple | None = None
        # Plain ints for forward's checks: torch.compile would otherwise guard on the e3nn Irreps they come
        # from, whose __len__ raises (dynamo's sequence-length guard fails).
        p = self.problem
        self._dims = (p.channels, p.in_dim, p.num_elements)

    def __setstate__(self, state: dict) -> None:  # unpickled in a new process: register again
        super().__setstate__(state)
        self.key = sc_ops.register(self.problem, self.tuning)
        self._reset_caches()

    @property
    def schedule(self) -> SCSchedule:
        return sc_ops.get(self.key).schedule

    def transformed_weights(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """W' [E, R, C] = A @ W (in float64, then cast), W the concatenated weights [E, K, C]."""
        weights = self.weight_tensors()
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

    def forward(self, x: torch.Tensor, species: torch.Tensor) -> torch.Tensor:
        channels, in_dim, num_elements = self._dims
        check_float("x", x)
        if x.dim() != 3 or x.shape[1] != channels or x.shape[2] != in_dim:
            raise ValueError(f"x must have shape [N, {channels}, {in_dim}] (channels, then the irreps of one channel), "
                             f"got {list(x.shape)}")
        index = _species_index(species, x.shape[0], num_elements, x.device)
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

