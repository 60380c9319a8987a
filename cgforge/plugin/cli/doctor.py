"""`cgforge doctor`: versions, the NVRTC library, the GPU, the kernel cache, which model families load (and
why not), then a small kernel and a small tensor product compiled (with a GPU: run and checked). 0 when every
check passed.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["main"]

AXPY_SOURCE = r"""
extern "C" __global__ void cgforge_doctor_axpy(double a, const double* __restrict__ x,
                                               double* __restrict__ y, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] += a * x[i];
}
"""
KERNEL = "cgforge_doctor_axpy"


def _dist_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _cupy_distributions() -> list[str]:
    """The installed distributions that provide the `cupy` package (cupy-cuda12x, cupy-cuda13x, ...)."""
    return sorted(set(importlib.metadata.packages_distributions().get("cupy", [])))


def _cupy_version() -> str:
    dists = _cupy_distributions()
    return ", ".join(f"{importlib.metadata.version(dist)} ({dist})" for dist in dists) or "not installed"


# The install extras by CUDA major (pyproject.toml), and the wheels each brings.
EXTRAS = {12: ("cupy-cuda12x", "nvidia-cuda-nvrtc-cu12"), 13: ("cupy-cuda13x", "nvidia-cuda-nvrtc")}


def _cupy_cuda_major(dist: str) -> int | None:
    """12 for cupy-cuda12x (CuPy's wheels name the CUDA major); None for a source build (`cupy`)."""
    match = re.fullmatch(r"cupy-cuda(\d+)x", dist.lower().replace("_", "-"))
    return int(match.group(1)) if match else None


def _install_hint(major: int | None) -> str:
    if major in EXTRAS:
        return f"pip install 'cgforge[cuda{major}]' ({' and '.join(EXTRAS[major])})"
    if major is None:
        return "pip install 'cgforge[cuda12]' or 'cgforge[cuda13]', the CUDA major of torch.version.cuda"
    return f"no cgforge extra for CUDA {major}: install cupy-cuda{major}x and CUDA {major}'s NVRTC yourself"


def cuda_version_checks(torch_cuda: str | None, cupy_dists: list[str],
                        nvrtc: tuple[int, int] | None) -> list[tuple[bool, str]]:
    """(ok, detail) for the CUDA majors of torch, CuPy (its wheel's name) and NVRTC: all three should match (a mix
    loads two CUDA runtimes and ties the newest GPUs to the older NVRTC)."""
    if torch_cuda is None:
        return [(True, "torch is a CPU build: NVRTC compiles here, the kernels run only with CUDA torch")]
    torch_major = int(torch_cuda.split(".")[0])
    fix = _install_hint(torch_major)
    checks = []
    if len(cupy_dists) > 1:
        checks.append((False, f"several CuPy wheels are installed ({', '.join(cupy_dists)}): they share the "
                              f"`cupy` package; uninstall all but the one for CUDA {torch_major} ({fix})"))
    mismatched = [d for d in cupy_dists if _cupy_cuda_major(d) not in (torch_major, None)]
    if mismatched:
        wrong = ", ".join(f"{d} (CUDA {_cupy_cuda_major(d)})" for d in mismatched)
        checks.append((False, f"torch is built for CUDA {torch_cuda} but CuPy is {wrong}: "
                              f"pip uninstall {' '.join(mismatched)}; {fix}"))
    if nvrtc is not None and nvrtc[0] != torch_major:
        # the loader finds the CUDA 12 wheel's library first: it has to go (or CGFORGE_NVRTC_PATH names one)
        wheel = EXTRAS.get(nvrtc[0], (None, None))[1]
        remove = f"pip uninstall {wheel}; " if wheel else ""
        checks.append((False, f"torch is built for CUDA {torch_cuda} but NVRTC is {nvrtc[0]}.{nvrtc[1]}: "
                              f"{remove}{fix}; or set CGFORGE_NVRTC_PATH to CUDA {torch_major}'s libnvrtc.so"))
    if not checks:
        cupy = ", ".join(cupy_dists) or "no CuPy"
        nvrtc_text = f"NVRTC {nvrtc[0]}.{nvrtc[1]}" if nvrtc else "no NVRTC"
        checks.append((True, f"torch CUDA {torch_cuda}, {cupy}, {nvrtc_text}"))
    return checks


# The model families' packages (pyproject.toml's extras): the tested version and the e3nn each runs with (mace-torch
# pins e3nn==0.4.4 but runs with 0.4.4 to 0.6, hence `pip install --no-deps`; nequip needs e3nn >= 0.6).
FAMILIES = {"MACE": ("mace-torch", "0.3.16", (0, 4, 4)), "NequIP": ("nequip", "0.19.1", (0, 6))}


def _release(version: str) -> tuple[int, ...]:
    """(0, 6, 0) for '0.6.0' or '0.6.0.dev1+local'."""
    match = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(part) for part in match.group().split(".")) if match else ()


def _requirements(dist: str) -> list[str]:
    """Names of the distributions ``dist`` always requires (its metadata, extras and marked ones left out)."""
    try:
        requires = importlib.metadata.requires(dist) or []
    except importlib.metadata.PackageNotFoundError:
        return []
    return [re.match(r"[A-Za-z0-9._-]+", r).group() for r in requires if ";" not in r]


def family_checks(version: Callable[[str], str] = _dist_version,
                  requirements: Callable[[str], list[str]] = _requirements) -> list[tuple[str, bool, str]]:
    """(family, can load, why) for each model family: its package, the e3nn it runs with and its own requirements
    installed (``version(dist)``: the version or ``"not installed"``; ``requirements(dist)``: names)."""
    e3nn = version("e3nn")
    lines = []
    for family, (dist, tested, e3nn_min) in FAMILIES.items():
        have = version(dist)
        extra = "--no-deps mace-torch==0.3.16 after its dependencies" if dist == "mace-torch" else f"{dist}=={tested}"
        if have == "not installed":
            lines.append((family, False, f"cannot load: {dist} is not installed (pip install {extra}; the "
                                         "README's install section)"))
        elif e3nn == "not installed" or _release(e3nn) < e3nn_min:
            floor = ".".join(map(str, e3nn_min))
            lines.append((family, False, f"cannot load: {dist} {have} needs e3nn >= {floor}, this environment has "
                                         f"e3nn {e3nn} (pip install 'e3nn>={floor},<0.7': cgforge and mace-torch "
                                         "run with e3nn 0.6)"))
        elif missing := [name for name in requirements(dist)
                         if name.lower() != "e3nn" and version(name) == "not installed"]:
            lines.append((family, False, f"cannot load: {dist} {have} needs {', '.join(missing)}, not installed "
                                         f"(pip install {' '.join(missing)})"))
        else:
            why = f"{dist} {have}, e3nn {e3nn}"
            if dist == "mace-torch" and _release(e3nn) != (0, 4, 4):
                why += " (mace-torch pins e3nn==0.4.4; cgforge runs MACE with either)"
            if have != tested:
                why += f"; cgforge is tested with {dist} {tested}"
            lines.append((family, True, why))
    return lines


def _cache_dir_status() -> tuple[str, bool]:
    from cgforge.kernels.core.compiler import cache_dir

    directory = cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".doctor.", suffix=".tmp"):
            pass
    except OSError as e:
        return f"{directory} (NOT writable: {e}; kernels will be recompiled in every process)", False
    return f"{directory} (writable)", True


def _kernel_options(report: _Report) -> None:
    """The kernels' default tuning, and any ``CGFORGE_*`` variable nothing reads."""
    from cgforge.kernels import KernelTuning
    from cgforge.kernels.core.compiler import ENVIRONMENT

    tuning = KernelTuning()
    report.info("kernel tuning", "the defaults (a model's: patch(model, tuning=KernelTuning(...)); no environment "
                                 "variable changes it)")
    report.info("  TPTuning", tuning.tp.describe())
    report.info("  SCTuning", tuning.sc.describe())
    ignored = sorted(name for name in os.environ if name.startswith("CGFORGE_") and name not in ENVIRONMENT)
    if ignored:
        report.info("ignored variables", ", ".join(ignored) + " (kernel tuning is passed as values, not read from "
                                                               "the environment)")


class _Report:
    def __init__(self, out: Callable[[str], None]):
        self.out, self.failed = out, False

    def info(self, label: str, value: str) -> None:
        self.out(f"  {label:<16} {value}")

    def check(self, label: str, ok: bool, detail: str, *, fatal: bool = True) -> None:
        status = "ok" if ok else ("FAIL" if fatal else "warn")
        self.out(f"  [{status:>4}] {label}: {detail}")
        self.failed |= fatal and not ok


def _check_compile(report: _Report, arch: str):
    from cgforge.kernels.core.compiler import CompileError
    from cgforge.kernels.core.registry import compile_source

    start = time.perf_counter()
    try:
        result = compile_source(AXPY_SOURCE, KERNEL, arch)
    except (CompileError, ValueError, RuntimeError) as e:
        report.check(f"compile for {arch}", False, str(e).splitlines()[0])
        return None
    ms = 1e3 * (time.perf_counter() - start)
    res = result.kernels.get(KERNEL)
    if res is None:
        report.check(f"compile for {arch}", False, "cubin built, but NVRTC's log has no ptxas report")
        return result
    report.check(f"compile for {arch}", True, f"{len(result.cubin)} byte cubin in {ms:.0f} ms; "
                 f"{res.registers} registers, {res.spill_stores} bytes spill stores")
    return result


def _check_gpu_run(report: _Report, torch, arch: str) -> None:
    from cgforge.kernels.core.runtime import I64, load_kernels

    result = _check_compile(report, arch)
    if result is None:
        return
    try:
        kernel = load_kernels(result.cubin, [KERNEL])[KERNEL]
        n = 1000
        x = torch.arange(n, dtype=torch.float64, device="cuda")
        y = torch.ones(n, dtype=torch.float64, device="cuda")
        import numpy as np

        kernel.launch(((n + 127) // 128,), (128,), [np.float64(2.5), x, y, I64(n)])
        torch.cuda.synchronize()
        expected = 1.0 + 2.5 * torch.arange(n, dtype=torch.float64)
        ok = torch.equal(y.cpu(), expected)
        detail = "axpy result exact" if ok else f"wrong result, max error {(y.cpu() - expected).abs().max()}"
        report.check("load and run on the GPU", ok, detail)
    except Exception as e:  # report anything the driver or CuPy raises, don't crash the doctor
        report.check("load and run on the GPU", False, f"{type(e).__name__}: {e}")


# A small tensor product with every kind of path the kernels unroll (l up to 2, uvu with and without weights)
_TP_IRREPS = ("8x0e+8x1o+4x2e", "1x0e+1x1o+1x2e", "8x0e+8x1o+4x2e+8x1e")
_TP_INSTRUCTIONS = [(0, 0, 0, "uvu", True), (0, 1, 1, "uvu", True), (1, 1, 0, "uvu", True), (1, 1, 3, "uvu", False),
                    (1, 2, 1, "uvu", True), (2, 0, 2, "uvu", True), (2, 2, 2, "uvu", True), (1, 0, 1, "uvu", True)]


def _check_generated_tp(report: _Report, torch, gpu: bool) -> None:
    """Render and compile a generated tensor product for sm_80; with a GPU, run it against the CPU reference."""
    from cgforge.kernels import TensorProduct
    from cgforge.kernels.core.compiler import CompileError
    from cgforge.kernels.core.registry import compile_source
    from cgforge.kernels.tensor_product import plan as plans
    from cgforge.kernels.tensor_product.layout import TP_LAYOUT

    tp = TensorProduct(*_TP_IRREPS, _TP_INSTRUCTIONS)
    try:
        plan, reports, lines, ms = plans.get(tp.key), [], 0, 0.0
        for backward in (False, True):
            source, function = plan.source(torch.float32, TP_LAYOUT, backward)
            start = time.perf_counter()
            reports.append(compile_source(source, function, "sm_80").kernels.get(function))
            ms += 1e3 * (time.perf_counter() - start)
            lines += len(source.splitlines())
        detail = ", ".join(f"{d} {r.registers} registers / {r.spill_stores} B spills" for d, r in
                           zip(("forward", "backward"), reports) if r is not None)
        report.check("generated tensor product (sm_80)", True, f"{lines} lines of CUDA, "
                     f"compiled in {ms:.0f} ms; {detail or 'no ptxas report'}")
    except (CompileError, ValueError, RuntimeError) as e:
        report.check("generated tensor product (sm_80)", False, str(e).splitlines()[0])
        return
    if not gpu:
        return
    try:
        g = torch.Generator().manual_seed(0)
        x, y = (torch.randn(257, d, generator=g, dtype=torch.float64) for d in (tp.irreps_in1.dim, tp.irreps_in2.dim))
        w = torch.randn(257, tp.weight_numel, generator=g, dtype=torch.float64)
        ref = tp(x, y, w)
        inputs = [t.cuda().requires_grad_() for t in (x, y, w)]
        out = tp(*inputs)
        grads = torch.autograd.grad(out, inputs, out.detach())
        ref_inputs = [t.clone().requires_grad_() for t in (x, y, w)]
        ref_grads = torch.autograd.grad(tp(*ref_inputs), ref_inputs, ref.detach())
        err = max(float((a.cpu() - b).norm() / b.norm()) for a, b in zip([out.detach(), *grads], [ref, *ref_grads]))
        report.check("generated tensor product on the GPU", err < 1e-12,
                     f"forward and backward in FP64, largest relative error {err:.1e} against the CPU reference")
    except Exception as e:  # report anything the driver or CuPy raises, don't crash the doctor
        report.check("generated tensor product on the GPU", False, f"{type(e).__name__}: {e}")


def main(out: Callable[[str], None] = print) -> int:
    """Print the environment report and run the checks; 0 when all checks pass."""
    report = _Report(out)
    out("cgforge doctor")
    report.info("python", f"{platform.python_version()} ({sys.executable})")
    report.info("cgforge", _dist_version("cgforge"))
    try:
        import torch
    except ImportError:
        torch = None
    report.info("torch", "not installed" if torch is None else
                f"{torch.__version__} (CUDA {torch.version.cuda or 'none: CPU build'})")
    for name in ("e3nn", "cupy", "mace-torch", "nequip", "ase"):
        report.info(name, _cupy_version() if name == "cupy" else _dist_version(name))

    from cgforge.kernels.core import compiler

    nvrtc_ok = compiler.nvrtc_available()
    if nvrtc_ok:
        major, minor = compiler.nvrtc_version()
        report.info("nvrtc", f"{major}.{minor} ({compiler.nvrtc_library_path()})")
    else:
        try:
            compiler.nvrtc_version()
        except compiler.NvrtcUnavailableError as e:
            report.info("nvrtc", f"NOT FOUND\n{e}")

    gpu_arch = None
    if torch is not None and torch.cuda.is_available():
        from cgforge.kernels.core.runtime import device_arch

        gpu_arch = device_arch()
        report.info("gpu", f"{torch.cuda.get_device_name()} ({gpu_arch}), {torch.cuda.device_count()} visible")
    else:
        report.info("gpu", "no GPU")
    cache_text, cache_ok = _cache_dir_status()
    if os.environ.get("CGFORGE_CACHE_DISABLE", "") in ("1", "true", "yes"):
        cache_text += ", disabled by CGFORGE_CACHE_DISABLE"
    report.info("kernel cache", cache_text)
    _kernel_options(report)

    out("checks")
    torch_cuda = torch.version.cuda if torch is not None else None
    torch_major = int(torch_cuda.split(".")[0]) if torch_cuda else None
    report.check("nvrtc found", nvrtc_ok, "yes" if nvrtc_ok else _install_hint(torch_major))
    for ok, detail in cuda_version_checks(torch_cuda, _cupy_distributions(),
                                          compiler.nvrtc_version() if nvrtc_ok else None):
        report.check("CUDA versions match", ok, detail, fatal=False)
    report.check("kernel cache writable", cache_ok, str(Path(compiler.cache_dir())), fatal=False)
    for family, ok, why in family_checks():  # an environment may hold one family only: a warning, not a failure
        report.check(f"{family} models", ok, why, fatal=False)
    if nvrtc_ok:
        _check_compile(report, "sm_80")
        if gpu_arch is not None:
            _check_gpu_run(report, torch, gpu_arch)
        if torch is not None:
            _check_generated_tp(report, torch, gpu_arch is not None)
    out("all checks passed" if not report.failed else "some checks FAILED")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
