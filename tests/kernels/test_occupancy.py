"""The convolution backward's launch bound: the SM arithmetic, the rule on synthetic compile reports, and the
rule on real NVRTC compiles (CPU, sm_90) of MACE-MP-medium's second convolution."""

import pytest
import torch

from cgforge.kernels.core import occupancy
from cgforge.kernels.core.compiler import KernelResources, nvrtc_available
from cgforge.kernels.core.registry import compile_source
from cgforge.kernels.core.tuning import TPTuning
from cgforge.kernels.explain import instructions
from cgforge.kernels.tensor_product import plan as plans
from cgforge.kernels.tensor_product.layout import CONV_BACKWARD, CONV_FORWARD, TP_LAYOUT
from cgforge.kernels.tensor_product.problem import TPProblem

H100 = occupancy.SM_LIMITS["sm_90"]
MACE_L2_SMEM = 4 * 7744  # bytes a block of MACE-MP-medium's second convolution backward (FP32, 4 warps)


def _res(registers: int, stores: int = 0, loads: int = 0) -> KernelResources:
    return KernelResources("k", registers, stores, loads)


def test_blocks_per_sm():
    # 4 warps a block: registers allocated per warp in units of 256, 1 KB of shared memory reserved per block
    assert [H100.blocks(128, r, MACE_L2_SMEM) for r in (128, 96, 80, 72)] == [4, 5, 6, 7]
    assert H100.blocks(128, None, MACE_L2_SMEM) == 7  # shared memory: 228 KB // (30976 + 1024)
    assert H100.blocks(128, 33, 0) == H100.blocks(128, 40, 0) == 12  # 33 rounds up to 40 a thread
    assert H100.blocks(128, None, 0) == 16  # the warp limit (64 a SM)
    assert H100.blocks(1024, 32, 0) == 2
    assert occupancy.SM_LIMITS["sm_86"].blocks(128, None, 0) == 12  # 48 warps
    assert occupancy.sm_limits("sm_90a") == H100 and occupancy.sm_limits("sm_75") is None


def test_rule_on_synthetic_reports():
    # registers hold the blocks back (4 of the 7 shared memory allows): 5 blocks (20 warps) reach 30 %
    assert occupancy.proposed_min_blocks(H100, 128, MACE_L2_SMEM, _res(128)) == (5,)
    # 3 blocks now (168 registers): 5 first, then 4
    assert occupancy.proposed_min_blocks(H100, 128, MACE_L2_SMEM, _res(168)) == (5, 4)
    # 8-warp blocks, 2 now: 3 blocks (24 warps) reach 30 %
    assert occupancy.proposed_min_blocks(H100, 256, 0, _res(120)) == (3,)
    # shared memory, not registers, is the limit: nothing to gain
    assert occupancy.proposed_min_blocks(H100, 128, 60 * 1024, _res(128)) == ()
    # shared memory allows 4, registers 3: only 4
    assert occupancy.proposed_min_blocks(H100, 128, 50 * 1024, _res(168)) == (4,)
    # registers limit, but the SM already holds 12 blocks (48 of 64 warps): measured slower when bounded
    assert occupancy.proposed_min_blocks(H100, 128, 0, _res(40)) == ()
    assert occupancy.proposed_min_blocks(H100, 128, 0, _res(80)) == ()  # 24 warps (37.5 %): measured slower too
    unbounded = _res(80)
    assert occupancy.accepts_bound(H100, 128, 0, unbounded, _res(72), 7)
    assert not occupancy.accepts_bound(H100, 128, 0, unbounded, _res(96), 7)  # ptxas filled the budget
    assert not occupancy.accepts_bound(H100, 128, 0, unbounded, _res(80, 4, 4), 7)  # no fewer registers
    assert occupancy.accepts_bound(H100, 128, 0, unbounded, _res(72, 40, 76), 7)  # 116 B more: measured faster
    assert not occupancy.accepts_bound(H100, 128, 0, unbounded, _res(72, 64, 72), 7)  # spills too much
    assert occupancy.accepts_bound(H100, 128, 0, _res(80, 40, 40), _res(72, 40, 40), 7)  # no more than before

    compiled = []

    def fake_compile(min_blocks):
        compiled.append(min_blocks)
        return _res(128) if min_blocks is None else _res(96, 8, 24)

    assert occupancy.choose_min_blocks(H100, 128, MACE_L2_SMEM, fake_compile) == 5 and compiled == [None, 5]
    compiled.clear()

    def spills_at_five(min_blocks):  # 168 unbounded; 5 blocks spill too much, 4 do not: 4 is kept
        compiled.append(min_blocks)
        return {None: _res(168), 5: _res(96, 100, 200), 4: _res(128)}[min_blocks]

    assert occupancy.choose_min_blocks(H100, 128, MACE_L2_SMEM, spills_at_five) == 4 and compiled == [None, 5, 4]
    compiled.clear()
    assert occupancy.choose_min_blocks(None, 128, MACE_L2_SMEM, fake_compile) is None and compiled == []


def test_tuning_value(monkeypatch):
    assert TPTuning().backward_min_blocks == "auto" and TPTuning().key() == "None|None|auto"  # old keys kept
    assert TPTuning(backward_min_blocks=0).key().endswith("|0")
    for bad in (-1, 33, "5", True, 2.0):
        with pytest.raises(ValueError, match="backward_min_blocks"):
            TPTuning(backward_min_blocks=bad)
    monkeypatch.setenv("CGFORGE_BACKWARD_MIN_BLOCKS", "0")  # a leftover variable changes nothing
    problem = TPProblem.build(*instructions("8x0e", "0e", "8x0e", "uvu"))
    assert plans.get(plans.register(problem)).tuning == TPTuning()


def _mace_layer2(tuning: TPTuning) -> plans.Plan:
    problem = TPProblem.build(*instructions("128x0e+128x1o", "0e+1o+2e+3o", "128x0e+128x1o+128x2e+128x3o", "uvu"))
    return plans.get(plans.register(problem, tuning))


def test_forced_and_disabled_bounds_need_no_compile():
    layout = CONV_BACKWARD.with_table()
    assert _mace_layer2(TPTuning(backward_min_blocks=0)).backward_min_blocks(torch.float32, layout, "sm_90") is None
    forced = _mace_layer2(TPTuning(backward_min_blocks=6))
    assert forced.backward_min_blocks(torch.float32, layout, "sm_90") == 6
    assert "__launch_bounds__(4 * 32, 6)" in forced.source(torch.float32, layout, True, 6)[0]
    # the auto rule leaves kernels other than the convolution's backward alone
    auto = _mace_layer2(TPTuning())
    assert auto.backward_min_blocks(torch.float32, TP_LAYOUT, "sm_90") is None


@pytest.mark.skipif(not nvrtc_available(), reason="NVRTC library not installed")
def test_mace_layer2_backward_gets_a_bound_that_lowers_its_registers():
    plan = _mace_layer2(TPTuning())  # the chunks order, chunk 32: 128 registers, 4 blocks unbounded
    layout = CONV_BACKWARD.with_table()
    bound = plan.backward_min_blocks(torch.float32, layout, "sm_90")
    assert bound is not None
    reports = {}
    for b in (None, bound):
        source, function = plan.source(torch.float32, layout, True, b)
        reports[b] = compile_source(source, function, "sm_90").resources(function)
        assert ("__launch_bounds__(4 * 32, " in source) == (b is not None)
    launch = plan.schedule(torch.float32, True).backward_launch
    shared = launch.warps_per_block * launch.smem_per_warp * 4
    assert reports[bound].registers < reports[None].registers
    assert H100.blocks(128, reports[bound].registers, shared) == bound > H100.blocks(128, reports[None].registers,
                                                                                      shared)
    assert plan.source(torch.float32, CONV_FORWARD, False, None)[1].endswith("_forward")
