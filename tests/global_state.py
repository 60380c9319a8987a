"""Process-wide state that nequip's loaders and the tests change (default dtype, e3nn flags, TF32, seeds), and
the pytest fixtures that give every test the same starting state (registered by conftest.py; a plugin for
`pytest -p global_state` too, which is how test_global_state.py runs it in a fresh session).

Order of the fixtures around one test (pytest sets up wider scopes first, autouse before requested):
  1. `_module_global_state` (module, autouse): the baseline (float32, e3nn's import-time flags, TF32 as
     torch starts) at the start and the end of every module, whatever an earlier module's fixtures left.
  2. the module's own fixtures, e.g. `nequip_state` (float64): they change the state for their module.
  3. `_test_global_state` (function, autouse): snapshots that state, seeds torch / numpy / random with SEED,
     and restores the snapshot and the generators after the test. A module-scoped state fixture that a test
     did not ask for (set up for an earlier test of the module) is undone for that test: baseline instead.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import e3nn
import numpy as np
import pytest
import torch

SEED = 0
# Names of the state-setting fixtures (nequip_state) whose state is in force now, set up and not yet torn down.
_ACTIVE: set[str] = set()


@dataclass(frozen=True)
class GlobalState:
    """The process-wide settings a test can change and a later test would silently inherit."""

    dtype: torch.dtype
    e3nn_flags: tuple[tuple[str, object], ...]
    matmul_precision: str
    cudnn_allow_tf32: bool

    @classmethod
    def capture(cls) -> GlobalState:
        return cls(torch.get_default_dtype(), tuple(sorted(e3nn.get_optimization_defaults().items())),
                   torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32)

    def apply(self) -> None:
        torch.set_default_dtype(self.dtype)
        flags = dict(self.e3nn_flags)
        # jit_mode last: e3nn maps the legacy jit_script_fx onto jit_mode when it is set
        e3nn.set_optimization_defaults(**{k: v for k, v in flags.items() if k != "jit_mode"})
        if "jit_mode" in flags:
            e3nn.set_optimization_defaults(jit_mode=flags["jit_mode"])
        # only when changed: the TF32 setters warn or refuse when the legacy and new APIs are mixed
        if torch.get_float32_matmul_precision() != self.matmul_precision:
            torch.set_float32_matmul_precision(self.matmul_precision)
        if torch.backends.cudnn.allow_tf32 != self.cudnn_allow_tf32:
            torch.backends.cudnn.allow_tf32 = self.cudnn_allow_tf32


# Captured when conftest imports this module, before any test module is collected (nequip's import and its
# loaders change the e3nn flags); the dtype is torch's own default, whatever a collected module set.
BASELINE = GlobalState(torch.float32, tuple(sorted(e3nn.get_optimization_defaults().items())), "highest",
                       torch.backends.cudnn.allow_tf32)


def seed_all(seed: int = SEED) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


@contextmanager
def preserved_global_state() -> Iterator[None]:
    """Restore torch's default dtype, e3nn's optimisation flags, TF32 and the torch/numpy/random seeds on exit."""
    state = GlobalState.capture()
    rng = torch.get_rng_state(), np.random.get_state(), random.getstate()
    try:
        yield
    finally:
        state.apply()
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


@contextmanager
def state_fixture(name: str) -> Iterator[None]:
    """Mark the fixture `name` as setting global state while inside: tests that don't request it get the
    baseline even when it is still set up for the module (see `_test_global_state`)."""
    _ACTIVE.add(name)
    try:
        yield
    finally:
        _ACTIVE.discard(name)


@pytest.fixture(scope="module", autouse=True)
def _module_global_state() -> Iterator[None]:
    """Every module starts and ends at the baseline, whatever the fixtures of the module before left."""
    BASELINE.apply()
    yield
    BASELINE.apply()


@pytest.fixture(autouse=True)
def _test_global_state(request: pytest.FixtureRequest) -> Iterator[None]:
    """Each test starts from its module's state (fresh seeds) and leaves nothing behind."""
    with preserved_global_state():
        if _ACTIVE and not _ACTIVE & set(request.fixturenames):
            BASELINE.apply()  # a state fixture this test did not ask for is still set up from an earlier test
        seed_all()
        yield
