"""Isolation of process-wide state between tests (global_state.py): a fresh pytest session whose tests change
the default dtype, e3nn's flags, TF32 and the generators, run in a fixed order with and without the fixtures.
With them every test sees the state it asked for; without them the same tests fail, so they can."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

COMMON = """
import random

import e3nn
import numpy as np
import pytest
import torch
from global_state import BASELINE, SEED, state_fixture


def draws():
    return torch.rand(3).tolist(), np.random.rand(2).tolist(), random.random()


def seeded_draws():
    torch.manual_seed(SEED); np.random.seed(SEED); random.seed(SEED)
    return draws()


def assert_baseline():
    assert torch.get_default_dtype() == torch.float32
    assert e3nn.get_optimization_defaults() == dict(BASELINE.e3nn_flags)
    assert torch.get_float32_matmul_precision() == "highest"


def change_everything():
    torch.set_default_dtype(torch.float64)
    e3nn.set_optimization_defaults(specialized_code=False, optimize_einsums=False)
    torch.set_float32_matmul_precision("medium")
    draws()
"""

# Files run in name order, tests in file order: each test checks what the ones before may have left.
FILES = {
    "test_1_leaks.py": COMMON + """
def test_changes_everything():
    assert_baseline()
    change_everything()


def test_starts_at_the_baseline_with_fresh_seeds():
    first = draws()
    assert first == seeded_draws()
    assert_baseline()
    change_everything()
""",
    "test_2_module_fixture.py": COMMON + """
@pytest.fixture(scope="module")
def float64_state():
    with state_fixture("float64_state"):
        torch.set_default_dtype(torch.float64)  # and never restored: the module baseline must undo it
        yield


def test_asks_for_float64(float64_state):
    assert torch.get_default_dtype() == torch.float64
    change_everything()


def test_does_not_ask_for_it():
    assert_baseline()


def test_asks_again(float64_state):
    assert torch.get_default_dtype() == torch.float64
    assert e3nn.get_optimization_defaults() == dict(BASELINE.e3nn_flags)
""",
    "test_3_autouse_module_fixture.py": COMMON + """
@pytest.fixture(scope="module", autouse=True)
def _float64_for_every_test():
    torch.set_default_dtype(torch.float64)
    yield


def test_sees_float64_and_changes_it():
    assert torch.get_default_dtype() == torch.float64
    assert draws() == seeded_draws()
    torch.set_default_dtype(torch.float32)


def test_still_sees_float64():
    assert torch.get_default_dtype() == torch.float64
""",
    "test_4_after.py": COMMON + """
def test_a_later_module_starts_at_the_baseline():
    assert_baseline()
    assert draws() == seeded_draws()
""",
}


@pytest.fixture
def session(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyfile(**{name.removesuffix(".py"): text for name, text in FILES.items()})
    return pytester


def test_every_test_starts_from_the_state_it_asked_for(session: pytest.Pytester) -> None:
    result = session.runpytest("-p", "global_state", "-p", "no:randomly", "-q",
                               "-W", "ignore::pytest.PytestAssertRewriteWarning")  # imported by conftest already
    result.assert_outcomes(passed=8)


def test_without_the_fixtures_the_same_tests_fail(session: pytest.Pytester) -> None:
    result = session.runpytest("-p", "no:randomly", "-q")
    outcomes = result.parseoutcomes()
    # the leaks reach test 2 of file 1, the last two of file 2, both of file 3 and file 4
    assert outcomes.get("failed", 0) >= 4, result.stdout.str()
