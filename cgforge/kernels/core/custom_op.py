"""One way to declare the package's torch.library custom ops: implementation, fake, autograd. ``save_inputs`` saves
the tensor inputs for backward and keeps the others (problem key, flags) as ``ctx.args``, in input order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def save_inputs(ctx: Any, inputs: tuple, output: Any) -> None:
    ctx.save_for_backward(*(i for i in inputs if isinstance(i, torch.Tensor)))
    ctx.args = tuple(i for i in inputs if not isinstance(i, torch.Tensor))


def custom_op(name: str, fake: Callable, backward: Callable | None = None) -> Callable:
    """Decorator: `cgforge::<name>` from a typed implementation, with its fake and (optional) autograd
    formula, which reads `ctx.saved_tensors` and `ctx.args` (see `save_inputs`)."""

    def wrap(impl: Callable) -> Any:
        op = torch.library.custom_op(f"cgforge::{name}", mutates_args=())(impl)
        op.register_fake(fake)
        if backward is not None:
            op.register_autograd(backward, setup_context=save_inputs)
        return op

    return wrap
