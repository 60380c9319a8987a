"""CSVR's and stochastic cell rescaling's kernels (cgforge.kernels.md_rescale): the CUDA source compiles (NVRTC, no
GPU needed) and runs on the CPU as C++ (``host_cuda``) equal to the torch references, reached through the
integrators' CPU path (``CSVR`` and ``StochasticCellRescaling``, isotropic and per axis), both half steps; on a GPU
the integrators take the kernels, which equal the references and repeat bitwise."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from host_cuda import assert_compiles_without_spills, build, call

from cgforge.kernels import md_rescale
from cgforge.kernels.md_rescale import MD_RESCALE_SOURCE
from cgforge.kernels.md_step import commit_plan
from cgforge.plugin.md.integrators import CSVR, MDState, StochasticCellRescaling

_DRIVER = r"""
extern "C" void rescale(double* r, double* p, const double* f, const double* m, double sum_kick, double apply_kick,
                        double drift, long long n3, const double* draws, long long n_rest, long long per_warp,
                        long long warps, double* partials, double c, double kt_per_dof, double sqrt_c,
                        double sqrt_kick, double* heat, int barostat, const double* cell_draws, const double* virial,
                        double* cell, double rate, double kt, double dt, double p0, double* factors) {
    for (long long b = 0; b * 128 < warps * 32; ++b) {
        blockIdx.x = b;
        run_warps(4, [&] { rescale_partials(p, f, m, sum_kick, n3, draws, n_rest, per_warp, warps, partials); });
    }
    blockIdx.x = 0;
    run_warps(1, [&] { rescale_finish(partials, warps, draws, c, kt_per_dof, sqrt_c, sqrt_kick, heat, barostat,
                                      cell_draws, virial, cell, rate, kt, dt, p0, factors); });
    blockDim.x = 64;
    for (long long b = 0; b * 64 < n3; ++b)
        for (int t = 0; t < 64; ++t) {
            blockIdx.x = b; threadIdx.x = t;
            rescale_apply(r, p, f, m, factors, apply_kick, drift, n3);
        }
}
"""

SCHEMES = {
    "csvr": lambda: CSVR(0.5, 300.0, tau_fs=20.0),
    "csvr-dof": lambda: CSVR(0.5, 300.0, tau_fs=20.0, dof=5),  # fewer draws than momenta
    "npt": lambda: StochasticCellRescaling(0.5, 300.0, 0.2, tau_fs=20.0, tau_p_fs=5.0),
    "npt-aniso": lambda: StochasticCellRescaling(0.5, 300.0, 0.2, tau_fs=20.0, tau_p_fs=5.0, anisotropic=True),
}


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    return build(MD_RESCALE_SOURCE, _DRIVER, tmp_path_factory.mktemp("md_rescale"), "md_rescale")


def _state(n: int, seed: int, device: str = "cpu") -> MDState:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    masses = 1.0 + 15.0 * torch.rand(n, 1, generator=gen, dtype=torch.float64)
    virial = randn(3, 3)
    state = MDState(positions=10 * randn(n, 3), momenta=randn(n, 3) * masses.sqrt() * 0.05, forces=randn(n, 3),
                    energy=torch.zeros((), dtype=torch.float64), virial=(virial + virial.T) * n * 0.01,
                    cell=torch.tensor([[12.0, 0.5, 0.0], [0.3, 11.0, 0.2], [0.0, 0.4, 13.0]], dtype=torch.float64),
                    masses=masses, step=torch.zeros((), dtype=torch.int64),
                    extra={"heat": torch.tensor(0.75, dtype=torch.float64)})
    for name in ("positions", "momenta", "forces", "virial", "cell", "masses"):
        setattr(state, name, getattr(state, name).to(device))
    state.extra = {"heat": state.extra["heat"].to(device)}
    return state


def _noise(seed: int, device: str = "cpu"):
    """Replayed standard normals, fixed per (stream, shape)."""
    def draw(stream: int, shape: tuple[int, ...]) -> torch.Tensor:
        gen = torch.Generator().manual_seed(1000 * seed + stream)
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(device)
    return draw


def _bound(name: str, n: int):
    scheme = SCHEMES[name]()
    scheme.bind(torch.ones(n, 1, dtype=torch.float64))
    return scheme


FIELDS = ("positions", "momenta", "cell")


def _as_cpp(library, scheme, s: MDState, noise, half: str) -> dict[str, np.ndarray]:
    """One half step of ``scheme`` through the kernels run as C++, on numpy copies of the state."""
    arrays = {k: getattr(s, k).numpy().copy() for k in (*FIELDS, "forces", "masses", "virial")}
    heat = s.extra["heat"].reshape(1).numpy().copy()
    draws = noise(0 if half == "first" else 1, (scheme.dof,)).numpy()
    barostat = getattr(scheme, "barostat", None) if half == "first" else None
    cell_draws = (noise(2, (3,) if barostat.anisotropic else (1,)).numpy() if barostat is not None
                  else np.zeros(3))
    n3, n_rest = arrays["momenta"].size, draws.size - 1
    per_warp, warps = commit_plan(max(n3, n_rest, 1))
    partials, factors = np.zeros(4 * warps), np.zeros(4)
    b = barostat or md_rescale.CellRescalingTerms(0.0, 0.0, 0.0, 0.0, False)
    mode = 0 if barostat is None else 2 if barostat.anisotropic else 1
    kicks = (0.0, 0.5 * scheme.dt, scheme.dt) if half == "first" else (0.5 * scheme.dt, 0.0, 0.0)
    c, kt_per_dof = scheme.bussi.c, scheme.bussi.kt_per_dof
    call(library.rescale, [arrays["positions"], arrays["momenta"], arrays["forces"], arrays["masses"],
                           *(ctypes.c_double(k) for k in kicks), n3, draws, n_rest, per_warp, warps, partials,
                           ctypes.c_double(c), ctypes.c_double(kt_per_dof), ctypes.c_double(np.sqrt(c)),
                           ctypes.c_double(np.sqrt((1 - c) * kt_per_dof)), heat, ctypes.c_int(mode), cell_draws,
                           arrays["virial"], arrays["cell"], ctypes.c_double(b.rate), ctypes.c_double(b.kt),
                           ctypes.c_double(b.dt), ctypes.c_double(b.p0), factors])
    return {**{k: arrays[k] for k in FIELDS}, "heat": heat[0]}


@pytest.mark.smoke
def test_kernels_compile_without_spills() -> None:
    assert_compiles_without_spills(MD_RESCALE_SOURCE, "md_rescale.cu",
                                   ("rescale_partials", "rescale_finish", "rescale_apply"))


@pytest.mark.parametrize("n", [1, 7, 1000])
@pytest.mark.parametrize("half", ["first", "second"])
@pytest.mark.parametrize("name", list(SCHEMES))
def test_source_run_as_cpp_equals_the_integrators_torch_path(library, name: str, half: str, n: int) -> None:
    scheme = _bound(name, n)
    s, noise = _state(n, seed=n), _noise(seed=n)
    got = _as_cpp(library, scheme, s, noise, half)
    scheme.bind(s.masses)
    (scheme.before_forces if half == "first" else scheme.after_forces)(s, noise)  # CPU: the torch expressions
    for key in FIELDS:
        torch.testing.assert_close(torch.from_numpy(got[key]), getattr(s, key), rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(torch.tensor(got["heat"]), s.extra["heat"], rtol=1e-12, atol=1e-15)


def test_the_state_moves_where_it_should() -> None:
    """What the comparison above could miss if both sides did nothing: the momenta rescale, heat comes in, and
    under the barostat the cell moves (per axis differently when anisotropic)."""
    n = 50
    for name in ("csvr", "npt", "npt-aniso"):
        s, before = _state(n, seed=2), _state(n, seed=2)
        scheme = SCHEMES[name]()
        scheme.bind(s.masses)
        scheme.before_forces(s, _noise(seed=2))
        assert not torch.equal(s.momenta, before.momenta) and float(s.extra["heat"]) != 0.75
        moved = torch.diagonal(s.cell) / torch.diagonal(before.cell)
        if name == "csvr":
            assert torch.equal(s.cell, before.cell)
        else:
            assert (moved - 1).abs().min() > 1e-6, moved
            assert ((moved - moved[0]).abs().max() > 1e-9) == (name == "npt-aniso"), moved


def test_a_barostat_without_its_arrays_is_refused() -> None:
    scheme = _bound("npt", 4)
    a = torch.zeros(4, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="cell, virial and cell_draws"):
        md_rescale.bussi_first_cuda(a, a, a, a[:, :1], a[0, 0], a.reshape(-1), scheme.bussi, 1.0,
                                    barostat=scheme.barostat)


@pytest.mark.cuda
@pytest.mark.parametrize("half", ["first", "second"])
@pytest.mark.parametrize("name", list(SCHEMES))
def test_cuda_integrators_take_the_kernels_equal_to_the_torch_path_and_repeat(name: str, half: str) -> None:
    n = 5184
    runs = []
    for device in ("cpu", "cuda", "cuda"):
        s, scheme = _state(n, seed=5, device=device), SCHEMES[name]()
        scheme.bind(s.masses)
        (scheme.before_forces if half == "first" else scheme.after_forces)(s, _noise(seed=5, device=device))
        runs.append(s)
    cpu, gpu, again = runs
    for key in FIELDS:
        assert torch.equal(getattr(gpu, key), getattr(again, key)), key
        torch.testing.assert_close(getattr(gpu, key).cpu(), getattr(cpu, key), rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(gpu.extra["heat"].cpu(), cpu.extra["heat"], rtol=1e-12, atol=1e-15)


@pytest.mark.cuda
def test_cuda_integrators_launch_three_kernels_a_half_step() -> None:
    """The point of the kernels: a half step of NPT is three launches besides the draws, not dozens."""
    s, scheme = _state(5184, seed=6, device="cuda"), SCHEMES["npt"]()
    scheme.bind(s.masses)
    noise = _noise(seed=6, device="cuda")
    draws = {key: noise(*key) for key in ((0, (scheme.dof,)), (2, (1,)), (1, (scheme.dof,)))}
    scheme.before_forces(s, lambda stream, shape: draws[(stream, shape)])  # compiled and warm
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        scheme.before_forces(s, lambda stream, shape: draws[(stream, shape)])
        scheme.after_forces(s, lambda stream, shape: draws[(stream, shape)])
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    assert sorted(names) == sorted(["rescale_partials", "rescale_finish", "rescale_apply"] * 2), names


@pytest.mark.parametrize("name", ["csvr", "npt", "npt-aniso"])
def test_the_engine_hands_the_kernels_arrays_they_take(monkeypatch, name: str) -> None:
    """On CUDA a half step takes the kernels when every array it is given is contiguous float64 (``_on_kernels``):
    the engine's state views and draws are, checked on a CPU run of the engine (the same views as on CUDA), every
    half step asked; the reference then runs as on a CPU."""
    from engine_potentials import argon_box, lennard_jones

    from cgforge.plugin.md.engine import energy_function_engine

    asked = []

    def takes(*tensors: torch.Tensor | None) -> bool:
        asked.append(all(t is None or (t.dtype == torch.float64 and t.is_contiguous()) for t in tensors))
        return False

    monkeypatch.setattr(md_rescale, "_on_kernels", takes)
    scheme = {"csvr": lambda: CSVR(4.0, 120.0, 50.0),
              "npt": lambda: StochasticCellRescaling(4.0, 120.0, 0.05, tau_p_fs=200.0),
              "npt-aniso": lambda: StochasticCellRescaling(4.0, 120.0, 0.05, tau_p_fs=200.0, anisotropic=True)}[name]
    engine = energy_function_engine(lennard_jones(), argon_box(seed=3), scheme(), seed=9, block=4)
    engine.run(4)
    assert len(asked) >= 8 and all(asked), asked
