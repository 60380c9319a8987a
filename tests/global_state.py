"""Process-wide state that nequip's loaders and the tests change (default dtype, e3nn flags, seeds)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch


@contextmanager
def preserved_global_state() -> Iterator[None]:
    """Restore torch's default dtype, e3nn's optimisation flags and the torch/numpy/random seeds on exit."""
    import e3nn

    dtype, flags = torch.get_default_dtype(), e3nn.get_optimization_defaults()
    rng = torch.get_rng_state(), np.random.get_state(), random.getstate()
    try:
        yield
    finally:
        torch.set_default_dtype(dtype)
        e3nn.set_optimization_defaults(**flags)
        torch.set_rng_state(rng[0])
        np.random.set_state(rng[1])
        random.setstate(rng[2])


@contextmanager
def nequip_global_state() -> Iterator[None]:
    """nequip's global state (float64 default dtype, TF32 off, its seeds) inside, the previous state after."""
    from nequip.utils.global_state import set_global_state

    with preserved_global_state():
        set_global_state()
        torch.set_default_dtype(torch.float64)  # set_global_state() does it only once per process
        yield
