"""torch.library custom ops for the symmetric contraction, and the registry of its plans.

``sc_forward(x, species, wp, key)`` and ``sc_backward(x, species, wp, g, key, need_gx, need_gw)`` take the
transformed weights W' (the module forms W' = A W with torch ops). CUDA tensors run the generated kernels, others
the torch interpreter; the backward op's own derivative goes through the interpreter.
"""

from __future__ import annotations

import math
import threading

import torch

from ..core.custom_op import custom_op, save_inputs
from ..core.launch import MAX_BLOCKS
from ..core.registry import KernelCache, Registry, scalar_name
from ..core.tuning import SCTuning
from .problem import SCProblem
from .reference import interpret_sc, interpret_sc_backward
from .schedule import SCSchedule, build_sc_schedule

KERNELS = ("forward", "backward", "backward_w")


class SCPlan:
    """A problem, its tuning, its schedule (built on first use) and its compiled kernels."""

    def __init__(self, problem: SCProblem, tuning: SCTuning):
        self.problem = problem
        self.tuning = tuning
        self._schedule: SCSchedule | None = None
        self._kernels = KernelCache()
        self._lock = threading.Lock()

    @property
    def schedule(self) -> SCSchedule:
        if self._schedule is None:
            with self._lock:
                if self._schedule is None:
                    self._schedule = build_sc_schedule(self.problem)
        return self._schedule

    def source(self, dtype: torch.dtype, which: str) -> tuple[str, str]:
        """CUDA source of kernel `which` ('forward', 'backward', 'backward_w') and its function name."""
        from .codegen import render

        if which not in KERNELS:
            raise ValueError(f"which must be one of {KERNELS}, got {which!r}")
        source, name = render(self.schedule, scalar_name(dtype), forward=which == "forward",
                              backward=which == "backward", backward_w=which == "backward_w", tuning=self.tuning)
        return source, f"{name}_{which}"

    def kernel(self, dtype: torch.dtype, which: str, device: torch.device):
        """The launchable kernel `which`, compiled on first use."""
        return self._kernels.get(which, dtype, device, lambda: self.source(dtype, which))


PLANS: Registry[SCPlan] = Registry("sc", "SymmetricContraction")


def register(problem: SCProblem, tuning: SCTuning | None = None) -> str:
    """The key of (problem, tuning); no tuning: the defaults (``SCTuning()``)."""
    tuning = tuning if tuning is not None else SCTuning()
    default = tuning == SCTuning()
    text = problem.key() if default else f"{problem.key()}|{tuning.key()}"  # default keys as before
    return PLANS.register(text, lambda: SCPlan(problem, tuning))


def get(key: str) -> SCPlan:
    return PLANS.get(key)


def _blocks(threads: int, block: int) -> int:
    return min(max(1, math.ceil(threads / block)), MAX_BLOCKS)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """Contiguous with a 16-byte aligned start (the kernels read x rows as 16-byte vectors)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def forward_impl(x: torch.Tensor, species: torch.Tensor, wp: torch.Tensor, key: str) -> torch.Tensor:
    plan = get(key)
    p = plan.problem
    if x.device.type != "cuda":
        return interpret_sc(plan.schedule, x, species, wp)
    from ..core.runtime import I64

    block = plan.tuning.block
    x, wp, species = _aligned(x), wp.contiguous(), species.to(torch.int32).contiguous()
    out = x.new_empty(x.shape[0], p.out_dim)
    rows = x.shape[0] * p.channels
    if rows:
        plan.kernel(x.dtype, "forward", x.device).launch((_blocks(rows, block), 1, 1), (block, 1, 1),
                                                         [x, species, wp, out, I64(rows)])
    return out


def backward_impl(x: torch.Tensor, species: torch.Tensor, wp: torch.Tensor, g: torch.Tensor, key: str,
                  need_gw: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad x [N, C, D], grad W' [E, R, C] or an empty tensor when need_gw is False)."""
    plan = get(key)
    p = plan.problem
    if x.device.type != "cuda":
        gx, gw = interpret_sc_backward(plan.schedule, x, species, wp, g, need_gw)
        return gx, (gw if need_gw else wp.new_zeros(0))
    from ..core.runtime import I64

    block, chunk = plan.tuning.block, plan.tuning.chunk
    x, wp, g, species = _aligned(x), wp.contiguous(), g.contiguous(), species.to(torch.int32).contiguous()
    n = x.shape[0]
    gx = torch.empty_like(x)
    if not need_gw:
        if n:
            rows = n * p.channels
            plan.kernel(x.dtype, "backward", x.device).launch((_blocks(rows, block), 1, 1), (block, 1, 1),
                                                              [x, species, wp, g, gx, I64(rows)])
        return gx, wp.new_zeros(0)
    gw = torch.zeros_like(wp)
    if n:
        # species order: a thread's atoms share one species, so grad W' leaves registers rarely
        perm = torch.sort(species, stable=True).indices.to(torch.int32)
        threads = math.ceil(n / chunk) * p.channels
        plan.kernel(x.dtype, "backward_w", x.device).launch((_blocks(threads, block), 1, 1), (block, 1, 1),
                                                            [x, species, perm, wp, g, gx, gw, I64(n)])
    return gx, gw


def _fwd_fake(x, species, wp, key):
    return x.new_empty(x.shape[0], get(key).problem.out_dim)


def _fwd_grad(ctx, g, direct: bool = False):
    """The forward op's gradient: through the ``sc_backward`` custom op (traceable by AOTAutograd), or with ``direct``
    (the eager autograd.Function, no double backward) its implementation without the dispatch."""
    x, species, wp = ctx.saved_tensors
    (key,) = ctx.args
    need_gx, need_gw = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
    if not (need_gx or need_gw):
        return None, None, None, None
    if direct and not torch.is_grad_enabled():
        gx, gw = backward_impl(x, species, wp, g, key, need_gw)
    else:
        gx, gw = sc_backward(x, species, wp, g.contiguous(), key, need_gx, need_gw)
    return (gx if need_gx else None), None, (gw if need_gw else None), None


@custom_op("sc_forward", _fwd_fake, _fwd_grad)
def sc_forward(x: torch.Tensor, species: torch.Tensor, wp: torch.Tensor, key: str) -> torch.Tensor:
    return forward_impl(x, species, wp, key)


def _bwd_fake(x, species, wp, g, key, need_gx, need_gw):
    return torch.empty_like(x), (torch.empty_like(wp) if need_gw else wp.new_empty(0))


def _bwd_grad(ctx, ggx, ggw):
    """Derivative of the backward (a Hessian-vector product), through the interpreter."""
    if torch.is_grad_enabled():
        raise NotImplementedError("cgforge symmetric contraction: third derivatives (create_graph=True in a "
                                  "double backward) are not supported")
    x, species, wp, g = ctx.saved_tensors
    schedule = get(ctx.args[0]).schedule
    with torch.enable_grad():
        x_ = x.detach().requires_grad_(True)
        wp_ = wp.detach().requires_grad_(True)
        g_ = g.detach().requires_grad_(True)
        out = interpret_sc(schedule, x_, species, wp_)
        gx, gw = torch.autograd.grad(out, (x_, wp_), g_, create_graph=True, allow_unused=True)
        total = out.new_zeros(())
        if ggx is not None and gx is not None:
            total = total + (gx * ggx).sum()
        if ggw is not None and ggw.numel() and gw is not None:
            total = total + (gw * ggw).sum()
        if not total.requires_grad:
            return None, None, None, None, None, None, None
        dx, dw, dg = torch.autograd.grad(total, (x_, wp_, g_), allow_unused=True)
    return dx, None, dw, dg, None, None, None


@custom_op("sc_backward", _bwd_fake, _bwd_grad)
def sc_backward(x: torch.Tensor, species: torch.Tensor, wp: torch.Tensor, g: torch.Tensor, key: str,
                need_gx: bool, need_gw: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad x [N, C, D], grad W' [E, R, C] or an empty tensor when need_gw is False)."""
    return backward_impl(x, species, wp, g, key, need_gw)


class _EagerContraction(torch.autograd.Function):
    """The forward op without the custom-op dispatch (costly next to a small system's kernels); a backward with
    create_graph=True goes through the differentiable custom op."""

    @staticmethod
    def forward(ctx, x, species, wp, key):
        save_inputs(ctx, (x, species, wp, key), None)
        return forward_impl(x, species, wp, key)

    @staticmethod
    def backward(ctx, g):
        return _fwd_grad(ctx, g, direct=True)


def contraction(x: torch.Tensor, species: torch.Tensor, wp: torch.Tensor, key: str) -> torch.Tensor:
    """The forward op: the custom op under torch.compile, a plain autograd.Function in eager mode."""
    if torch.compiler.is_compiling():
        return sc_forward(x, species, wp, key)
    return _EagerContraction.apply(x, species, wp, key)
