"""The reduce-scatter of grad y's partials over a warp (core/warp_reduce.py, the template's reduce_scatter):
its plan, its steps simulated lane by lane, and the kernels that print it (CPU; the CUDA tests run it)."""

from __future__ import annotations

import random

import pytest

from cgforge.kernels.core import warp_reduce
from cgforge.kernels.core.tuning import TPTuning
from cgforge.kernels.problem_set import PROBLEMS
from cgforge.kernels.tensor_product.codegen import grad_y_groups, render
from cgforge.kernels.tensor_product.layout import CONV_BACKWARD
from cgforge.kernels.tensor_product.problem import TPProblem
from cgforge.kernels.tensor_product.schedule import build_schedule


@pytest.mark.parametrize("width", [1, 2, 4, 8, 16, 32])
def test_each_lane_ends_with_the_warp_sum_of_its_partial(width: int) -> None:
    rng = random.Random(width)
    values = [[rng.uniform(-1, 1) for _ in range(width)] for _ in range(32)]
    got = warp_reduce.simulate(values, width)
    shift = 5 - (width.bit_length() - 1)
    for lane in range(32):
        assert got[lane] == pytest.approx(sum(values[k][lane >> shift] for k in range(32)), abs=1e-12)


def test_the_plan_covers_every_partial_once_at_fewer_shuffles_than_a_butterfly_each() -> None:
    assert warp_reduce.shuffles(1) == 5 and warp_reduce.shuffles(8) == 9 and warp_reduce.shuffles(32) == 31
    for count in range(0, 70):
        groups = warp_reduce.plan(count)
        covered = [i for g in groups for i in range(g.first, g.first + g.size)]
        assert covered == list(range(count))
        assert all(1 <= g.size <= g.width <= 8 for g in groups)
        assert sum(warp_reduce.shuffles(g.width) for g in groups) <= 5 * count
    assert [(g.size, g.width) for g in warp_reduce.plan(17)] == [(8, 8), (8, 8), (1, 1)]  # 23 shuffles, 85 apart
    with pytest.raises(ValueError, match="partials"):
        warp_reduce.plan(-1)
    with pytest.raises(ValueError, match="power of two"):
        warp_reduce.simulate([[0.0] * 3] * 32, 3)


def test_grad_y_groups_name_the_registers_and_their_targets() -> None:
    # slots 1, 2, 4 of in2 (3 untouched: a zero), then grad r: one group of 8 (9 shuffles; 4 + 1 would take 11)
    (group,) = grad_y_groups((1, 2, 4), table=True)
    assert (group.width, group.size, group.n_y, group.y_first, group.grad_r, group.shift) == (8, 5, 4, 1, True, 2)
    assert group.values == ("gya[0]", "gya[1]", "0", "gya[2]", "gra", "0", "0", "0")
    padded = grad_y_groups((0, 1, 2), table=False)[0]
    assert padded.values == ("gya[0]", "gya[1]", "gya[2]", "0") and padded.size == 3 and padded.shift == 3
    butterflies = grad_y_groups((0, 1, 2), table=True, scatter=False)
    assert [(g.width, g.y_first, g.n_y, g.grad_r) for g in butterflies] == [
        (1, 0, 1, False), (1, 1, 1, False), (1, 2, 1, False), (1, 0, 0, True)]


def test_the_backward_prints_the_reduction_and_the_tuning_turns_it_off() -> None:
    problem = TPProblem.build(*PROBLEMS["mace-medium"])
    for scatter, width in ((True, 8), (False, 1)):
        schedule = build_schedule(problem, itemsize=4, tuning=TPTuning(grad_y_reduce_scatter=scatter),
                                  rows_are_nodes=True)
        source, name = render(schedule, "float", CONV_BACKWARD.with_table(), forward=False, backward=True)
        assert f"reduce_scatter<{width}>(part, lane)" in source
        assert ("reduce_scatter<8>" in source) == scatter
    names = {render(build_schedule(problem, itemsize=4, tuning=TPTuning(grad_y_reduce_scatter=s),
                                   rows_are_nodes=True), "float", CONV_BACKWARD, False, True)[1] for s in (True, False)}
    assert len(names) == 2  # the two kernels are told apart by name (profiles)


def test_the_knob_is_a_validated_bool() -> None:
    assert TPTuning().grad_y_reduce_scatter is True
    assert "grad_y_reduce_scatter=False" in TPTuning(grad_y_reduce_scatter=False).key()
    with pytest.raises(ValueError, match="grad_y_reduce_scatter"):
        TPTuning(grad_y_reduce_scatter="yes")
