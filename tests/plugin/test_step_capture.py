"""The model step on static buffers: device-side edge layout, padding, whole-Verlet-list mode, pinned graphs,
capacity growth, and (CUDA) CUDA-graph capture equal to the eager step.

The reference everywhere is the eager step with exact edge counts (the calculator's CPU path), which
test_calculator.py checks against MACE's and NequIP's own calculators.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from mace_helpers import build_model, rel_err  # noqa: E402

from cgforge import kernels  # noqa: E402
from cgforge.kernels import edge_layout as el  # noqa: E402
from cgforge.plugin import Calculator  # noqa: E402
from cgforge.plugin.runtime import step_graph  # noqa: E402
from cgforge.plugin.runtime.neighbours import VerletNeighbourList  # noqa: E402
from cgforge.plugin.water import water_box  # noqa: E402

cuda = pytest.mark.cuda
TOL = 1e-12  # FP64, relative


# ---------------------------------------------------------------------------------------------
# Layout


def _random_edges(n: int, e: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    receiver = torch.sort(torch.randint(0, n, (e,), generator=gen)).values
    sender = torch.randint(0, n, (e,), generator=gen)
    shifts = torch.randint(-1, 2, (e, 3), generator=gen).double()
    keep = torch.rand(e, generator=gen) < 0.6
    return keep, sender, receiver, shifts


@pytest.mark.parametrize("n,e,extra", [(7, 40, 13), (5, 60, 0), (9, 3, 30), (4, 0, 5)])
def test_layout_keeps_selected_edges_sorted_with_spread_padding(n, e, extra):
    keep, sender, receiver, shifts = _random_edges(n, e, seed=n + e)
    count = int(keep.sum())
    pad = torch.tensor([13.0, 0.0, 0.0], dtype=torch.float64)
    layout = el.layout_edges(keep, sender, receiver, shifts, n, count + extra, pad, with_graph=True)
    assert int(layout.count) == count and layout.capacity == count + extra
    is_pad = layout.pad_offset.abs().sum(1) > 0
    assert int(is_pad.sum()) == extra
    real = ~is_pad
    assert torch.equal(layout.sender[real], sender[keep]) and torch.equal(layout.receiver[real], receiver[keep])
    assert torch.equal(layout.unit_shifts[real], shifts[keep])
    slots = torch.nonzero(real).flatten()
    assert torch.equal(layout.slot[keep], slots) and (layout.slot[~keep] == layout.capacity).all()
    assert torch.equal(layout.sender[is_pad], layout.receiver[is_pad]), "padding edges are self-edges"
    assert torch.equal(layout.pad_offset[is_pad], pad.expand(extra, 3))
    assert (layout.unit_shifts[is_pad] == 0).all()
    assert bool((layout.receiver[1:] >= layout.receiver[:-1]).all()), "receiver-sorted, padding included"
    per_atom = torch.bincount(layout.receiver[is_pad], minlength=n)
    assert int(per_atom.max()) <= -(-extra // n), "padding spread evenly over the atoms"
    # The trusted graph is field for field the one ConvGraph's own constructor builds.
    mine = el.conv_graph(layout, n)
    theirs = kernels.ConvGraph(layout.sender, layout.receiver, n)
    assert mine.num_nodes == theirs.num_nodes and mine.deterministic and mine.num_edges == theirs.num_edges
    for a, b in zip(mine.tensors(), theirs.tensors()):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_layout_overflow_is_reported_and_stays_in_bounds():
    n = 6
    keep, sender, receiver, shifts = _random_edges(n, 50, seed=3)
    count = int(keep.sum())
    pad = el.pad_offset_vector(4.0, torch.float64, torch.device("cpu"))
    layout = el.layout_edges(keep, sender, receiver, shifts, n, count - 4, pad, with_graph=True)
    assert int(layout.count) == count > layout.capacity
    assert int(layout.sender.max()) < n and int(layout.receiver.max()) < n
    rowptr = layout.graph[2]
    assert int(rowptr[-1]) <= layout.capacity and bool((rowptr[1:] >= rowptr[:-1]).all())


def _verlet_list(seed: int = 5, cutoff: float = 4.0):
    from cgforge.plugin.runtime.neighbours import neighbour_list

    atoms = water_box(8, seed=seed)  # a 6.2 A cube: atoms see their own images, several shifts per pair
    atoms.rattle(0.05, seed=seed)
    return neighbour_list(torch.tensor(atoms.positions), torch.tensor(np.array(atoms.cell)), True, cutoff), len(atoms)


def test_edge_topology_of_a_neighbour_list():
    (sender, receiver, shifts), n = _verlet_list()
    topology = el.edge_topology(sender, receiver, shifts, n, capacity=sender.shape[0] + 5)
    rev = topology.reverse
    v = sender.shape[0]
    assert torch.equal(rev[v:], torch.arange(v, v + 5)), "entries past the list are their own reverse"
    rev = rev[:v]
    assert torch.equal(rev[rev], torch.arange(v))
    assert torch.equal(sender[rev], receiver) and torch.equal(receiver[rev], sender)
    assert torch.equal(shifts[rev], -shifts)
    for r in range(n):
        assert bool((receiver[topology.rowptr[r]:topology.rowptr[r + 1]] == r).all())
    assert int(topology.rowptr[-1]) == v
    # a list missing one direction of a pair has no topology
    drop = 7
    keep = torch.arange(v) != drop
    assert el.edge_topology(sender[keep], receiver[keep], shifts[keep], n) is None


@pytest.mark.parametrize("extra", [0, 37])
def test_layout_with_topology_needs_no_sort_and_is_the_same_graph(extra):
    """The topology path: same edges, slots and row pointers; the transpose from reverse edges, not a sort."""
    (sender, receiver, shifts), n = _verlet_list()
    topology = el.edge_topology(sender, receiver, shifts, n)
    gen = torch.Generator().manual_seed(extra)
    u = torch.rand(sender.shape[0], generator=gen)
    keep = torch.minimum(u, u[topology.reverse]) < 0.6  # symmetric, as lengths of a pair are
    count = int(keep.sum())
    pad = torch.tensor([13.0, 0.0, 0.0], dtype=torch.float64)
    args = (keep, sender, receiver, shifts.double(), n, count + extra, pad)
    plain = el.layout_edges(*args, with_graph=True)
    fast = el.layout_edges(*args, with_graph=True, topology=topology)
    for a, b in zip([plain.sender, plain.receiver, plain.unit_shifts, plain.pad_offset, plain.count, *plain.graph[:5]],
                    [fast.sender, fast.receiver, fast.unit_shifts, fast.pad_offset, fast.count, *fast.graph[:5]]):
        assert a.dtype == b.dtype and torch.equal(a, b)
    perm_t, rowptr_t = fast.graph[5].long(), fast.graph[4]
    cap = count + extra
    assert torch.equal(torch.sort(perm_t).values, torch.arange(cap)), "a permutation of the slots"
    senders_in_order = torch.repeat_interleave(torch.arange(n), rowptr_t[1:] - rowptr_t[:-1])
    assert torch.equal(fast.sender[perm_t], senders_in_order), "row s of the transpose lists edges sent by s"
    # what the backward kernel sums per sender, in the transpose's order, is the scatter by sender
    values = torch.randn(cap, 3, generator=gen, dtype=torch.float64)
    per_sender = torch.stack([values[perm_t[rowptr_t[s]:rowptr_t[s + 1]]].sum(0) for s in range(n)])
    torch.testing.assert_close(per_sender, torch.zeros(n, 3, dtype=torch.float64).index_add(0, fast.sender, values))
    # a kept edge whose reverse is not kept is dropped (the kept set stays symmetric)
    one_sided = keep.clone()
    one_sided[int(torch.nonzero(keep)[0])] = False
    lopsided = el.layout_edges(one_sided, *args[1:], with_graph=True, topology=topology)
    assert int(lopsided.count) == count - 2


def test_pinned_graph_serves_only_its_own_edge_tensors():
    from cgforge.patches.graph_cache import CallGraphCache

    cache = CallGraphCache()
    edge_index = torch.tensor([[0, 1, 2, 2], [1, 2, 0, 1]])
    pinned = kernels.ConvGraph(edge_index[0], edge_index[1], 3)
    cache.pin(edge_index[0], edge_index[1], pinned)
    assert cache.get(edge_index[0], edge_index[1], 3) is pinned
    cache(None, ())  # the model's forward pre-hook: a new call
    assert cache.get(edge_index[0], edge_index[1], 3) is pinned, "a pinned graph outlives the per-call reset"
    edge_index[1, 0] = 0  # refilled in place by its owner: still served (the owner re-pins a matching graph)
    assert cache.get(edge_index[0], edge_index[1], 3) is pinned
    other = cache.get(edge_index.clone()[0], edge_index[1], 3)
    assert other is not pinned and torch.equal(other.sender, edge_index[0].int()), "other tensors: built"
    assert cache.get(edge_index[1], edge_index[0], 3) is not pinned, "swapped rows: another graph"
    assert cache.get(edge_index[0], edge_index[1], 4) is not pinned, "another node count: another graph"
    cache.unpin()
    assert cache.pinned is None and cache.get(edge_index[0], edge_index[1], 3) is not pinned
    with pytest.raises(TypeError, match="ConvGraph"):
        cache.pin(edge_index[0], edge_index[1], "graph")


# ---------------------------------------------------------------------------------------------
# Whole Verlet list and padding give the filtered numbers


def _box(seed: int = 1, triclinic: bool = False):
    atoms = water_box(8, seed=seed)
    if triclinic:
        cell = np.array(atoms.cell)
        cell[1] += 0.3 * cell[0]
        cell[2] += 0.2 * cell[0] - 0.25 * cell[1]
        atoms.set_cell(cell, scale_atoms=True)
    atoms.rattle(0.05, seed=seed + 1)
    return atoms


def _run(step, calc, atoms, stress=True):
    species = calc.adapter.species(atoms.numbers)
    return step.run(atoms.positions, np.asarray(atoms.cell), tuple(bool(p) for p in atoms.pbc), species,
                    forces=True, stress=stress, per_atom=True)


def _parts(out: np.ndarray, n: int) -> dict[str, np.ndarray]:
    """run()'s output with forces and per-atom energies, with or without the virial."""
    virial = 9 if out.size == 1 + 4 * n + 9 else 0
    at = 1 + 3 * n
    parts = {"energy": out[:1], "forces": out[1:at], "energies": out[at + virial:]}
    if virial:
        parts["virial"] = out[at:at + virial]
    return parts


def _assert_same(got: np.ndarray, ref: np.ndarray, n: int, tol: float = TOL) -> None:
    assert got.shape == ref.shape
    for key, value in _parts(ref, n).items():
        assert np.linalg.norm(value) > 0
        err = rel_err(_parts(got, n)[key], value)
        assert err < tol, f"{key}: relative error {err:.3g}"


MODES = {"whole-list": dict(filter_edges=False), "padded": dict(filter_edges=True, padded=True, margin=0.5),
         "whole-list-padded": dict(filter_edges=False, padded=True, margin=0.5)}


@pytest.fixture(scope="module")
def mace_calc():
    return Calculator(build_model(r_max=4.0), device="cpu", patch=True, skin=1.0, warmup=False)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("triclinic", [False, True])
def test_mace_whole_list_and_padding_match_the_filtered_step(mace_calc, mode, triclinic):
    atoms = _box(triclinic=triclinic)
    ref = _run(mace_calc.step, mace_calc, atoms)
    step = step_graph.ModelStep(mace_calc.adapter, VerletNeighbourList(mace_calc.cutoff, 1.0), **MODES[mode])
    got = _run(step, mace_calc, atoms)
    _assert_same(got, ref, len(atoms))
    assert step.capacity > mace_calc.step.n_edges or mode == "whole-list"
    if mode.startswith("whole-list"):
        assert step.n_edges == step.neighbours.sender.shape[0] > mace_calc.step.n_edges  # skin edges were fed
    else:
        assert step.n_edges == mace_calc.step.n_edges


@pytest.mark.parametrize("padded", [False, True])
def test_sorted_and_topology_layouts_give_the_same_step(mace_calc, padded):
    atoms = _box(seed=6, triclinic=True)
    steps = []
    for use_topology in (True, False):
        step = step_graph.ModelStep(mace_calc.adapter, VerletNeighbourList(mace_calc.cutoff, 1.0), padded=padded)
        step.use_topology = use_topology
        steps.append(step)
    topo, plain = (_run(step, mace_calc, atoms) for step in steps)
    assert steps[0]._topology is not None and steps[1]._topology is None
    _assert_same(topo, plain, len(atoms))
    assert steps[0].n_edges == steps[1].n_edges


@pytest.mark.parametrize("interaction", ["RealAgnosticInteractionBlock", "RealAgnosticDensityResidualInteractionBlock"])
def test_every_checked_mace_block_ignores_skin_edges(interaction):
    calc = Calculator(build_model(interaction=interaction, r_max=4.0), device="cpu", patch=True, warmup=False)
    assert calc.inert_edges_reason is None
    atoms = _box(seed=5)
    step = step_graph.ModelStep(calc.adapter, VerletNeighbourList(calc.cutoff, 1.0), filter_edges=False,
                                padded=True, margin=0.3)
    _assert_same(_run(step, calc, atoms), _run(calc.step, calc, atoms), len(atoms))


def test_models_with_live_skin_edges_are_not_padded():
    model = build_model(interaction="RealAgnosticAttResidualInteractionBlock", r_max=4.0)
    calc = Calculator(model, device="cpu", patch=True, warmup=False)
    assert "RealAgnosticAttResidualInteractionBlock" in calc.inert_edges_reason
    assert not calc.step.padded and calc.step.filter_edges
    with pytest.raises(ValueError, match="filter_edges=False needs a model"):
        Calculator(copy.deepcopy(model), device="cpu", patch=True, warmup=False, filter_edges=False)
    # and indeed: feeding it the skin edges would change its energy
    atoms = _box(seed=2)
    step = step_graph.ModelStep(calc.adapter, VerletNeighbourList(calc.cutoff, 1.0), filter_edges=False)
    assert abs(_run(step, calc, atoms)[0] - _run(calc.step, calc, atoms)[0]) > 1e-6


# ---------------------------------------------------------------------------------------------
# Reuse between rebuilds, pinned graphs, capacity growth


def test_whole_list_lays_out_and_builds_the_graph_once_per_rebuild(mace_calc, monkeypatch):
    fresh = Calculator(copy.deepcopy(mace_calc.model), device="cpu", patch=True, skin=0.0, warmup=False)
    atoms = _box(seed=4)
    rng = np.random.default_rng(0)
    frames, refs = [], []
    for _ in range(8):
        atoms.positions += rng.normal(scale=0.02, size=atoms.positions.shape)
        frames.append(atoms.copy())
        refs.append(_run(fresh.step, fresh, atoms, stress=False))

    layouts, graphs = [], []
    real_layout = step_graph.layout_edges

    def counting_layout(*args, **kwargs):
        layouts.append(1)
        return real_layout(*args, **kwargs)

    class CountingGraph(kernels.ConvGraph):
        def __init__(self, *args, **kwargs):
            graphs.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(step_graph, "layout_edges", counting_layout)
    monkeypatch.setattr(kernels, "ConvGraph", CountingGraph)
    step = step_graph.ModelStep(mace_calc.adapter, VerletNeighbourList(mace_calc.cutoff, 0.6), filter_edges=False,
                                padded=True)
    pointers = set()
    for frame, ref in zip(frames, refs):
        _assert_same(_run(step, mace_calc, frame, stress=False), ref, len(frame))
        pointers.add(step._layout.sender.data_ptr())
    builds = step.neighbours.n_builds
    assert 1 <= builds < 8
    assert len(layouts) == builds, "one layout per neighbour-list rebuild, none per step"
    assert graphs == [], "every layer used the pinned graph: no ConvGraph was built or checked per call"
    assert len(pointers) == 1, "rebuilds refill the same buffers"


def test_filtered_step_uses_the_pinned_graph(mace_calc, monkeypatch):
    built = []

    class CountingGraph(kernels.ConvGraph):
        def __init__(self, *args, **kwargs):
            built.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(kernels, "ConvGraph", CountingGraph)
    atoms = _box(seed=6)
    _run(mace_calc.step, mace_calc, atoms)
    assert built == []
    caches = mace_calc.step.caches
    assert len(caches) == 1 and caches[0].pinned is not None


def test_overflowing_capacity_grows_and_the_step_is_redone(mace_calc):
    atoms = _box(seed=7)
    step = step_graph.ModelStep(mace_calc.adapter, VerletNeighbourList(mace_calc.cutoff, 2.0), padded=True,
                                margin=0.0)
    ref = _run(mace_calc.step, mace_calc, atoms)
    _assert_same(_run(step, mace_calc, atoms), ref, len(atoms))
    step._capacity = step.n_edges - 5  # as if the edge count had risen past the capacity since it was sized
    rng = np.random.default_rng(1)
    for _ in range(3):  # edge counts change, no rebuild (skin 2 Å)
        atoms.positions += rng.normal(scale=0.05, size=atoms.positions.shape)
        _assert_same(_run(step, mace_calc, atoms), _run(mace_calc.step, mace_calc, atoms), len(atoms))
        assert step.capacity >= step.n_edges == mace_calc.step.n_edges
    assert step.neighbours.n_builds == 1


def test_repeated_overflows_leave_growing_room(mace_calc):
    """Each overflow doubles the room the new capacity leaves (1 %, 2 %, 4 %, ... at most MAX_GROW_MARGIN), and
    the room stays at the next rebuild: a drifting edge count stops costing recaptures."""
    atoms = _box(seed=8)
    step = step_graph.ModelStep(mace_calc.adapter, VerletNeighbourList(mace_calc.cutoff, 2.0), padded=True,
                                margin=0.01)
    _run(step, mace_calc, atoms)
    for room in (0.02, 0.04, 0.08, 0.08):
        step._capacity = step.n_edges - 1  # the count rose past the capacity
        _run(step, mace_calc, atoms)
        assert step.capacity == (math.ceil(step.n_edges * (1 + room) / 64) + 1) * 64, room
    assert step.invalidations["model edges overflowed"] == 4  # each growth dropped the captured graphs once
    grown = step.capacity
    fresh = step_graph.ModelStep(mace_calc.adapter, VerletNeighbourList(mace_calc.cutoff, 2.0), padded=True,
                                 margin=0.01)
    assert [fresh._grown(100_000) for _ in range(4)] == [(math.ceil(100_000 * (1 + m) / 64) + 1) * 64
                                                          for m in (0.02, 0.04, 0.08, 0.08)]
    assert fresh._fit(fresh._grown(100_000), 100_000) > fresh._fit(None, 100_000)  # the room is kept
    step.invalidate()
    step._load_verlet()  # a rebuild of the same structure keeps the grown capacity
    assert step.capacity == grown


def test_an_outgrown_verlet_list_grows_with_room(mace_calc):
    """The Verlet list's buffers keep LIST_ROOM to spare, and a rebuild whose list no longer fits them (an NPT box
    compressing) sizes them with the growing room: a drifting list is recaptured a few times, not at every rebuild."""
    atoms = _box(seed=9)
    step = step_graph.ModelStep(mace_calc.adapter, VerletNeighbourList(mace_calc.cutoff, 2.0), padded=True,
                                margin=0.01)
    _run(step, mace_calc, atoms)
    pairs = step.neighbours.sender.shape[0]
    assert step._verlet[0].shape[0] == (math.ceil(pairs * (1 + step_graph.LIST_ROOM) / 64) + 1) * 64
    for room in (0.04, 0.04, 0.08):  # the model edges' room (2, 4, 8 %), at least LIST_ROOM
        atoms.set_cell(atoms.cell * 0.95, scale_atoms=True)  # 16 % denser: more pairs than the buffers hold
        _run(step, mace_calc, atoms)  # the cell changed: a rebuild
        pairs = step.neighbours.sender.shape[0]
        assert step._verlet[0].shape[0] == (math.ceil(pairs * (1 + room) / 64) + 1) * 64, room
    ref = _run(mace_calc.step, mace_calc, atoms)
    _assert_same(_run(step, mace_calc, atoms), ref, len(atoms))


def test_the_verlet_list_lives_in_the_step_buffers(mace_calc):
    """Once copied into the step's static buffers, the list reads its pairs there (one copy of them: 5.5 GB at a
    million atoms), and the next rebuild still finds and loads a new list."""
    atoms = _box(seed=3)
    step = step_graph.ModelStep(mace_calc.adapter, VerletNeighbourList(mace_calc.cutoff, 1.0), padded=True)
    for _ in range(2):  # the second: a rebuild (the cell changed)
        got = _run(step, mace_calc, atoms)
        nl = step.neighbours
        for listed, buffer in zip((nl.sender, nl.receiver, nl.shifts), step._verlet[:3], strict=True):
            assert listed.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
            assert torch.equal(listed, buffer[:listed.shape[0]])
        _assert_same(got, _run(mace_calc.step, mace_calc, atoms), len(atoms))
        atoms.set_cell(atoms.cell * 1.01, scale_atoms=True)


# ---------------------------------------------------------------------------------------------
# CUDA: captured equals eager


def _md(atoms, steps: int, seed: int, scale: float):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        atoms.positions += rng.normal(scale=scale, size=atoms.positions.shape)
        yield atoms


def _calc_pair(model, **kwargs):
    captured = Calculator(copy.deepcopy(model), device="cuda", cuda_graph=True, **kwargs)
    eager = Calculator(copy.deepcopy(model), device="cuda", cuda_graph=False, **kwargs)
    return captured, eager


def _props(calc, atoms, stress: bool) -> dict:
    a = atoms.copy()
    a.calc = calc
    out = {"energy": np.array([a.get_potential_energy()]), "forces": a.get_forces()}
    if stress:
        out["stress"] = a.get_stress()
    return out


@cuda
@pytest.mark.parametrize("filter_edges", [True, False])
def test_cuda_captured_md_matches_eager_with_rebuilds_and_growth(filter_edges):
    captured, eager = _calc_pair(build_model(r_max=4.0), skin=0.5, filter_edges=filter_edges)
    atoms = water_box(27, seed=11)
    counts = set()
    for i, a in enumerate(_md(atoms, 14, seed=2, scale=0.04)):
        if i == 5:
            if filter_edges:  # a capacity overflow: the step must be redone with more room, and recaptured
                captured.step._capacity = captured.n_edges - 20
            else:  # new buffers (as when a rebuild outgrows them): recaptured
                captured.step._layout = None
                captured.step._verlet = None
        got, ref = _props(captured, a, stress=False), _props(eager, a, stress=False)
        for key in ref:
            assert rel_err(got[key], ref[key]) < 1e-10, (i, key)
        counts.add(captured.n_edges)
        assert captured.cuda_graph, captured.step.capture_error
    assert len(counts) > 3, "edge counts changed along the trajectory"
    assert captured.neighbours.n_builds >= 2
    assert captured.step.n_captures >= 2, "a capacity change recaptured"


@cuda
def test_cuda_stress_step_is_captured_separately():
    captured, eager = _calc_pair(build_model(r_max=4.0), skin=0.5)
    atoms = _box(seed=12, triclinic=True)
    for i, a in enumerate(_md(atoms, 4, seed=3, scale=0.02)):
        got, ref = _props(captured, a, stress=i % 2 == 1), _props(eager, a, stress=i % 2 == 1)
        for key in ref:
            assert rel_err(got[key], ref[key]) < 1e-10, (i, key)
    # one graph per property set: energy + forces (an energy call computes the forces too: forces_with_energy),
    # and energy + forces + stress (a capacity change at a rebuild drops them all, so only the last call's are
    # sure to be there)
    keys = {(True, False, False), (True, True, False)}
    assert (True, True, False) in captured.step._graphs and set(captured.step._graphs) <= keys
    assert captured.step.n_captures >= 2


# ---------------------------------------------------------------------------------------------
# NequIP (nequip's global state: the conftest fixture nequip_state)


def _nequip_model(dtype: str = "float64"):
    from nequip.model import NequIPGNNModel

    return NequIPGNNModel(
        seed=1, model_dtype=dtype, type_names=["H", "O"], r_max=3.0, avg_num_neighbors=10.0,
        per_type_energy_shifts={"H": -1.0, "O": -2.0}, per_type_energy_scales={"H": 1.0, "O": 1.5},
        num_layers=2, l_max=2, parity=True, num_features=4, radial_mlp_depth=1, radial_mlp_width=8,
    ).eval()


@pytest.mark.parametrize("mode", ["whole-list", "padded", "whole-list-padded"])
def test_nequip_whole_list_and_padding_match_the_filtered_step(nequip_state, mode):
    calc = Calculator(_nequip_model(), device="cpu", patch=True, warmup=False)
    assert calc.inert_edges_reason is None
    atoms = _box(seed=3, triclinic=True)
    step = step_graph.ModelStep(calc.adapter, VerletNeighbourList(calc.cutoff, 1.0), **MODES[mode])
    _assert_same(_run(step, calc, atoms), _run(calc.step, calc, atoms), len(atoms))


@cuda
def test_cuda_nequip_captured_matches_eager(nequip_state):
    captured, eager = _calc_pair(_nequip_model(), skin=0.5)
    atoms = _box(seed=13, triclinic=True)
    for a in _md(atoms, 5, seed=4, scale=0.03):
        got, ref = _props(captured, a, stress=True), _props(eager, a, stress=True)
        for key in ref:
            assert rel_err(got[key], ref[key]) < 1e-10, key
    assert captured.cuda_graph and captured.step.n_captures >= 1
