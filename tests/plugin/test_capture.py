"""The one capture routine (cgforge.plugin.runtime.capture): buffer rounding, and (CUDA) the garbage collector
off during a capture, so that no dead CUDA graph is destroyed inside one."""

from __future__ import annotations

import gc

import pytest
import torch

from cgforge.plugin.runtime.capture import capture_graph, room

cuda = pytest.mark.cuda


@pytest.mark.parametrize("count,margin", [(0, 0.0), (1, 0.5), (64, 0.0), (1000, 0.2), (12345, 0.05)])
def test_room_leaves_the_margin_and_a_spare_block(count, margin):
    slots = room(count, margin)
    assert slots % 64 == 0
    assert slots >= count * (1 + margin) + 64 - 1e-9
    assert slots < count * (1 + margin) + 2 * 64


@cuda
def test_cuda_the_collector_is_off_only_during_the_capture():
    # A collection inside a capture that destroys a dead CUDA graph (an earlier engine's, in a reference cycle)
    # invalidates the capture: "operation failed due to a previous error during capture" (H200, 2026-11-29).
    device = torch.device("cuda")
    x = torch.arange(4096, dtype=torch.float32, device=device)
    collecting: list[bool] = []

    def compute() -> torch.Tensor:
        collecting.append(gc.isenabled())
        return x * 2 + 1

    gc.enable()
    graph, out = capture_graph(compute, device, torch.cuda.graph_pool_handle(), warmups=1)
    assert collecting == [True, False], "the warm-up with the collector on, the capture with it off"
    assert gc.isenabled(), "and on again after the capture"
    x.add_(1)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, x * 2 + 1), "the replay computes from the live input"
