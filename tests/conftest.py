import pytest
import torch

# Every test starts from the same torch default dtype, e3nn flags, TF32 settings and seeds (global_state.py
# says how module fixtures such as nequip_state still take effect inside their module).
from global_state import _module_global_state, _test_global_state, state_fixture  # noqa: F401


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def nequip_state():
    """nequip's global state for a module's tests that ask for it (others get the baseline), restored after."""
    pytest.importorskip("nequip")
    from global_state import nequip_global_state

    with nequip_global_state(), state_fixture("nequip_state"):
        yield
