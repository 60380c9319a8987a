import signal

import pytest
import torch

# The Ctrl-C tests need Python's own SIGINT handler: a process started in the background of a shell without job
# control inherits SIGINT ignored, and then neither run_md nor a `cgforge md` subprocess would see a Ctrl-C.
signal.signal(signal.SIGINT, signal.default_int_handler)

# Every test starts from the same torch default dtype, e3nn flags, TF32 settings and seeds (global_state.py
# says how module fixtures such as nequip_state still take effect inside their module).
from global_state import _module_global_state, _test_global_state, state_fixture  # noqa: E402, F401


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


@pytest.fixture
def fp64_one_thread():
    """FP64 default dtype and one CPU thread (the engine tests run thousands of tiny steps), restored after."""
    dtype, threads = torch.get_default_dtype(), torch.get_num_threads()
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    yield
    torch.set_default_dtype(dtype)
    torch.set_num_threads(threads)
