"""Spherical harmonics of edge vectors in one CUDA kernel, forward and backward: e3nn's values, written once.

    Y[e, c] = P_c(u_e),    u_e = v_e / max(|v_e|, 1e-12)     (``torch.nn.functional.normalize``'s rule)

P_c: the homogeneous polynomial of degree l(c) an e3nn ``SphericalHarmonics`` module (``normalize=True``) evaluates,
fitted in FP64 on the unit sphere and checked at all lengths (``HarmonicsPolynomials.of``). A thread owns an edge.
Backward: dL/dv = (dL/du - u (u . dL/du)) / |v|, dL/du = sum_c g_c grad P_c(u) (|v| clamped at 1e-12, u . dL/du
then 0). Custom ops ``harmonics_eval`` / ``harmonics_vjp``
keyed by ``register``; second derivatives, calls off CUDA and other dtypes go through ``harmonics_reference``.
"""

from __future__ import annotations

import copy
import functools
import hashlib
from dataclasses import dataclass

import torch
from torch import Tensor

from .core.custom_op import custom_op
from .core.registry import DTYPE_SUFFIX, SourceKernels

NORM_EPS = 1e-12  # torch.nn.functional.normalize's default, which e3nn's SphericalHarmonics uses
_THREADS = 128
_FIT_POINTS = 512


def _monomials(degree: int) -> list[tuple[int, int, int]]:
    """Exponents (a, b, c) of x^a y^b z^c with a + b + c = degree."""
    return [(a, b, degree - a - b) for a in range(degree, -1, -1) for b in range(degree - a, -1, -1)]


@dataclass(frozen=True)
class HarmonicsPolynomials:
    """The output columns of a ``SphericalHarmonics`` module as polynomials of the unit vector: ``monomials`` by degree,
    ``coefficients`` one row per monomial and one value per column, ``degrees`` l per column. Plain numbers: the value
    hashes (the kernels are cached by it)."""

    monomials: tuple[tuple[int, int, int], ...]
    coefficients: tuple[tuple[float, ...], ...]
    degrees: tuple[int, ...]

    @property
    def dim(self) -> int:
        return len(self.degrees)

    @property
    def lmax(self) -> int:
        return max(self.degrees, default=0)

    @classmethod
    def of(cls, module: torch.nn.Module) -> HarmonicsPolynomials:
        """The polynomials of an e3nn ``SphericalHarmonics`` module with ``normalize=True`` (any e3nn version,
        normalization and set of l); ValueError where the module is not such a module."""
        irreps = getattr(module, "irreps_out", None)
        if irreps is None or not getattr(module, "normalize", False):
            raise ValueError(f"harmonics: expected an e3nn SphericalHarmonics module with normalize=True, got "
                             f"{type(module).__name__}")
        degrees = tuple(ir.l for mul, ir in irreps for _ in range(mul) for _ in range(ir.dim))
        module = copy.deepcopy(module).to(torch.float64)  # a copy: the caller's module keeps its dtype
        cached = _fit(module, degrees)
        check = torch.randn(_FIT_POINTS, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        check *= torch.logspace(-3, 2, _FIT_POINTS, dtype=torch.float64)[:, None]  # all lengths
        with torch.no_grad():
            want = module(check)
        got = harmonics_reference(check, cached)
        err = float((got - want).abs().max())
        if err > 1e-10 * max(1.0, float(want.abs().max())):
            raise ValueError(f"harmonics: {type(module).__name__} is not a polynomial of the unit vector in each "
                             f"column (off by {err:.2e} after the fit): keep e3nn's module")
        return cached


def _fit(module: torch.nn.Module, degrees: tuple[int, ...]) -> HarmonicsPolynomials:
    """Least squares of each column on the monomials of its degree, on points of the unit sphere (FP64)."""
    points = torch.randn(_FIT_POINTS, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    points = points / points.norm(dim=1, keepdim=True)
    with torch.no_grad():
        values = module(points)
    if values.shape != (_FIT_POINTS, len(degrees)):
        raise ValueError(f"harmonics: the module gave shape {tuple(values.shape)} for {_FIT_POINTS} vectors, "
                         f"expected ({_FIT_POINTS}, {len(degrees)})")
    monomials = [m for degree in sorted(set(degrees)) for m in _monomials(degree)]
    coefficients = torch.zeros(len(monomials), len(degrees), dtype=torch.float64)
    for degree in sorted(set(degrees)):
        rows = [i for i, m in enumerate(monomials) if sum(m) == degree]
        columns = [c for c, d in enumerate(degrees) if d == degree]
        basis = _evaluate_monomials(points, [monomials[i] for i in rows])
        solution = torch.linalg.lstsq(basis, values[:, columns]).solution
        solution[solution.abs() < 1e-13] = 0.0  # exact zeros read better in the source and cost nothing
        coefficients[torch.tensor(rows)[:, None], torch.tensor(columns)[None, :]] = solution
    # 14 digits: the same value from run to run (the last bits of a fit may move), far below FP64 checks
    rows = tuple(tuple(float(f"{x:.14g}") for x in row) for row in coefficients.tolist())
    return HarmonicsPolynomials(tuple(monomials), rows, degrees)


def _evaluate_monomials(u: Tensor, monomials: list[tuple[int, int, int]] | tuple) -> Tensor:
    """[N, M] values of the monomials at the rows of u [N, 3], from products only (differentiable everywhere)."""
    top = max([0] + [e for m in monomials for e in m])  # plain builtins: torch.compile traces this
    powers = [torch.ones_like(u)]
    for _ in range(top):
        powers.append(powers[-1] * u)
    table = torch.stack(powers, dim=2)  # [N, 3, top + 1]: table[:, k, p] = u_k ** p
    exps = torch.tensor(monomials, dtype=torch.int64, device=u.device).reshape(-1, 3)
    return table[:, 0, exps[:, 0]] * table[:, 1, exps[:, 1]] * table[:, 2, exps[:, 2]]


def harmonics_reference(vectors: Tensor, polys: HarmonicsPolynomials) -> Tensor:
    """[E, D] harmonics of vectors [E, 3] in torch (any device and dtype; differentiable to any order)."""
    norm = vectors.norm(dim=-1, keepdim=True).clamp_min(NORM_EPS)
    u = vectors / norm
    return _evaluate_monomials(u, polys.monomials) @ _table(polys.coefficients, u.dtype, u.device)


def _table(rows: tuple[tuple[float, ...], ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """``rows`` as a tensor, made per call: a cached one could be a fake tensor left by compile's tracing."""
    return torch.tensor(rows, dtype=dtype, device=device)


@functools.lru_cache(maxsize=16)
def _derivatives(polys: HarmonicsPolynomials) -> tuple[tuple[tuple[int, int, int], ...], tuple]:
    """The monomials one degree below ``polys``' and, per axis, the [M', D] table of d/du_axis of every column in
    them (a * x^(a-1) ...), as plain numbers."""
    index = {m: i for i, m in enumerate(polys.monomials)}
    lower = tuple(sorted({tuple(e - (j == axis) for j, e in enumerate(m)) for m in polys.monomials
                          for axis in range(3) if m[axis]}))
    tables = []
    for axis in range(3):
        rows = []
        for m in lower:
            upper = tuple(e + (j == axis) for j, e in enumerate(m))
            row = polys.coefficients[index[upper]] if upper in index else (0.0,) * polys.dim
            rows.append(tuple(c * upper[axis] for c in row))
        tables.append(tuple(rows))
    return lower, tuple(tables)


def _vjp_reference(vectors: Tensor, grad: Tensor, polys: HarmonicsPolynomials) -> Tensor:
    """dL/dvectors [E, 3] from dL/dY [E, D] by the kernel's formula (module doc) in torch, with no autograd inside:
    the vjp op's body off CUDA, which torch's compile tracing can enter."""
    norm = vectors.norm(dim=-1, keepdim=True)
    clamped = norm.clamp_min(NORM_EPS)
    u = vectors / clamped
    lower, tables = _derivatives(polys)
    if not lower:  # only l = 0: constant harmonics
        return torch.zeros_like(vectors)
    values = _evaluate_monomials(u, lower)  # [E, M']
    columns = [((values @ _table(d, u.dtype, u.device)) * grad).sum(1) for d in tables]  # dL/du per axis
    gu = torch.stack(columns, dim=1)
    along = torch.where(norm > NORM_EPS, (u * gu).sum(1, keepdim=True), torch.zeros_like(norm))
    return (gu - u * along) / clamped


def _name(m: tuple[int, int, int]) -> str:
    return f"m{m[0]}{m[1]}{m[2]}"


def _monomial_lines(lmax: int) -> list[str]:
    """``const T mabc = ...;`` for every monomial of degree <= lmax, each one product from the one below it."""
    lines = ["const T m000 = (T)1;"]
    for degree in range(1, lmax + 1):
        for a, b, c in _monomials(degree):
            below, factor = ((a - 1, b, c), "x") if a else ((a, b - 1, c), "y") if b else ((a, b, c - 1), "z")
            lines.append(f"const T {_name((a, b, c))} = {_name(below)} * {factor};")
    return lines


def _literal(value: float) -> str:
    return f"(T){value!r}"


def _sum(terms: list[str]) -> str:
    return " + ".join(terms) if terms else "(T)0"


@functools.lru_cache(maxsize=16)
def harmonics_source(polys: HarmonicsPolynomials) -> str:
    """The CUDA source: ``harmonics_fwd_f32/f64(v, out, n)`` and ``harmonics_bwd_f32/f64(v, grad, grad_v, n)``,
    one thread per edge, for these polynomials."""
    coefficients = polys.coefficients
    values, partials = [], {axis: [] for axis in range(3)}
    for c in range(polys.dim):
        terms = [(coefficients[i][c], m) for i, m in enumerate(polys.monomials) if coefficients[i][c] != 0.0]
        values.append(f"out[{c}] = {_sum([f'{_literal(k)} * {_name(m)}' for k, m in terms])};")
        for axis in range(3):  # d/du_axis: a * x^(a-1) ...
            d_terms = []
            for k, m in terms:
                if m[axis]:
                    lower = tuple(e - (j == axis) for j, e in enumerate(m))
                    d_terms.append(f"{_literal(k * m[axis])} * {_name(lower)}")
            if d_terms:
                partials[axis].append(f"g[{c}] * ({_sum(d_terms)})")
    indent = "\n        "
    monomials = indent.join(_monomial_lines(max(polys.lmax - 1, 0)))
    monomials_top = indent.join(_monomial_lines(polys.lmax))
    gu = indent.join(f"const T gu{'xyz'[axis]} = {_sum(partials[axis])};" for axis in range(3))
    return f"""
template <typename T>
__device__ __forceinline__ T unit(const T* __restrict__ v, long long e, T& x, T& y, T& z) {{
    const T vx = v[3 * e], vy = v[3 * e + 1], vz = v[3 * e + 2];
    const T norm = sqrt(vx * vx + vy * vy + vz * vz);
    const T inv = (T)1 / (norm > (T){NORM_EPS!r} ? norm : (T){NORM_EPS!r});
    x = vx * inv; y = vy * inv; z = vz * inv;
    return norm;
}}

template <typename T>
__device__ void harmonics_fwd(const T* __restrict__ v, T* __restrict__ y_out, long long n) {{
    const long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= n) return;
    T x, y, z;
    unit(v, e, x, y, z);
    {monomials_top}
    T* out = y_out + e * {polys.dim};
    {indent.join(values)}
}}

template <typename T>
__device__ void harmonics_bwd(const T* __restrict__ v, const T* __restrict__ grad, T* __restrict__ grad_v,
                              long long n) {{
    const long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= n) return;
    T x, y, z;
    const T norm = unit(v, e, x, y, z);
    {monomials}
    const T* g = grad + e * {polys.dim};
    {gu}
    const T inv = (T)1 / (norm > (T){NORM_EPS!r} ? norm : (T){NORM_EPS!r});
    const T along = norm > (T){NORM_EPS!r} ? x * gux + y * guy + z * guz : (T)0;  // the clamp is linear
    grad_v[3 * e] = (gux - x * along) * inv;
    grad_v[3 * e + 1] = (guy - y * along) * inv;
    grad_v[3 * e + 2] = (guz - z * along) * inv;
}}

extern "C" __global__ void harmonics_fwd_f32(const float* v, float* out, long long n) {{
    harmonics_fwd<float>(v, out, n);
}}
extern "C" __global__ void harmonics_fwd_f64(const double* v, double* out, long long n) {{
    harmonics_fwd<double>(v, out, n);
}}
extern "C" __global__ void harmonics_bwd_f32(const float* v, const float* g, float* gv, long long n) {{
    harmonics_bwd<float>(v, g, gv, n);
}}
extern "C" __global__ void harmonics_bwd_f64(const double* v, const double* g, double* gv, long long n) {{
    harmonics_bwd<double>(v, g, gv, n);
}}
"""


_NAMES = [f"harmonics_{d}_{s}" for d in ("fwd", "bwd") for s in DTYPE_SUFFIX.values()]
_REGISTERED: dict[str, HarmonicsPolynomials] = {}  # the ops' ``key`` -> its polynomials (ops take plain values)


@functools.lru_cache(maxsize=16)
def _kernels(source: str) -> SourceKernels:
    return SourceKernels(source, _NAMES, "harmonics")


@functools.lru_cache(maxsize=64)
def register(polys: HarmonicsPolynomials) -> str:
    """The key by which the custom ops know ``polys`` (registered in this process; ops take plain values). Call it
    outside torch.compile'd code (Dynamo does not trace a cached function): modules keep the key they registered."""
    key = hashlib.sha1(repr(polys).encode()).hexdigest()[:20]
    _REGISTERED[key] = polys
    return key


def _launch(polys: HarmonicsPolynomials, direction: str, vectors: Tensor, args: list) -> None:
    from .core.runtime import I64

    n = vectors.shape[0]
    if n:
        kernel = _kernels(harmonics_source(polys)).get(f"harmonics_{direction}_{DTYPE_SUFFIX[vectors.dtype]}",
                                                       vectors.device)
        kernel.launch((-(-n // _THREADS),), (_THREADS,), args + [I64(n)])


def _eval_fake(vectors, key):  # noqa: ANN001, ANN202
    return vectors.new_empty(vectors.shape[0], _REGISTERED[key].dim)


def _eval_grad(ctx, grad):  # noqa: ANN001, ANN202
    (vectors,) = ctx.saved_tensors
    (key,) = ctx.args
    return harmonics_vjp(vectors, grad.to(vectors.dtype).contiguous(), key), None  # the kernel reads one dtype


@custom_op("harmonics_eval", _eval_fake, _eval_grad)
def harmonics_eval(vectors: Tensor, key: str) -> Tensor:
    """[E, D] harmonics of contiguous [E, 3] vectors (FP32 or FP64) for the registered ``key``: the kernel on CUDA,
    the torch reference elsewhere (so the CPU tests run the ops themselves)."""
    if vectors.device.type != "cuda":
        return harmonics_reference(vectors, _REGISTERED[key])
    out = vectors.new_empty(vectors.shape[0], _REGISTERED[key].dim)
    _launch(_REGISTERED[key], "fwd", vectors, [vectors, out])
    return out


def _vjp_fake(vectors, grad, key):  # noqa: ANN001, ANN202
    return torch.empty_like(vectors)


def _vjp_grad(ctx, upstream):  # noqa: ANN001, ANN202
    """The vector-Jacobian product's own derivatives (a second derivative of the harmonics), through the torch
    reference: in the vectors and in the incoming gradient."""
    vectors, grad = ctx.saved_tensors
    (key,) = ctx.args
    with torch.enable_grad():
        v = vectors.detach().requires_grad_(True)
        g = grad.detach().requires_grad_(True)
        (gv,) = torch.autograd.grad(harmonics_reference(v, _REGISTERED[key]), v, g, create_graph=True)
        d_vectors, d_grad = torch.autograd.grad(gv, (v, g), upstream)
    return d_vectors, d_grad, None


@custom_op("harmonics_vjp", _vjp_fake, _vjp_grad)
def harmonics_vjp(vectors: Tensor, grad: Tensor, key: str) -> Tensor:
    """dL/dvectors [E, 3] from dL/dY [E, D] (contiguous, the vectors' dtype) for the registered ``key``: the kernel on
    CUDA, the same formula in torch elsewhere."""
    if vectors.device.type != "cuda":
        return _vjp_reference(vectors, grad, _REGISTERED[key])
    out = torch.empty_like(vectors)
    _launch(_REGISTERED[key], "bwd", vectors, [vectors, grad, out])
    return out


def harmonics(vectors: Tensor, polys: HarmonicsPolynomials, key: str | None = None) -> Tensor:
    """[E, D] harmonics of edge vectors [E, 3]: the kernels on CUDA (custom ops), else ``harmonics_reference``;
    differentiable twice. key: ``register(polys)`` (None: registered here; torch.compile callers register first)."""
    if vectors.dim() != 2 or vectors.shape[1] != 3:
        raise ValueError(f"vectors: expected an [E, 3] tensor, got shape {tuple(vectors.shape)}")
    if vectors.device.type != "cuda" or vectors.dtype not in DTYPE_SUFFIX:
        return harmonics_reference(vectors, polys)
    return harmonics_eval(vectors.contiguous(), register(polys) if key is None else key)
