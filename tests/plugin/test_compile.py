"""Calculator(compile=...): the model's energy compiled by torch.compile (cgforge.plugin.runtime.compiled).

Most tests use the "aot_eager" backend (dynamo's graph, guards and recompilations and AOTAutograd's forward and
backward, without Inductor's C++ code generation, which takes about a minute per model on 2 CPU cores); the
slow ones compile with Inductor itself; the CUDA ones check the compiled step inside the step's CUDA graph.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import ExitStack

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from cgforge.plugin import Calculator
from cgforge.plugin.runtime import compiled
from cgforge.plugin.runtime.neighbours import VerletNeighbourList
from cgforge.plugin.runtime.options import RuntimeOptions
from cgforge.plugin.runtime.step_graph import ModelStep
from cgforge.plugin.water import water_box

cuda = pytest.mark.cuda


AOT_EAGER = RuntimeOptions(compile_backend="aot_eager")


@pytest.fixture
def aot_eager() -> Iterator[RuntimeOptions]:
    """FP64, fresh dynamo caches and counters (restored after); the options of the aot_eager backend."""
    torch.set_default_dtype(torch.float64)
    torch._dynamo.reset()
    counters.clear()
    yield AOT_EAGER
    torch._dynamo.reset()


def graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


def random_steps(atoms, calc, steps: int, seed: int, scale: float = 0.03) -> list[tuple]:
    """Energy, forces and stress of ``steps`` structures: ``atoms`` moved by fresh random displacements."""
    a = atoms.copy()
    a.calc = calc
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        a.positions = atoms.positions + rng.normal(scale=scale, size=atoms.positions.shape)
        out.append((a.get_potential_energy(), a.get_forces().copy(), a.get_stress().copy()))
    return out


def assert_same(got: list[tuple], want: list[tuple], tol: float) -> None:
    for (e, f, s), (e0, f0, s0) in zip(got, want, strict=True):
        assert abs(e - e0) <= tol * max(1.0, abs(e0))
        assert np.abs(f - f0).max() <= tol
        assert np.abs(s - s0).max() <= tol


# --- options -----------------------------------------------------------------------------------------------


def test_compile_option_values():
    assert compiled.parse_compile(False) is None and compiled.parse_compile(None) is None
    assert compiled.parse_compile(True) == "default"
    assert compiled.parse_compile("max-autotune-no-cudagraphs") == "max-autotune-no-cudagraphs"
    with pytest.raises(ValueError, match="compile: mode 'reduce-overhead' captures CUDA graphs"):
        compiled.parse_compile("reduce-overhead")
    with pytest.raises(ValueError, match="compile: expected True, False or one of"):
        compiled.parse_compile("fastest")
    with pytest.raises(TypeError, match="compile: expected True, False or an Inductor mode"):
        compiled.parse_compile(1)
    # refused before the model is loaded (a missing file would be the other error)
    with pytest.raises(ValueError, match="compile: mode 'max-autotune'"):
        Calculator("no/such/file.model", device="cpu", compile="max-autotune")


@pytest.mark.slow
def test_compile_refuses_what_it_cannot_compile(monkeypatch):
    torch.set_default_dtype(torch.float64)
    with pytest.raises(ValueError, match=r"compile: needs a model patched by cgforge \(patch=True\)"):
        Calculator("mace", device="cpu", dtype="float64", patch=False, compile=True, warmup=False)
    with pytest.raises(ValueError, match="compile and streaming=True"):
        Calculator("mace", device="cpu", dtype="float64", patch=True, streaming=True, compile=True, warmup=False)
    from torch._inductor import cpp_builder

    def no_compiler() -> str:
        raise RuntimeError("no compiler found in ('g++',)")

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", no_compiler)
    with pytest.raises(RuntimeError, match="compile: Inductor's CPU backend needs a C\\+\\+ compiler"):
        Calculator("mace", device="cpu", dtype="float64", patch=True, compile=True, warmup=False)
    calc = Calculator("mace", device="cpu", dtype="float64", patch=True, compile=True, warmup=False,
                      options=AOT_EAGER)  # not Inductor: no compiler needed
    assert calc.compile == "default" and calc.step.compiled is not None


def test_inductor_tf32_hint_is_not_shown(recwarn):
    """Inductor's advice to turn TF32 on (first compilation on an H100) is dropped; other warnings pass."""
    def energy(*args):
        warnings.warn("TensorFloat32 tensor cores for float32 matrix multiplication available but not enabled. "
                      "Consider setting torch.set_float32_matmul_precision('high')", UserWarning, stacklevel=1)
        warnings.warn("something else", UserWarning, stacklevel=1)
        return torch.zeros(()), None

    fn = compiled.CompiledEnergy(energy, "default")
    fn._compiled = energy  # the compiled callable's warnings, without compiling anything
    fn(torch.zeros(1, 3), torch.zeros(1, 3), torch.zeros(1), torch.zeros(2, 1), False)
    assert [str(w.message) for w in recwarn] == ["something else"]


@pytest.mark.slow
def test_set_compile_after_construction_gives_the_constructed_results(aot_eager):
    """Calculator.set_compile (what `cgforge md --compile auto` calls) equals compile at construction, checks the
    same things, and turns off again."""
    atoms = water_box(2, seed=4)
    want = random_steps(atoms, Calculator("mace", device="cpu", dtype="float64", patch=True, compile=True,
                                          warmup=False, options=aot_eager), 2, seed=5)
    calc = Calculator("mace", device="cpu", dtype="float64", patch=True, warmup=False, options=aot_eager)
    assert calc.compile is None and calc.step.compiled is None
    assert not calc.compiled_fits(atoms)  # no memory plan off CUDA: `cgforge md --compile auto` leaves a CPU run be
    calc.set_compile(True)
    assert calc.compile == "default" and calc.step.compiled is not None
    assert_same(random_steps(atoms, calc, 2, seed=5), want, 1e-10)
    calc.set_compile(False)
    assert calc.compile is None and calc.step.compiled is None
    with pytest.raises(ValueError, match="compile: expected True, False or one of"):
        calc.set_compile("fastest")
    unpatched = Calculator("mace", device="cpu", dtype="float64", patch=False, warmup=False)
    with pytest.raises(ValueError, match="compile: needs a model patched by cgforge"):
        unpatched.set_compile(True)


@pytest.mark.slow
def test_the_patched_models_compile_as_one_graph():
    """No graph break in cgforge's code or the models' (bundled MACE and NequIP): the whole energy is one graph, and one
    AOTAutograd can cache across processes."""
    torch.set_default_dtype(torch.float64)
    atoms = water_box(4, seed=1)
    for kind, dtype in (("mace", "float64"), ("nequip", None)):
        calc = Calculator(kind, device="cpu", dtype=dtype, patch=True, warmup=False)
        step, seen = calc.step, {}
        energy = calc.adapter.energy

        def spy(*args, energy=energy, seen=seen):
            seen["args"] = args
            return energy(*args)

        calc.adapter.energy = spy
        a = atoms.copy()
        a.calc = calc
        a.get_forces()
        calc.adapter.energy = energy
        positions, vectors, species, edge_index, per_atom = seen["args"]
        with ExitStack() as stack:  # the step pinned its graph; species groups and serving as in its call
            for cache in step.caches:
                stack.enter_context(cache.use_species(step._groups))
                stack.enter_context(cache.serve_pinned())
            explained = torch._dynamo.explain(energy)(positions.detach(), vectors.detach().requires_grad_(True),
                                                      species, edge_index, False)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), (kind, explained.break_reasons)
        # no torch.autograd.Function in the graph: with one, AOTAutograd does not cache the compiled graph on disk, so
        # every process would trace it again
        assert "autograd_function_apply" not in explained.graphs[0].code, kind


def test_a_compiled_model_gets_a_pinned_graph_only_from_its_caller():
    """Compiling a patched model outside the calculator's step is an error naming the way, also when a graph is
    pinned (for the calculator's own edges, not the ones the model is called with)."""
    from cgforge.kernels import ConvGraph
    from cgforge.patches.graph_cache import CallGraphCache

    cache = CallGraphCache()
    sender, receiver = torch.tensor([0, 1]), torch.tensor([1, 0])
    graph = ConvGraph(sender, receiver, 2)
    with pytest.raises(RuntimeError, match="Calculator\\(compile=True\\)"):
        cache._compiled_get()
    cache.pin(sender, receiver, graph)
    with pytest.raises(RuntimeError, match="Calculator\\(compile=True\\)"):
        cache._compiled_get()
    with cache.serve_pinned():
        assert cache._compiled_get() is graph
    assert not cache.compiling_caller


# --- the compiled step (aot_eager) --------------------------------------------------------------------------


@pytest.mark.slow
def test_compiled_equals_eager_and_compiles_once_for_changing_edge_counts(aot_eager):
    """Unpadded (CPU): every structure has another edge count; one graph serves them all."""
    atoms = water_box(8, seed=2)
    eager = Calculator("mace", device="cpu", dtype="float64", patch=True, warmup=False)
    calc = Calculator("mace", device="cpu", dtype="float64", patch=True, compile=True, warmup=False,
                      options=aot_eager)
    want = random_steps(atoms, eager, 4, seed=3)
    got = random_steps(atoms, calc, 4, seed=3)
    assert calc.step.compile_error is None
    assert_same(got, want, 1e-10)
    assert graphs() == 1, dict(counters["stats"])


@pytest.mark.slow
def test_padded_step_compiles_once_for_all_capacities(aot_eager):
    """A padded step's edge count is symbolic from the first compilation: new capacities reuse the graph."""
    calc = Calculator("mace", device="cpu", dtype="float64", patch=True, warmup=False)
    atoms = water_box(4, seed=4)
    species = calc.adapter.species(atoms.numbers)
    ref = ModelStep(calc.adapter, VerletNeighbourList(calc.cutoff, 1.0), padded=True)
    step = ModelStep(calc.adapter, VerletNeighbourList(calc.cutoff, 1.0), padded=True, compile="default",
                     compile_backend=aot_eager.compile_backend)
    rng = np.random.default_rng(5)
    capacities = []
    for _ in range(4):
        pos = atoms.positions + rng.normal(scale=0.05, size=atoms.positions.shape)
        args = (pos, np.asarray(atoms.cell), (True, True, True), species)
        want = ref.run(*args, forces=True, stress=True, per_atom=True)
        got = step.run(*args, forces=True, stress=True, per_atom=True)
        assert np.abs(got - want).max() <= 1e-10
        capacities.append(step.capacity)
        step.grow(step.capacity + 128)
    assert len(set(capacities)) == 4 and graphs() == 1, (capacities, dict(counters["stats"]))


@pytest.mark.slow
def test_engine_with_rebuilds_does_not_recompile(aot_eager):
    """20 Langevin steps with a 0.3 Å skin at 600 K: the list is rebuilt most blocks; one graph throughout, and
    the trajectory is the eager engine's."""
    from ase.md.velocitydistribution import MaxwellBoltzmannDistribution, Stationary

    from cgforge.plugin.md.engine import Engine
    from cgforge.plugin.md.integrators import Langevin

    atoms = water_box(8, seed=6)
    MaxwellBoltzmannDistribution(atoms, temperature_K=600.0, rng=np.random.default_rng(6))
    Stationary(atoms)
    runs = {}
    for flag in (False, True):
        calc = Calculator("mace", device="cpu", dtype="float64", patch=True, skin=0.3, compile=flag, warmup=False,
                          options=aot_eager)
        a = atoms.copy()
        a.calc = calc
        engine = Engine(calc, a, Langevin(1.0, 600.0, 0.01), seed=7, block=5)
        engine.run(20)
        runs[flag] = engine
    assert runs[True].stats["rebuilds"] >= 3, runs[True].stats
    assert graphs() == 1, dict(counters["stats"])
    for name in ("positions", "momenta"):
        diff = (getattr(runs[True].state, name) - getattr(runs[False].state, name)).abs().max()
        assert diff <= 1e-10, (name, float(diff))


@pytest.mark.slow
def test_a_failing_compilation_warns_and_runs_eagerly():
    torch.set_default_dtype(torch.float64)
    torch._dynamo.reset()

    def broken(gm, example_inputs):
        raise RuntimeError("this backend always fails")

    atoms = water_box(4, seed=8)
    eager = Calculator("mace", device="cpu", dtype="float64", patch=True, warmup=False)
    calc = Calculator("mace", device="cpu", dtype="float64", patch=True, compile=True, warmup=False,
                      options=RuntimeOptions(compile_backend=broken))
    want = random_steps(atoms, eager, 2, seed=9)
    with pytest.warns(RuntimeWarning, match="torch.compile of the model failed, running it eagerly"):
        got = random_steps(atoms, calc, 2, seed=9)
    assert "this backend always fails" in calc.step.compile_error
    assert_same(got, want, 0.0)
    torch._dynamo.reset()


# --- Inductor ---------------------------------------------------------------------------------------------


def inductor_matches_eager(make_model, dtype: str | None) -> None:
    """Two calculators of the same model, eager and compiled by Inductor (C++ kernels: about a minute of
    compilation per model on 2 cores): energy, forces and stress of fresh structures to 1e-10 in FP64."""
    torch._dynamo.reset()
    counters.clear()
    atoms = water_box(8, seed=10)
    eager = Calculator(make_model(), device="cpu", dtype=dtype, patch=True, warmup=False)
    calc = Calculator(make_model(), device="cpu", dtype=dtype, patch=True, compile=True, warmup=False)
    want = random_steps(atoms, eager, 3, seed=11)
    got = random_steps(atoms, calc, 3, seed=11)
    assert calc.step.compile_error is None
    assert_same(got, want, 1e-10)
    assert graphs() == 1, dict(counters["stats"])
    torch._dynamo.reset()


@pytest.mark.slow
def test_inductor_compiled_mace_equals_eager():
    torch.set_default_dtype(torch.float64)
    inductor_matches_eager(lambda: "mace", "float64")


@pytest.mark.slow
def test_inductor_compiled_nequip_equals_eager(nequip_state):
    """A small FP64 NequIP (the bundled one is FP32 only: Inductor's reordered FP32 sums differ by ~1e-6)."""
    from nequip_helpers import nequip_model

    torch.set_default_dtype(torch.float64)
    inductor_matches_eager(lambda: nequip_model("float64"), None)


# --- CUDA ---------------------------------------------------------------------------------------------------


@cuda
@pytest.mark.parametrize("dtype,tol", [("float64", 1e-10), ("float32", 2e-4)])
def test_compiled_captured_step_equals_eager_on_the_gpu(dtype, tol):
    torch.set_default_dtype(getattr(torch, dtype))
    torch._dynamo.reset()
    atoms = water_box(343, seed=12)  # 1029 atoms
    eager = Calculator("mace", device="cuda", dtype=dtype, cuda_graph=False)
    calc = Calculator("mace", device="cuda", dtype=dtype, compile=True)
    want = random_steps(atoms, eager, 3, seed=13, scale=0.02)
    got = random_steps(atoms, calc, 3, seed=13, scale=0.02)
    assert calc.cuda_graph and calc.step.n_captures >= 1, calc.step.capture_error
    assert calc.step.compile_error is None
    assert_same(got, want, tol)
    torch._dynamo.reset()


@cuda
def test_engine_with_compile_runs_50_steps_on_the_gpu():
    from ase.md.velocitydistribution import MaxwellBoltzmannDistribution, Stationary

    from cgforge.plugin.md.engine import Engine
    from cgforge.plugin.md.integrators import Langevin

    torch.set_default_dtype(torch.float32)
    torch._dynamo.reset()
    counters.clear()
    atoms = water_box(343, seed=14)
    MaxwellBoltzmannDistribution(atoms, temperature_K=300.0, rng=np.random.default_rng(14))
    Stationary(atoms)
    runs = {}
    for flag in (False, True):
        calc = Calculator("mace", device="cuda", dtype="float32", compile=flag)
        a = atoms.copy()
        a.calc = calc
        engine = Engine(calc, a, Langevin(0.5, 300.0, 0.01), seed=15, block=10)
        engine.run(50)
        assert engine.cuda_graph and engine.stats["captures"] >= 1, engine.capture_error
        runs[flag] = engine
    assert runs[True].provider.step.compile_error is None
    # the model's graphs, and one each for the fused integrator's two halves and the step's bookkeeping: nothing
    # recompiled over 50 steps
    assert runs[True].fuse_integrator and not runs[False].fuse_integrator
    assert graphs() <= 2 + 3, dict(counters["stats"])
    diff = (runs[True].state.positions - runs[False].state.positions).abs().max()
    assert diff <= 1e-3, float(diff)  # FP32, 50 steps: rounding grows, a wrong force would not stay this close
    torch._dynamo.reset()
