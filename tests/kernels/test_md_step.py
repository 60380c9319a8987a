"""The MD engine's step kernels (cgforge.kernels.md_step): the CUDA source compiles (NVRTC, no GPU needed) and runs
on the CPU as C++ (``host_cuda``) equal to the torch references beside them (``langevin_first_reference``,
``langevin_second_reference``, ``commit_check_reference``), for every way a step can fail; on a GPU the kernels
equal the references and repeat bitwise, and the engine dispatches to them."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from ase import units
from host_cuda import assert_compiles_without_spills, build, call

from cgforge.kernels import md_step
from cgforge.kernels.md_step import COMMIT_REPORT, MD_STEP_SOURCE, commit_check, commit_check_reference, commit_plan
from cgforge.plugin.md import integrators
from cgforge.plugin.md.commit import REPORT, commit_step

_DRIVER = r"""
extern "C" void first(const double* r, const double* p, const double* f, const double* m, const double* xi,
                      const double* eta, const double* c3, const double* c4, const double* c5, double c1, double c2,
                      double dt, long long n3, double* r_out, double* p_out, double* v_out, double* rnd_out) {
    blockDim.x = 64;
    for (long long b = 0; b * 64 < n3; ++b)
        for (int t = 0; t < 64; ++t) {
            blockIdx.x = b; threadIdx.x = t;
            langevin_first(r, p, f, m, xi, eta, c3, c4, c5, c1, c2, dt, n3, r_out, p_out, v_out, rnd_out);
        }
}
extern "C" void second(const double* v, const double* f, const double* m, const double* rnd, double c1, double c2,
                       long long n3, double* p_out) {
    blockDim.x = 64;
    for (long long b = 0; b * 64 < n3; ++b)
        for (int t = 0; t < 64; ++t) {
            blockIdx.x = b; threadIdx.x = t;
            langevin_second(v, f, m, rnd, c1, c2, n3, p_out);
        }
}
extern "C" void commit(const double* p, const double* m, const double* f, long long n3, long long per_warp,
                       long long warps, double* partials, const double* energy, const long long* step,
                       const unsigned char* stale, const unsigned char* overflow, const long long* count,
                       const double* slack, const double* report, double denominator, double max_t,
                       unsigned char* bad, long long* step_out, double* report_out) {
    for (long long b = 0; b * 128 < warps * 32; ++b) {
        blockIdx.x = b;
        run_warps(4, [&] { commit_partials(p, m, f, n3, per_warp, warps, partials); });
    }
    blockIdx.x = 0;
    run_warps(1, [&] { commit_finish(partials, warps, energy, step, stale, overflow, count, slack, report,
                                     denominator, max_t, bad, step_out, report_out); });
}
"""


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    return build(MD_STEP_SOURCE, _DRIVER, tmp_path_factory.mktemp("md_step"), "md_step")


def _state(n: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    masses = 1.0 + 15.0 * torch.rand(n, 1, generator=gen, dtype=torch.float64)
    return {"positions": 10 * randn(n, 3), "momenta": randn(n, 3) * masses.sqrt() * 0.05, "forces": randn(n, 3),
            "masses": masses, "xi": randn(n, 3), "eta": randn(n, 3)}


def _langevin(masses: torch.Tensor) -> integrators.Langevin:
    scheme = integrators.Langevin(0.5, 300.0, 0.02)
    scheme.bind(masses)
    return scheme


@pytest.mark.smoke
def test_kernels_compile_without_spills() -> None:
    names = ("langevin_first", "langevin_second", "commit_partials", "commit_finish")
    assert_compiles_without_spills(MD_STEP_SOURCE, "md_step.cu", names)


def test_report_layout_is_the_kernels() -> None:
    assert REPORT == COMMIT_REPORT and len(REPORT) == 10


@pytest.mark.parametrize("n3", [1, 3, 255, 256, 257, 15_552, 262_144, 262_145, 3_000_000, 30_000_000])
def test_commit_plan_covers_every_element_once(n3: int) -> None:
    per_warp, warps = commit_plan(n3)
    assert per_warp % 32 == 0 and 1 <= warps <= 1024
    assert (warps - 1) * per_warp < n3 <= warps * per_warp


@pytest.mark.parametrize("n", [1, 7, 1000])
def test_langevin_source_run_as_cpp_equals_the_torch_expressions(library, n: int) -> None:
    s = _state(n, seed=n)
    scheme = _langevin(s["masses"])
    n3 = 3 * n
    outs = [np.zeros((n, 3)) for _ in range(4)]
    c = [np.ascontiguousarray(t.numpy()) for t in (scheme.c3, scheme.c4, scheme.c5)]
    arrays = [s[k].numpy() for k in ("positions", "momenta", "forces", "masses", "xi", "eta")]
    call(library.first, [*arrays, *c, ctypes.c_double(scheme.c1), ctypes.c_double(scheme.c2),
                         ctypes.c_double(scheme.dt), n3, *outs])
    expected = md_step.langevin_first_reference(s["positions"], s["momenta"], s["forces"], s["masses"], s["xi"],
                                                s["eta"], scheme.c1, scheme.c2, scheme.c3, scheme.c4, scheme.c5,
                                                scheme.dt)
    for got, want in zip(outs, expected, strict=True):
        torch.testing.assert_close(torch.from_numpy(got), want, rtol=1e-14, atol=1e-14)
    v, rnd = expected[2], expected[3]
    momenta = np.zeros((n, 3))
    call(library.second, [v.numpy(), s["forces"].numpy(), s["masses"].numpy(), rnd.numpy(),
                          ctypes.c_double(scheme.c1), ctypes.c_double(scheme.c2), n3, momenta])
    want = md_step.langevin_second_reference(v, s["forces"], s["masses"], rnd, scheme.c1, scheme.c2)
    torch.testing.assert_close(torch.from_numpy(momenta), want, rtol=1e-14, atol=1e-14)


# (name, change to the step's inputs): every branch of the commit rule
CASES = {
    "committed": {},
    "energy nan": {"energy": float("nan")},
    "energy inf": {"energy": float("-inf")},
    "forces inf": {"force": float("inf")},
    "forces nan": {"force": float("nan")},
    "forces nan and inf": {"force": float("nan"), "force2": float("-inf")},
    "hot": {"max_t": 1e-3},
    "stale": {"stale": True},
    "overflow": {"overflow": True, "count": 123_456},
    "stale and blown up": {"stale": True, "energy": float("nan")},
    "stopped earlier": {"stopped": True, "energy": float("nan")},
    "an earlier blow-up kept": {"stopped": True, "blow": True},
    "stale after a stop": {"stopped": True, "stale": True},
    "overflow after a stop": {"stopped": True, "overflow": True, "count": 999},
}


def _commit_inputs(n: int, case: dict, seed: int) -> dict:
    s = _state(n, seed)
    forces = s["forces"].clone()
    if "force" in case:
        forces[n // 2, 1] = case["force"]
    if "force2" in case:
        forces[n - 1, 2] = case["force2"]
    report = torch.tensor([3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 50.0, 0.25, 290.0], dtype=torch.float64)
    if case.get("stopped"):
        report[1] = 1.0
    if case.get("blow"):
        report[4:7] = torch.tensor([2.0, 17.0, float("inf")])
    return {"energy": torch.tensor(case.get("energy", -1234.5), dtype=torch.float64), "forces": forces,
            "momenta": s["momenta"], "masses": s["masses"], "step": torch.tensor(41, dtype=torch.int64),
            "stale": torch.tensor(case.get("stale", False)), "overflow": torch.tensor(case.get("overflow", False)),
            "count": torch.tensor(case.get("count", 77), dtype=torch.int64),
            "slack": torch.tensor(0.125, dtype=torch.float64), "report": report,
            "temperature_denominator": 1.5 * n * units.kB, "max_temperature": case.get("max_t", 5000.0)}


def _assert_same_commit(got: tuple, want: tuple) -> None:
    assert bool(got[0]) == bool(want[0]) and int(got[1]) == int(want[1])
    torch.testing.assert_close(got[2].cpu(), want[2].cpu(), rtol=1e-13, atol=0.0, equal_nan=True)


@pytest.mark.parametrize("n, plan", [(1, None), (700, None), (5184, None), (1000, (96, 32))])
@pytest.mark.parametrize("case", list(CASES))
def test_commit_source_run_as_cpp_equals_the_torch_expression(library, n: int, plan, case: str) -> None:
    x = _commit_inputs(n, CASES[case], seed=n + 1)
    per_warp, warps = plan or commit_plan(3 * n)
    partials = np.zeros(4 * warps)
    bad, step, report = np.zeros(1, dtype=np.uint8), np.zeros(1, dtype=np.int64), np.zeros(len(REPORT))
    flags = [np.array([int(bool(x[k]))], dtype=np.uint8) for k in ("stale", "overflow")]
    call(library.commit, [x["momenta"].numpy(), x["masses"].numpy(), x["forces"].numpy(), 3 * n, per_warp, warps,
                          partials, x["energy"].reshape(1).numpy(), x["step"].reshape(1).numpy(), *flags,
                          x["count"].reshape(1).numpy(), x["slack"].reshape(1).numpy(), x["report"].numpy(),
                          ctypes.c_double(x["temperature_denominator"]), ctypes.c_double(x["max_temperature"]),
                          bad, step, report])
    want = commit_check_reference(**x)
    _assert_same_commit((torch.tensor(bad[0]), torch.tensor(step[0]), torch.from_numpy(report)), want)


def test_the_cpu_path_is_the_torch_expression() -> None:
    x = _commit_inputs(50, CASES["forces nan"], seed=3)
    want = commit_check_reference(**x)
    _assert_same_commit(commit_check(**x), want)
    engine_args = {k: v for k, v in x.items() if k not in ("temperature_denominator", "max_temperature")}
    got = commit_step(**engine_args, max_temperature_K=x["max_temperature"])  # the engine's call: the same bits
    assert all(torch.equal(a, b) or (a.isnan() == b.isnan()).all() for a, b in zip(got, want, strict=True))
    assert integrators.Langevin(0.5, 300.0, 0.02)._math["_langevin_first"] is md_step.langevin_first


@pytest.mark.cuda
@pytest.mark.parametrize("case", list(CASES))
def test_cuda_commit_kernels_equal_the_torch_expression_and_repeat(case: str) -> None:
    x = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in _commit_inputs(5184, CASES[case], 9).items()}
    got = commit_check(**x)
    again = commit_check(**x)
    assert all(torch.equal(a, b) or (a.isnan() == b.isnan()).all() for a, b in zip(got, again, strict=True))
    _assert_same_commit(got, commit_check_reference(**x))


@pytest.mark.cuda
def test_cuda_langevin_kernels_equal_the_torch_expressions() -> None:
    s = {k: v.cuda() for k, v in _state(5184, seed=4).items()}
    scheme = _langevin(s["masses"])
    args = (s["positions"], s["momenta"], s["forces"], s["masses"], s["xi"], s["eta"], scheme.c1, scheme.c2,
            scheme.c3, scheme.c4, scheme.c5, scheme.dt)
    got, again = md_step.langevin_first(*args), md_step.langevin_first(*args)
    # v = (r' - r - c5 eta) / dt cancels: an ulp of r' (the kernel may fuse r + dt v into one rounding, torch
    # divides by dt as a product with 1/dt) is ulp(r) / dt in v
    v_tol = 8 * torch.finfo(torch.float64).eps * float(s["positions"].abs().max()) / scheme.dt
    tols = (1e-14, v_tol * float(s["masses"].max()), v_tol, 1e-14)
    for a, b, want, tol in zip(got, again, md_step.langevin_first_reference(*args), tols, strict=True):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, want, rtol=1e-14, atol=tol)
    second = (got[2], s["forces"], s["masses"], got[3], scheme.c1, scheme.c2)
    torch.testing.assert_close(md_step.langevin_second(*second), md_step.langevin_second_reference(*second),
                               rtol=1e-14, atol=1e-14)
