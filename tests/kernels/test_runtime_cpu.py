"""The launch layer's checks that need no GPU: argument typing, launch dimensions, copies, clear errors."""

from __future__ import annotations

import copy
import ctypes
import pickle

import numpy as np
import pytest
import torch

from cgforge.kernels.core import runtime
from cgforge.kernels.core.runtime import F32, F64, I32, I64, KernelHandle


@pytest.mark.parametrize(("arg", "ctype", "value"), [
    (I32(-5), ctypes.c_int32, -5),
    (I64(2**40), ctypes.c_int64, 2**40),
    (F32(0.5), ctypes.c_float, 0.5),
    (F64(-1.25), ctypes.c_double, -1.25),
    (np.int32(7), ctypes.c_int32, 7),
    (np.int64(-8), ctypes.c_int64, -8),
    (np.uint32(9), ctypes.c_uint32, 9),
    (np.uint64(2**63), ctypes.c_uint64, 2**63),
    (np.float32(1.5), ctypes.c_float, 1.5),
    (np.float64(2.5), ctypes.c_double, 2.5),
    (None, ctypes.c_uint64, 0),
])
def test_arguments_get_their_declared_c_type(arg, ctype, value):
    c_value = runtime._c_value(0, arg, device=0)
    assert type(c_value) is ctype and c_value.value == value
    assert ctypes.sizeof(c_value) == ctypes.sizeof(ctype)


@pytest.mark.parametrize("arg", [3, 2.0, True, "x", np.int16(1), [1]])
def test_untyped_arguments_are_refused(arg):
    with pytest.raises(TypeError, match="kernel argument 2"):
        runtime._c_value(2, arg, device=0)


def test_cpu_tensor_argument_is_refused():
    with pytest.raises(ValueError, match="kernel argument 0: tensor is on cpu"):
        runtime._c_value(0, torch.zeros(3), device=0)


def test_out_of_range_wrapped_ints_are_refused():
    with pytest.raises(OverflowError):
        I32(2**31).ctype()
    with pytest.raises(OverflowError):
        I64(-(2**63) - 1).ctype()


def test_launch_dimensions_are_normalised_and_checked():
    assert runtime._dims("grid", (5,)) == (5, 1, 1)
    assert runtime._dims("grid", 7) == (7, 1, 1)
    assert runtime._dims("grid", [2, np.int64(3)]) == (2, 3, 1)
    assert runtime._dims("block", (32, 4, 2)) == (32, 4, 2)
    for bad in [(), (1, 2, 3, 4), (0,), (-1, 1), (1.5,), (True,), "12"]:
        with pytest.raises(ValueError, match="grid"):
            runtime._dims("grid", bad)


def test_kernel_handles_survive_deepcopy_and_pickle():
    handle = KernelHandle(b"\x7fELF fake cubin", "ab" * 32, "my_kernel")
    for clone in (copy.deepcopy(handle), pickle.loads(pickle.dumps(handle))):
        assert isinstance(clone, KernelHandle) and clone is not handle
        assert clone.name == "my_kernel" and repr(clone) == repr(handle)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU errors")
def test_gpu_entry_points_fail_clearly_without_a_gpu():
    with pytest.raises(RuntimeError, match="CUDA device"):
        runtime.device_arch()
    with pytest.raises(RuntimeError, match="CUDA device"):
        runtime.load_kernels(b"\x7fELF", ["k"])
    with pytest.raises(TypeError, match="cubin"):
        runtime.load_kernels(b"", ["k"])
    with pytest.raises(TypeError, match="names"):
        runtime.load_kernels(b"\x7fELF", "k")
