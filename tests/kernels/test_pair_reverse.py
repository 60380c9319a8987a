"""The reverse of every pair of a neighbour list as a CUDA kernel (cgforge.kernels.pair_reverse): the source
compiles (NVRTC, no GPU needed) and runs on the CPU as C++ (``host_cuda``) equal to the sort beside it
(``pair_reverse_reference``, the CPU path), on cells with many images and self-images; a list missing a reverse
is flagged; on a GPU the same."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ase import Atoms
from host_cuda import assert_compiles_without_spills, build, call

from cgforge.kernels.edge_layout import edge_topology
from cgforge.kernels.pair_reverse import PAIR_REVERSE_SOURCE, pair_reverse, pair_reverse_reference
from cgforge.plugin.runtime.neighbours import neighbour_list
from cgforge.plugin.water import water_box

_DRIVER = r"""
extern "C" void run(const long long* sender, const long long* receiver, const long long* shifts,
                    const long long* rowptr, long long pairs, long long* reverse, int* missing) {
    blockDim.x = 64;
    for (long long b = 0; b * 64 < pairs; ++b)
        for (int t = 0; t < 64; ++t) {
            blockIdx.x = b; threadIdx.x = t;
            pair_reverse(sender, receiver, shifts, rowptr, pairs, reverse, missing);
        }
}
"""


def _lists() -> dict[str, tuple[torch.Tensor, ...]]:
    rng = np.random.default_rng(3)
    small = np.array([[6.0, 0.0, 0.0], [2.5, 5.5, 0.0], [-1.8, 1.2, 6.3]]) * 0.35
    boxes = {
        "water": (water_box(27, seed=2), 5.0),
        "many-images": (Atoms("H4", positions=rng.uniform(0, 1, (4, 3)) @ small, cell=small, pbc=True), 4.0),
        "mixed-pbc": (Atoms("H40", positions=rng.uniform(-0.5, 1.5, (40, 3)) * 6.0, cell=np.eye(3) * 6.0,
                            pbc=(True, False, True)), 3.0),
    }
    out = {}
    for name, (atoms, cutoff) in boxes.items():
        sender, receiver, shifts = neighbour_list(torch.tensor(atoms.positions), torch.tensor(atoms.cell.array),
                                                  tuple(atoms.pbc), cutoff)
        out[name] = (sender, receiver, shifts, len(atoms))
    return out


LISTS = _lists()


def test_kernel_compiles_without_spills() -> None:
    assert_compiles_without_spills(PAIR_REVERSE_SOURCE, "pair_reverse.cu", ["pair_reverse"])


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    return build(PAIR_REVERSE_SOURCE, _DRIVER, tmp_path_factory.mktemp("pair_reverse"), "pair_reverse")


def _host_reverse(library, sender, receiver, shifts, n) -> tuple[np.ndarray, int]:
    rowptr = torch.searchsorted(receiver, torch.arange(n + 1)).numpy()
    reverse = np.full(len(sender), -1, np.int64)
    missing = np.zeros(1, np.int32)
    call(library.run, [sender.numpy(), receiver.numpy(), shifts.contiguous().numpy(), rowptr, len(sender), reverse,
                       missing])
    return reverse, int(missing[0])


@pytest.mark.parametrize("name", list(LISTS))
def test_cuda_source_run_as_cpp_equals_the_sort(library, name) -> None:
    sender, receiver, shifts, n = LISTS[name]
    reverse, missing = _host_reverse(library, sender, receiver, shifts, n)
    want = pair_reverse_reference(sender, receiver, shifts, n)
    assert want is not None and missing == 0
    np.testing.assert_array_equal(reverse, want.numpy())
    rowptr = torch.searchsorted(receiver, torch.arange(n + 1))
    assert torch.equal(pair_reverse(sender, receiver, shifts, rowptr), want), "the CPU path is the reference"
    topology = edge_topology(sender, receiver, shifts, n, capacity=len(sender) + 3)
    assert torch.equal(topology.reverse, torch.cat([want, torch.arange(len(sender), len(sender) + 3)]))
    v = np.arange(len(sender))
    assert (reverse != v).all() or name == "many-images", "a pair is its own reverse only through an image"
    np.testing.assert_array_equal(reverse[reverse], v)


def test_a_missing_reverse_is_flagged(library) -> None:
    sender, receiver, shifts, n = LISTS["water"]
    keep = torch.ones(len(sender), dtype=torch.bool)
    keep[17] = False  # pair 17's reverse now has none
    reverse, missing = _host_reverse(library, sender[keep], receiver[keep], shifts[keep], n)
    assert missing == 1
    assert pair_reverse_reference(sender[keep], receiver[keep], shifts[keep], n) is None
    assert edge_topology(sender[keep], receiver[keep], shifts[keep], n) is None


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(LISTS))
def test_cuda_edge_topology_equals_the_cpu_one(name) -> None:
    sender, receiver, shifts, n = LISTS[name]
    cpu = edge_topology(sender, receiver, shifts, n, capacity=len(sender) + 7)
    gpu = edge_topology(sender.cuda(), receiver.cuda(), shifts.cuda(), n, capacity=len(sender) + 7)
    assert cpu is not None and gpu is not None
    assert torch.equal(gpu.rowptr.cpu(), cpu.rowptr) and torch.equal(gpu.reverse.cpu(), cpu.reverse)
    keep = torch.arange(len(sender)) != 5
    assert edge_topology(sender[keep].cuda(), receiver[keep].cuda(), shifts[keep].cuda(), n) is None
