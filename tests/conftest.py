import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def nequip_state():
    """nequip's global state for a module's tests, restored afterwards."""
    pytest.importorskip("nequip")
    from global_state import nequip_global_state

    with nequip_global_state():
        yield
