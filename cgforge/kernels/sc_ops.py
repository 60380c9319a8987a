"""torch.library custom ops for the symmetric contraction, and the registry of its plans.

``sc_forward(x, species, wp, key)`` and ``sc_backward(x, species, wp, g, key, need_gx, need_gw)`` take
the transformed weights W' (see sc_schedule); the module computes W' = A W with torch ops, so
autograd carries grad W' back to MACE's weights. CUDA tensors run the generated kernels, others the
torch interpreter of the schedule. The backward op is differentiable too (forces in a training loss):
its derivative is taken through the interpreter, correct and slower than the kernels.
"""

from __future__ import annotations

import hashlib
import math
import threading

import torch

from .sc_problem import SCProblem
from .sc_reference import interpret_sc, interpret_sc_backward
from .sc_schedule import SCSchedule, build_sc_schedule

_SCALAR = {torch.float32: "float", torch.float64: "double"}
_MAX_BLOCKS = 2**31 - 1


class SCPlan:
    """A problem, its schedule (built on first use) and its compiled kernels per dtype and device."""

    def __init__(self, problem: SCProblem):
        self.problem = problem
        self._schedule: SCSchedule | None = None
        self._kernels: dict[tuple, object] = {}
        self._lock = threading.Lock()

    @property
    def schedule(self) -> SCSchedule:
        if self._schedule is None:
            with self._lock:
                if self._schedule is None:
                    self._schedule = build_sc_schedule(self.problem)
        return self._schedule

    def kernel(self, dtype: torch.dtype, which: str, device: torch.device):
        """The launchable kernel `which` ('forward', 'backward', 'backward_w'), compiled on first use."""
        key = (dtype, which, device.index)
        handle = self._kernels.get(key)
        if handle is None:
            from .compiler import compile_cubin
            from .runtime import device_arch, load_kernels
            from .sc_codegen import render

            source, name = render(self.schedule, _SCALAR[dtype], forward=which == "forward",
                                  backward=which == "backward", backward_w=which == "backward_w")
            fn = f"{name}_{which}"
            result = compile_cubin(source, arch=device_arch(device), name=f"{fn}.cu")
            handle = load_kernels(result.cubin, [fn])[fn]
            self._kernels[key] = handle
        return handle


_PLANS: dict[str, SCPlan] = {}
_LOCK = threading.Lock()


def register(problem: SCProblem) -> str:
    key = "sc_" + hashlib.sha1(problem.key().encode()).hexdigest()[:16]
    with _LOCK:
        if key not in _PLANS:
            _PLANS[key] = SCPlan(problem)
    return key


def get(key: str) -> SCPlan:
    try:
        return _PLANS[key]
    except KeyError:
        raise KeyError(f"unknown cgforge symmetric-contraction key {key!r}: build the SymmetricContraction "
                       "module in this process first") from None


def _blocks(threads: int) -> int:
    from .sc_codegen import BLOCK

    return min(max(1, math.ceil(threads / BLOCK)), _MAX_BLOCKS)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """Contiguous with a 16-byte aligned start (the kernels read x rows as 16-byte vectors)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


# ---------------------------------------------------------------- forward

def forward_impl(x: torch.Tensor, species: torch.Tensor, wp: torch.Tensor, key: str) -> torch.Tensor:
    plan = get(key)
    p = plan.problem
    if x.device.type != "cuda":
        return interpret_sc(plan.schedule, x, species, wp)
    from .runtime import I64
    from .sc_codegen import BLOCK

    x, wp, species = _aligned(x), wp.contiguous(), species.to(torch.int32).contiguous()
    out = x.new_empty(x.shape[0], p.out_dim)
    rows = x.shape[0] * p.channels
    if rows:
        plan.kernel(x.dtype, "forward", x.device).launch((_blocks(rows), 1, 1), (BLOCK, 1, 1),
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
    from .runtime import I64
    from .sc_codegen import BLOCK, CHUNK

    x, wp, g, species = _aligned(x), wp.contiguous(), g.contiguous(), species.to(torch.int32).contiguous()
    n = x.shape[0]
    gx = torch.empty_like(x)
    if not need_gw:
        if n:
            rows = n * p.channels
            plan.kernel(x.dtype, "backward", x.device).launch((_blocks(rows), 1, 1), (BLOCK, 1, 1),
                                                              [x, species, wp, g, gx, I64(rows)])
        return gx, wp.new_zeros(0)
    gw = torch.zeros_like(wp)
    if n:
        # species order: a thread's atoms share one species, so grad W' leaves registers rarely
        perm = torch.sort(species, stable=True).indices.to(torch.int32)
        threads = math.ceil(n / CHUNK) * p.channels
        plan.kernel(x.dtype, "backward_w", x.device).launch((_blocks(threads), 1, 1), (BLOCK, 1, 1),
                                                            [x, species, perm, wp, g, gx, gw, I64(n)])
    return gx, gw


@torch.library.custom_op("cgforge::sc_forward", mutates_args=())
def sc_forward(x: torch.Tensor, species: torch.Tensor, wp: torch.Tensor, key: str) -> torch.Tensor:
    return forward_impl(x, species, wp, key)


@sc_forward.register_fake
def _(x, species, wp, key):
    return x.new_empty(x.shape[0], get(key).problem.out_dim)


@torch.library.custom_op("cgforge::sc_backward", mutates_args=())
def sc_backward(x: torch.Tensor, species: torch.Tensor, wp: torch.Tensor, g: torch.Tensor, key: str,
                need_gx: bool, need_gw: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad x [N, C, D], grad W' [E, R, C] or an empty tensor when need_gw is False)."""
    return backward_impl(x, species, wp, g, key, need_gw)


@sc_backward.register_fake
def _(x, species, wp, g, key, need_gx, need_gw):
    return torch.empty_like(x), (torch.empty_like(wp) if need_gw else wp.new_empty(0))


def _fwd_setup(ctx, inputs, output):
    x, species, wp, key = inputs
    ctx.save_for_backward(x, species, wp)
    ctx.key = key


def _fwd_grad(ctx, g):
    x, species, wp = ctx.saved_tensors
    need_gx, need_gw = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
    if not (need_gx or need_gw):
        return None, None, None, None
    gx, gw = sc_backward(x, species, wp, g.contiguous(), ctx.key, need_gx, need_gw)
    return (gx if need_gx else None), None, (gw if need_gw else None), None


sc_forward.register_autograd(_fwd_grad, setup_context=_fwd_setup)


class _EagerContraction(torch.autograd.Function):
    """The forward op without the custom-op dispatch (tens of microseconds a call in eager mode, where
    the kernels themselves take a few tens for a 5k-atom system). Same implementation and formulas;
    a backward with create_graph=True goes through the differentiable custom op."""

    @staticmethod
    def forward(ctx, x, species, wp, key):
        ctx.save_for_backward(x, species, wp)
        ctx.key = key
        return forward_impl(x, species, wp, key)

    @staticmethod
    def backward(ctx, g):
        x, species, wp = ctx.saved_tensors
        need_gx, need_gw = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
        if not (need_gx or need_gw):
            return None, None, None, None
        if torch.is_grad_enabled():
            gx, gw = sc_backward(x, species, wp, g.contiguous(), ctx.key, need_gx, need_gw)
        else:
            gx, gw = backward_impl(x, species, wp, g, ctx.key, need_gw)
        return (gx if need_gx else None), None, (gw if need_gw else None), None


def contraction(x: torch.Tensor, species: torch.Tensor, wp: torch.Tensor, key: str) -> torch.Tensor:
    """The forward op: the custom op under torch.compile, a plain autograd.Function in eager mode."""
    if torch.compiler.is_compiling():
        return sc_forward(x, species, wp, key)
    return _EagerContraction.apply(x, species, wp, key)


def _bwd_setup(ctx, inputs, output):
    x, species, wp, g, key, need_gx, need_gw = inputs
    ctx.save_for_backward(x, species, wp, g)
    ctx.key = key


def _bwd_grad(ctx, ggx, ggw):
    """Derivative of the backward (a Hessian-vector product), through the interpreter."""
    if torch.is_grad_enabled():
        raise NotImplementedError("cgforge symmetric contraction: third derivatives (create_graph=True in a "
                                  "double backward) are not supported")
    x, species, wp, g = ctx.saved_tensors
    schedule = get(ctx.key).schedule
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


sc_backward.register_autograd(_bwd_grad, setup_context=_bwd_setup)
