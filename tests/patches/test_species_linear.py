"""The per-species self-connection against e3nn's FullyConnectedTensorProduct, in FP64."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from e3nn import o3

from cgforge.patches.graph_cache import CallGraphCache
from cgforge.patches.species_linear import (
    SpeciesGroups,
    SpeciesRoom,
    SpeciesSelfConnection,
    _running_counts,
    swap_in,
    swap_out,
)

# (irreps of x, irreps of the attributes, irreps out): MACE-MP skip_tp shapes (scaled down), NequIP's sc
SHAPES = [
    ("16x0e", "7x0e", "16x0e+16x1o"),  # MACE first layer: the 1o output has no path (zeros)
    ("16x0e+16x1o", "7x0e", "16x0e"),  # MACE last layer: the 1o input has no path
    ("16x0e+8x1o+4x2e", "6x0e", "12x0e+8x1o+4x2e"),  # NequIP
    ("4x0e+3x1o+3x1e+2x2o", "2x0e+3x0o", "5x0e+2x0o+3x1o+2x1e+4x2o"),  # odd scalars, repeated l
]


def _groups_and_inputs(tp: torch.nn.Module, species: torch.Tensor, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(int(species.max()) + 1, tp.irreps_in2.dim, generator=g, dtype=torch.float64)
    attrs = rows.index_select(0, species)  # attributes are a function of the species
    x = torch.randn(species.numel(), tp.irreps_in1.dim, generator=g, dtype=torch.float64, requires_grad=True)
    return SpeciesGroups.from_species(species), x, attrs


@pytest.mark.parametrize("irreps_x, irreps_a, irreps_out", SHAPES)
def test_per_species_path_equals_e3nn(irreps_x: str, irreps_a: str, irreps_out: str) -> None:
    torch.manual_seed(3)
    tp = o3.FullyConnectedTensorProduct(irreps_x, irreps_a, irreps_out).double()
    graphs = CallGraphCache()
    stand_in = SpeciesSelfConnection.wrap(tp, graphs)
    assert stand_in is not None
    assert list(stand_in.state_dict()) == list(tp.state_dict())
    species = torch.tensor([3, 0, 3, 1, 1, 0, 3, 3, 0, 5, 1])  # species 2 and 4 absent
    groups, x, attrs = _groups_and_inputs(tp, species)
    want = tp(x, attrs)
    with graphs.use_species(groups):
        got = stand_in(x, attrs)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(want)
    gx_want, gw_want = torch.autograd.grad(want, [x, tp.weight], grad)
    with graphs.use_species(groups):
        got = stand_in(x, attrs)
    gx_got, gw_got = torch.autograd.grad(got, [x, stand_in.weight], grad)
    torch.testing.assert_close(gx_got, gx_want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gw_got, gw_want, rtol=1e-12, atol=1e-12)


def run_launches(x: torch.Tensor, m, launches) -> torch.Tensor:  # noqa: ANN001
    """What the irreps_linear kernel writes for ``launches`` (map_reference per launch over its rows); NaN where
    no launch writes."""
    from cgforge.kernels.irreps_linear import map_reference

    out = torch.full((x.shape[0], m.out_width), float("nan"), dtype=x.dtype)
    for launch in launches:
        rows = launch.row_index if launch.row_index is not None else torch.arange(launch.count)
        assert rows.numel() == launch.count
        out[rows] = map_reference(x[rows], m, launch.blocks)
    return out


@pytest.mark.parametrize("irreps_x, irreps_a, irreps_out", SHAPES)
def test_kernel_launches_per_species_are_the_map_and_its_transpose(irreps_x: str, irreps_a: str,
                                                                     irreps_out: str) -> None:
    """The kernel's plan (one launch per species over its rows, each way), checked on the CPU by running each
    launch as map_reference: the forward is e3nn's product, the backward launches give autograd's grad x."""
    torch.manual_seed(4)
    tp = o3.FullyConnectedTensorProduct(irreps_x, irreps_a, irreps_out).double()
    stand_in = SpeciesSelfConnection.wrap(tp, CallGraphCache())
    species = torch.tensor([3, 0, 3, 1, 1, 0, 3, 3, 0, 5, 1])
    groups, x, attrs = _groups_and_inputs(tp, species)
    mats = stand_in.species_matrices(attrs.index_select(0, groups.representatives))
    forward, backward = stand_in.species_launches(torch.float64, torch.device("cpu"), groups, mats)
    m = stand_in.irreps_map()
    want = tp(x, attrs)
    torch.testing.assert_close(run_launches(x.detach(), m, forward), want, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(want)
    (gx_want,) = torch.autograd.grad(want, x, grad)
    torch.testing.assert_close(run_launches(grad, m.transpose(), backward), gx_want, rtol=1e-12, atol=1e-12)
    padded = SpeciesGroups(groups.order, groups.inverse, groups.counts, groups.representatives, 11, padded=True)
    assert stand_in._kernel_launches(x.cuda() if torch.cuda.is_available() else x, attrs, padded) is None


def test_species_room_groups_equal_exact_groups() -> None:
    """Fixed room per species (the captured LAMMPS step): the valid nodes' outputs and gradients equal the exact
    groups'; padding nodes past num_valid and unused room change nothing; counts say when a room overflowed."""
    torch.manual_seed(4)
    tp = o3.FullyConnectedTensorProduct("8x0e+4x1o", "4x0e", "8x0e+4x1o").double()
    graphs = CallGraphCache()
    stand_in = SpeciesSelfConnection.wrap(tp, graphs)
    species = torch.tensor([3, 0, 3, 1, 1, 0, 3, 3, 0, 1, 0, 0])  # the last 3 are padding (num_valid 9)
    valid = 9
    groups, x, attrs = _groups_and_inputs(tp, species)
    room = SpeciesRoom([5, 4, 0, 6], "cpu")  # species 2 absent: no group
    padded, counts = room.groups(species, torch.tensor(valid))
    assert counts.tolist() == [3, 2, 0, 4] and room.fits(counts.tolist())
    assert padded.counts == (5, 4, 6) and padded.order.shape[0] == 15
    assert torch.equal(padded.order.index_select(0, padded.inverse[:valid]), torch.arange(valid))
    grad = torch.randn(len(species), tp.irreps_out.dim, dtype=torch.float64)
    grad[valid:] = 0.0  # padding nodes' outputs are never summed
    outs = []
    for g in (groups, padded):
        with graphs.use_species(g):
            out = stand_in(x, attrs)
        outs.append((out[:valid], torch.autograd.grad(out, x, grad)[0]))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-12, atol=1e-12)
    _, counts = SpeciesRoom([2, 4, 0, 6], "cpu").groups(species, torch.tensor(valid))
    assert not SpeciesRoom([2, 4, 0, 6], "cpu").fits(counts.tolist())  # 3 of species 0 in a room of 2
    with pytest.raises(ValueError, match="capacities"):
        SpeciesRoom([0, 0], "cpu")


@pytest.mark.parametrize("nodes,groups", [(0, 2), (6, 0), (1, 1), (1000, 2), (300, 89)])
def test_running_counts_are_a_column_cumsum(nodes: int, groups: int) -> None:
    """The flat scan that places nodes in their species' rooms counts as ``cumsum(member, 0)`` does."""
    torch.manual_seed(nodes + groups)
    index = torch.randint(0, groups + 1, (nodes,))  # ``groups``: a node of no group (padding)
    member = index[:, None] == torch.arange(groups)[None, :]
    assert torch.equal(_running_counts(member), torch.cumsum(member.to(torch.int64), 0))


def test_without_groups_it_is_e3nn_exactly() -> None:
    """Outside a caller's ``use_species`` block (or for another node count) nothing is assumed."""
    tp = o3.FullyConnectedTensorProduct("8x0e+4x1o", "5x0e", "8x0e+4x1o").double()
    graphs = CallGraphCache()
    stand_in = SpeciesSelfConnection.wrap(tp, graphs)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, tp.irreps_in1.dim, generator=g, dtype=torch.float64)
    attrs = torch.randn(9, 5, generator=g, dtype=torch.float64)  # not a function of any species
    assert torch.equal(stand_in(x, attrs), tp(x, attrs))
    with graphs.use_species(SpeciesGroups.from_species(torch.zeros(4, dtype=torch.long))):
        assert torch.equal(stand_in(x, attrs), tp(x, attrs))  # 9 nodes, groups for 4: e3nn's path
    assert graphs.species is None


def test_the_species_assumption_is_what_the_per_species_path_uses() -> None:
    """With attributes that differ inside one species the per-species path is wrong: it must only run
    when the caller vouches (this is why the calculator, not the module, turns it on)."""
    tp = o3.FullyConnectedTensorProduct("8x0e", "5x0e", "8x0e").double()
    graphs = CallGraphCache()
    stand_in = SpeciesSelfConnection.wrap(tp, graphs)
    species = torch.tensor([0, 0, 1, 1])
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 8, generator=g, dtype=torch.float64)
    attrs = torch.randn(4, 5, generator=g, dtype=torch.float64)
    with graphs.use_species(SpeciesGroups.from_species(species)):
        got = stand_in(x, attrs)
    assert not torch.allclose(got, tp(x, attrs))
    # ... and exact for the representatives (the first node of each species)
    torch.testing.assert_close(got[[0, 2]], tp(x, attrs)[[0, 2]], rtol=1e-12, atol=1e-12)


def test_species_groups() -> None:
    species = torch.tensor([2, 0, 2, 2, 7, 0])
    groups = SpeciesGroups.from_species(species)
    assert groups.counts == (2, 3, 1)
    assert groups.num_nodes == 6
    assert torch.equal(species[groups.order], torch.tensor([0, 0, 2, 2, 2, 7]))
    assert torch.equal(groups.order[groups.inverse], torch.arange(6))
    assert torch.equal(species[groups.representatives], torch.tensor([0, 2, 7]))
    with pytest.raises(TypeError, match="species: expected a 1-D integer tensor"):
        SpeciesGroups.from_species(torch.zeros(3, 2))


def test_unsupported_products_are_kept() -> None:
    graphs = CallGraphCache()
    vector_attrs = o3.FullyConnectedTensorProduct("8x0e+4x1o", "2x0e+1x1o", "8x0e+4x1o")
    assert SpeciesSelfConnection.wrap(vector_attrs, graphs) is None
    uvu = o3.TensorProduct("8x0e", "1x0e", "8x0e", [(0, 0, 0, "uvu", True)])
    assert SpeciesSelfConnection.wrap(uvu, graphs) is None
    per_row = o3.FullyConnectedTensorProduct("8x0e", "3x0e", "8x0e", shared_weights=False, internal_weights=False)
    assert SpeciesSelfConnection.wrap(per_row, graphs) is None


def test_swap_in_and_out_keep_the_state_dict() -> None:
    model = torch.nn.Module()
    model.block = torch.nn.Module()
    model.block.skip_tp = o3.FullyConnectedTensorProduct("8x0e+4x1o", "3x0e", "8x0e").double()
    model.block.other = o3.FullyConnectedTensorProduct("8x0e", "3x0e", "8x0e").double()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    original = model.block.skip_tp
    graphs = CallGraphCache()
    assert swap_in(model, "skip_tp", graphs) == 1
    assert isinstance(model.block.skip_tp, SpeciesSelfConnection)
    assert not isinstance(model.block.other, SpeciesSelfConnection)
    assert swap_in(model, "skip_tp", graphs) == 0  # idempotent
    assert list(model.state_dict()) == list(before)
    model.load_state_dict(before)
    assert swap_out(model) == 1
    assert model.block.skip_tp is original
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


def test_the_calculator_runs_mace_self_connections_per_species(monkeypatch) -> None:

    from mace_helpers import build_model

    from cgforge.plugin import Calculator
    from cgforge.plugin.water import water_box

    calls = []
    per_species = SpeciesSelfConnection._per_species

    def spy(self, x, attrs, groups):
        calls.append(groups.counts)
        return per_species(self, x, attrs, groups)

    monkeypatch.setattr(SpeciesSelfConnection, "_per_species", spy)
    model = build_model()
    calc = Calculator(model, device="cpu", patch=True, warmup=False)
    calls.clear()  # patching checked each stand-in against e3nn
    atoms = water_box(8, seed=1)
    atoms.calc = calc
    energy = atoms.get_potential_energy()
    assert calls == [(16, 8), (16, 8)]  # both interaction blocks, 16 H and 8 O
    assert graphs_of(model).species is None  # only during the calculator's own call
    # without the groups every self-connection takes e3nn's path: the same energy and forces
    forces = atoms.get_forces()
    monkeypatch.setattr("cgforge.plugin.runtime.step_graph.ModelStep._species_groups", lambda self: None)
    atoms.calc = Calculator(build_model(), device="cpu", patch=True, warmup=False)
    calls.clear()
    assert abs(atoms.get_potential_energy() - energy) < 1e-12 * abs(energy)
    assert np.abs(atoms.get_forces() - forces).max() < 1e-12 * np.abs(forces).max()
    assert calls == []


def graphs_of(model: torch.nn.Module) -> CallGraphCache:
    from cgforge.patches.graph_cache import graph_caches

    (cache,) = graph_caches(model)
    return cache


@pytest.mark.cuda
@pytest.mark.parametrize("model", ["mace", "nequip"])
def test_cuda_captured_step_follows_a_species_change(model: str) -> None:
    """The capture holds the species groups: an in-place species change must recapture, not replay."""
    from cgforge.plugin import Calculator
    from cgforge.plugin.water import water_box

    atoms = water_box(64, seed=3)
    calc = Calculator(model, device="cuda")
    atoms.calc = calc
    atoms.get_forces()
    assert calc.cuda_graph
    atoms.numbers[[0, 5, 7]] = [8, 1, 8]
    forces = atoms.get_forces()
    energy = atoms.get_potential_energy()
    fresh = atoms.copy()
    fresh.calc = Calculator(model, device="cuda")
    assert abs(fresh.get_potential_energy() - energy) < 1e-5 * abs(energy)
    assert np.abs(fresh.get_forces() - forces).max() < 1e-4 * np.abs(forces).max()


@pytest.mark.cuda
@pytest.mark.parametrize("irreps_x, irreps_a, irreps_out", SHAPES)
def test_cuda_frozen_per_species_path_runs_the_kernel_equal_to_e3nn(irreps_x: str, irreps_a: str,
                                                                    irreps_out: str) -> None:
    torch.manual_seed(6)
    tp = o3.FullyConnectedTensorProduct(irreps_x, irreps_a, irreps_out).double().cuda().requires_grad_(False)
    graphs = CallGraphCache()
    stand_in = SpeciesSelfConnection.wrap(tp, graphs)
    species = torch.randint(0, 4, (500,), generator=torch.Generator().manual_seed(7))
    _, x, attrs = _groups_and_inputs(tp, species)
    groups = SpeciesGroups.from_species(species.cuda())
    x, attrs = x.detach().cuda().requires_grad_(), attrs.cuda()
    launches = stand_in._kernel_launches(x, attrs, groups)
    assert launches is not None and stand_in._kernel_launches(x, attrs, groups) is launches  # kept per groups
    attrs.mul_(1.0)  # an in-place change of the attributes: made again
    assert stand_in._kernel_launches(x, attrs, groups) is not launches
    results = []
    for run in (lambda v: stand_in(v, attrs), lambda v: tp(v, attrs)):
        with graphs.use_species(groups):
            out = run(x)
        (grad,) = torch.autograd.grad((out * out).sum(), x, create_graph=True)
        (second,) = torch.autograd.grad(grad.sum(), x)
        results.append((out.detach(), grad.detach(), second))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-11)
