"""Hypothesis strategies for random tensor-product problems, shared by the CPU and CUDA property tests.

A problem draws in1/in2 irreps (l up to 6, both parities, multiplicities 1-300 with the warp and chunk
boundaries 31/32/33, 127/128/129 favoured, repeated irreps, any order), a set of allowed paths (uvu and
uvw, with or without weights, optional explicit path weights, repeated paths), outputs that several paths
share or that no path writes, in a shuffled (unsorted) order, shared or per-row weights and e3nn's
normalisation options. Sizes are bounded by construction (no filtering), so every draw is cheap.

Settings: derandomized (the same examples on every run, no example database), so CI failures reproduce;
`CGFORGE_HYPOTHESIS_EXAMPLES=<n>` sets the number of examples of every property test for a longer local hunt, and
`CGFORGE_HYPOTHESIS_SEED=<n>` explores other examples (printed in the failure header).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from e3nn import o3
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from cgforge.kernels import TensorProduct

MAX_L = 6
MAX_MUL = 300
# Channel counts at the warp (32) and chunk (64, 128) boundaries of the schedule, and the maximum.
BOUNDARY_MULS = (1, 2, 3, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 300)
UVW_WEIGHT_BUDGET = 3000  # mul1 * mul2 * mul_out of one uvw path (weight elements per row)


def hypothesis_settings(max_examples: int, **kwargs) -> settings:
    """Bounded, reproducible settings: derandomized unless CGFORGE_HYPOTHESIS_SEED asks otherwise."""
    n = int(os.environ.get("CGFORGE_HYPOTHESIS_EXAMPLES") or max_examples)
    seeded = "CGFORGE_HYPOTHESIS_SEED" in os.environ
    return settings(
        max_examples=n,
        deadline=None,
        derandomize=not seeded,
        database=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        **kwargs,
    )


def seed_decorator():
    """`hypothesis.seed(n)` when CGFORGE_HYPOTHESIS_SEED is set (hypothesis prints it in failures), else a no-op."""
    from hypothesis import seed

    value = os.environ.get("CGFORGE_HYPOTHESIS_SEED")
    return seed(int(value)) if value else (lambda f: f)


@dataclass(frozen=True)
class RandomProblem:
    """The arguments of `o3.TensorProduct(..., internal_weights=False)` for one random problem."""

    irreps_in1: o3.Irreps
    irreps_in2: o3.Irreps
    irreps_out: o3.Irreps
    instructions: tuple[tuple, ...]
    shared_weights: bool
    irrep_normalization: str
    path_normalization: str

    def args(self) -> tuple:
        return (self.irreps_in1, self.irreps_in2, self.irreps_out, list(self.instructions), self.shared_weights,
                self.irrep_normalization, self.path_normalization)

    def e3nn(self, dtype: torch.dtype = torch.float64, device: str = "cpu") -> o3.TensorProduct:
        """e3nn's module, built under a float64 default so its CG buffers are exact before any cast."""
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            tp = o3.TensorProduct(self.irreps_in1, self.irreps_in2, self.irreps_out, list(self.instructions),
                                  irrep_normalization=self.irrep_normalization,
                                  path_normalization=self.path_normalization,
                                  internal_weights=False, shared_weights=self.shared_weights)
        finally:
            torch.set_default_dtype(previous)
        return tp.to(dtype=dtype, device=device)

    def cgforge(self) -> TensorProduct:
        return TensorProduct(*self.args())

    @property
    def max_l(self) -> int:
        return max(ir.l for _, ir in (*self.irreps_in1, *self.irreps_in2, *self.irreps_out))


def multiplicities(max_mul: int = MAX_MUL) -> st.SearchStrategy[int]:
    boundary = [m for m in BOUNDARY_MULS if m <= max_mul]
    return st.one_of(st.sampled_from(boundary), st.integers(1, max_mul))


def irreps_entries(max_l: int, mul: st.SearchStrategy[int], min_size: int, max_size: int
                   ) -> st.SearchStrategy[list[tuple[int, tuple[int, int]]]]:
    """A list of (mul, (l, p)) in drawn order: unsorted, repeats allowed, both parities."""
    entry = st.tuples(mul, st.tuples(st.integers(0, max_l), st.sampled_from([1, -1])))
    return st.lists(entry, min_size=min_size, max_size=max_size)


@st.composite
def problems(
    draw,
    max_l: int = MAX_L,
    max_mul: int = MAX_MUL,
    max_in1: int = 3,
    max_in2: int = 3,
    max_mul2: int = 3,
    max_paths: int = 4,
    modes: tuple[str, ...] = ("uvu", "uvw"),
    shared: bool | None = None,
    normalisations: bool = True,
) -> RandomProblem:
    in1 = draw(irreps_entries(max_l, multiplicities(max_mul), 1, max_in1))
    in2 = draw(irreps_entries(max_l, st.integers(1, max_mul2), 1, max_in2))
    candidates = [(a, b, l, p1 * p2) for a, (_, (l1, p1)) in enumerate(in1) for b, (_, (l2, p2)) in enumerate(in2)
                  for l in range(abs(l1 - l2), min(l1 + l2, max_l) + 1)]
    paths = draw(st.lists(st.sampled_from(candidates), min_size=1, max_size=max_paths))

    outputs: list[tuple[int, tuple[int, int]]] = []
    instructions = []
    for a, b, l, p in paths:
        mul1, mul2 = in1[a][0], in2[b][0]
        mode = draw(st.sampled_from(modes))
        if mode == "uvu":
            mul_out, has_weight = mul1, draw(st.booleans())
        else:
            cap = max(1, min(max_mul, UVW_WEIGHT_BUDGET // (mul1 * mul2)))
            mul_out, has_weight = draw(st.integers(1, cap)), True
        same = [k for k, (m, ir) in enumerate(outputs) if ir == (l, p) and m == mul_out]
        if same and draw(st.booleans()):
            i_out = draw(st.sampled_from(same))  # several paths into one output irrep
        else:
            i_out = len(outputs)
            outputs.append((mul_out, (l, p)))
        ins = (a, b, i_out, mode, has_weight)
        if draw(st.booleans()):
            ins += (draw(st.sampled_from([0.5, 2.0, 3.0])),)  # an explicit path weight
        instructions.append(ins)
    # an output irrep no path writes (the kernels must zero it), sometimes
    outputs += draw(irreps_entries(max_l, st.integers(1, 8), 0, 1))
    order = draw(st.permutations(range(len(outputs))))  # unsorted outputs
    new_index = {old: new for new, old in enumerate(order)}
    outputs = [outputs[old] for old in order]
    instructions = [(ins[0], ins[1], new_index[ins[2]], *ins[3:]) for ins in instructions]

    irrep_norm, path_norm = "component", "element"
    if normalisations:
        irrep_norm = draw(st.sampled_from(["component", "norm", "none"]))
        path_norm = draw(st.sampled_from(["element", "path", "none"]))
    return RandomProblem(
        o3.Irreps(in1), o3.Irreps(in2), o3.Irreps(outputs), tuple(instructions),
        draw(st.booleans()) if shared is None else shared, irrep_norm, path_norm,
    )


def random_inputs(problem: RandomProblem, batch: int, seed: int, dtype: torch.dtype = torch.float64,
                  device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, y, weight leaves (requires_grad) drawn from a seeded generator (hypothesis draws the seed)."""
    gen = torch.Generator().manual_seed(seed)
    numel = sum(_weight_numel(problem, ins) for ins in problem.instructions)

    def r(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype=dtype, device=device
                                                                            ).requires_grad_(True)

    w = r(numel) if problem.shared_weights else r(batch, numel)
    return r(batch, problem.irreps_in1.dim), r(batch, problem.irreps_in2.dim), w


def _weight_numel(problem: RandomProblem, ins: tuple) -> int:
    if not ins[4]:
        return 0
    m1, m2, mo = problem.irreps_in1[ins[0]].mul, problem.irreps_in2[ins[1]].mul, problem.irreps_out[ins[2]].mul
    return m1 * m2 * mo if ins[3] == "uvw" else m1 * m2


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm of the difference over norm of the reference (the difference itself when the reference is 0)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    den = b.norm().item()
    num = (a - b).norm().item()
    return num / den if den > 0 else num
