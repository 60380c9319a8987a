"""The schedule of a symmetric contraction: a small basis of coupling chains and a weight transform.

MACE's U columns are an overcomplete basis of symmetric polynomials. So each W_{o,nu} [E, K, C] is mapped to
W'_{o,nu} = A_{o,nu} W_{o,nu} [E, R, C] (R = rank) and the kernel evaluates R basis polynomials, chains of sparse
couplings with shared products:

    nodes:   n = CG(left (x) x_i -> ir)            left an input block x_i1 or an earlier node
    output:  out_o += sum_groups CG(Z (x) x_i -> L_o),  Z = sum_terms W'[slot] * left
             out_o += W'[slot] * x_i                (degree 1)

A group collects the chains with the same last input and irrep before it (MACE's Horner scheme). The basis is
chosen greedily by marginal multiply-adds among chains in the span of MACE's columns. float64 numpy, once per
problem.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
from e3nn import o3

from ..core.cg import sparse_cg
from .problem import SCProblem

_IN_SPAN = 1e-9  # a chain is in MACE's span if its residual is below this (relative)
_NEW_DIRECTION = (1e-3, 1e-8)  # a chain extends the basis if its new part is above this (relative)
_FIT_TOL = 1e-10  # largest relative misfit of U = B A accepted
# U tensors stored in float32 (a MACE model built in float32) carry round-off of ~1e-7: their span is
# found, and fitted, to that precision only.
_FP32_TOL = 1e-5


@dataclass(frozen=True)
class Ref:
    """A vector operand of one channel: input block `index` of x ("x") or product node `index` ("n")."""

    kind: str
    index: int


class _HasL:
    l: int

    @property
    def dim(self) -> int:
        return 2 * self.l + 1


@dataclass(frozen=True)
class Node(_HasL):
    """value[mo] = sum cg (ma, mi, mo, v): v * left[ma] * x_input[mi]; irrep (l, p) of `degree` inputs."""

    left: Ref
    input: int
    l: int
    p: int
    degree: int
    cg: tuple[tuple[int, int, int, float], ...]


@dataclass(frozen=True)
class Term:
    """Z += W'[slot] * left (one basis chain of a group)."""

    slot: int
    left: Ref


@dataclass(frozen=True)
class Group:
    """out += sum cg (ma, mi, M, v): v * Z[ma] * x_input[mi], Z = sum_terms W'[slot] * left."""

    input: int
    left_l: int
    left_p: int
    cg: tuple[tuple[int, int, int, float], ...]
    terms: tuple[Term, ...]


@dataclass(frozen=True)
class Linear:
    """out += W'[slot] * x_input (an input block of the output's irrep)."""

    slot: int
    input: int


@dataclass(frozen=True)
class OutputPlan(_HasL):
    """One output irrep: its degree-1 terms and its groups."""

    l: int
    p: int
    offset: int  # column of this irrep's block in an output row (channel-major within the block)
    linear: tuple[Linear, ...]
    groups: tuple[Group, ...]


@dataclass(frozen=True)
class Transform:
    """W'[:, slot0:slot0 + R, :] = A @ W_{o,nu}; W_{o,nu} at rows k0:k0 + K of the concatenated weights."""

    o: int
    nu: int
    slot0: int
    k0: int
    a: np.ndarray = field(repr=False, compare=False)


@dataclass(frozen=True)
class SCSchedule:
    problem: SCProblem
    nodes: tuple[Node, ...]
    outputs: tuple[OutputPlan, ...]
    transforms: tuple[Transform, ...]
    num_slots: int  # R: rows of W' per species
    num_params: int  # K: rows of the concatenated MACE weights per species

    def transform_matrix(self) -> np.ndarray:
        """The block-diagonal [R, K] matrix with W' = A W for the concatenated weights."""
        a = np.zeros((self.num_slots, self.num_params))
        for t in self.transforms:
            r, k = t.a.shape
            a[t.slot0:t.slot0 + r, t.k0:t.k0 + k] = t.a
        return a

    def ref_dim(self, ref: Ref) -> int:
        if ref.kind == "x":
            return self.problem.coupling[ref.index].dim
        return self.nodes[ref.index].dim

    def forward_cost(self) -> dict[str, int]:
        """Multiply-adds per (atom, channel): nodes, weight mixing, last couplings, degree-1 terms."""
        cost = {"nodes": sum(_coupling_cost(n.cg) for n in self.nodes), "mixing": 0, "couplings": 0, "linear": 0}
        for out in self.outputs:
            cost["linear"] += out.dim * len(out.linear)
            for g in out.groups:
                cost["couplings"] += _coupling_cost(g.cg)
                cost["mixing"] += sum(self.ref_dim(t.left) for t in g.terms)
        cost["total"] = sum(cost.values())
        return cost


def _coupling_cost(cg) -> int:
    return len({(a, b) for a, b, _, _ in cg}) + len(cg)


def _couples(l1: int, p1: int, l2: int, p2: int, l3: int, p3: int) -> bool:
    return p1 * p2 == p3 and abs(l1 - l2) <= l3 <= l1 + l2


# Polynomials as vectors: a tensor [d, D**nu] contracted with x (x) ... (x) x is a polynomial; two
# tensors give the same polynomial iff their symmetrisations over the nu input axes agree.


class _Symmetriser:
    def __init__(self, dim: int):
        self.dim = dim
        self._index: dict[int, np.ndarray] = {}

    def vector(self, t: np.ndarray, nu: int) -> np.ndarray:
        """[d, D**nu] (or [d, D, ..., D]) -> the symmetric part at sorted index tuples, flattened."""
        d = t.shape[0]
        t = t.reshape((d,) + (self.dim,) * nu)
        sym = sum(t.transpose((0,) + tuple(1 + q for q in perm)) for perm in itertools.permutations(range(nu)))
        return sym.reshape(d, -1)[:, self._sorted(nu)].reshape(-1)

    def _sorted(self, nu: int) -> np.ndarray:
        if nu not in self._index:
            combos = np.array(list(itertools.combinations_with_replacement(range(self.dim), nu)))
            self._index[nu] = np.ravel_multi_index(combos.T, (self.dim,) * nu) if nu > 1 else combos[:, 0]
        return self._index[nu]


def _orthonormal_columns(m: np.ndarray, cutoff: float) -> np.ndarray:
    """An orthonormal basis of m's columns, ignoring directions with singular values below cutoff."""
    if m.shape[1] == 0:
        return np.zeros((m.shape[0], 0))
    u, s, _ = np.linalg.svd(m, full_matrices=False)
    return u[:, s > cutoff]


def _residual(v: np.ndarray, q: np.ndarray) -> np.ndarray:
    if q.shape[1] == 0:
        return v
    r = v - q @ (q.T @ v)
    return r - q @ (q.T @ r)  # twice: keeps the basis orthogonal to round-off


class _Builder:
    def __init__(self, problem: SCProblem):
        self.p = problem
        self.coupling = problem.coupling
        self.dim = problem.in_dim
        self.sym = _Symmetriser(self.dim)
        self.nodes: list[Node] = []
        self.node_ids: dict[tuple, int] = {}
        self.potential: dict[tuple, np.ndarray] = {}  # tensors of nodes made or considered
        self.groups: dict[tuple, dict] = {}  # (o, left_l, left_p, input) -> {"cg": ..., "terms": [...]}
        self.linear: dict[int, list[Linear]] = {}
        inputs = []
        for i, off in enumerate(problem.coupling_offsets):
            e = np.zeros((self.coupling[i].dim, self.dim))
            e[:, off:off + self.coupling[i].dim] = np.eye(self.coupling[i].dim)
            inputs.append(e)
        self.inputs = inputs

    # candidate left operands of degree `deg`: ("x", i) or a potential node key
    def left_candidates(self, deg: int, monotone: bool) -> list:
        if deg == 1:
            return [("x", i) for i in range(len(self.coupling))]
        out = []
        for left in self.left_candidates(deg - 1, monotone):
            ll, lp, last = self._irrep_of(left) + (self._last_input(left),)
            first = range(last, len(self.coupling)) if (deg == 2 or monotone) else range(len(self.coupling))
            for i in first:
                ir = self.coupling[i]
                for ir_out in o3.Irrep(ll, lp) * ir:
                    out.append(("n", left, i, ir_out.l, ir_out.p))
        return out

    def _irrep_of(self, ref) -> tuple[int, int]:
        if ref[0] == "x":
            ir = self.coupling[ref[1]]
            return ir.l, ir.p
        return ref[3], ref[4]

    def _last_input(self, ref) -> int:
        return ref[1] if ref[0] == "x" else ref[2]

    def tensor(self, ref) -> np.ndarray:
        """[d, D**deg] tensor of a left operand (building potential nodes' tensors on the way)."""
        if ref[0] == "x":
            return self.inputs[ref[1]]
        if ref not in self.potential:
            self.potential[ref] = self._couple(self.tensor(ref[1]), self._irrep_of(ref[1])[0], ref[2], ref[3])
        return self.potential[ref]

    def _couple(self, left: np.ndarray, l_left: int, i: int, l_out: int) -> np.ndarray:
        cg = np.zeros((2 * l_left + 1, self.coupling[i].dim, 2 * l_out + 1))
        for a, b, c, v in sparse_cg(l_left, self.coupling[i].l, l_out):
            cg[a, b, c] = v
        t = np.einsum("abc,ax,by->cxy", cg, left, self.inputs[i])
        return t.reshape(2 * l_out + 1, -1)

    def node_cost(self, ref) -> int:
        if ref[0] == "x" or ref in self.node_ids:
            return 0
        l_left = self._irrep_of(ref[1])[0]
        return self.node_cost(ref[1]) + _coupling_cost(sparse_cg(l_left, self.coupling[ref[2]].l, ref[3]))

    def make(self, ref) -> Ref:
        if ref[0] == "x":
            return Ref("x", ref[1])
        if ref not in self.node_ids:
            left = self.make(ref[1])
            l_left = self._irrep_of(ref[1])[0]
            degree = 2 if left.kind == "x" else self.nodes[left.index].degree + 1
            self.nodes.append(Node(left, ref[2], ref[3], ref[4], degree,
                                   sparse_cg(l_left, self.coupling[ref[2]].l, ref[3])))
            self.node_ids[ref] = len(self.nodes) - 1
        return Ref("n", self.node_ids[ref])

    def choose(self, o: int, nu: int, slot0: int) -> tuple[list, np.ndarray]:
        """Pick the basis of output o at degree nu; returns (chosen candidates, A [R, K])."""
        ir_out = self.p.outputs[o]
        u = self.p.u[o][nu - 1]
        k = u.shape[-1]
        target = np.stack([self.sym.vector(u[..., j], nu) for j in range(k)], axis=1)
        # scale of the unsymmetrised columns: antisymmetric couplings symmetrise to round-off, not to 0
        scale = max(float(np.abs(u).max()), 1e-300) * np.sqrt(target.shape[0])
        rounded = np.array_equal(u, u.astype(np.float32).astype(np.float64))
        tol = _FP32_TOL if rounded else 0.0
        q_target = _orthonormal_columns(target, scale * (tol if rounded else 1e-10))
        rank = q_target.shape[1]
        candidates = []  # (description, symmetrised vector, norm before symmetrising)
        if rank > 0:
            if nu == 1:
                for i, ir in enumerate(self.coupling):
                    if ir == ir_out:
                        candidates.append((("lin", i), self.sym.vector(self.inputs[i], 1), 1.0))
            else:
                for left in self.left_candidates(nu - 1, monotone=nu >= 4):
                    ll, lp = self._irrep_of(left)
                    for i, ir in enumerate(self.coupling):
                        if nu >= 4 and i < self._last_input(left):
                            continue
                        if _couples(ll, lp, ir.l, ir.p, ir_out.l, ir_out.p):
                            t = self._couple(self.tensor(left), ll, i, ir_out.l)
                            candidates.append((("chain", left, i), self.sym.vector(t, nu), np.linalg.norm(t)))
        chosen: list = []
        q_sel = np.zeros((target.shape[0], 0))
        admissible = []
        for cand, v, raw_norm in candidates:
            norm = np.linalg.norm(v)
            if norm > 1e-9 * raw_norm and np.linalg.norm(_residual(v, q_target)) <= max(_IN_SPAN, tol) * norm:
                admissible.append((cand, v / norm))
        while len(chosen) < rank:
            best = None
            for threshold in _NEW_DIRECTION:
                for order, (cand, v) in enumerate(admissible):
                    new = np.linalg.norm(_residual(v, q_sel))
                    if new <= threshold:
                        continue
                    key = (self._cost(o, cand), -new, order)
                    if best is None or key < best[0]:
                        best = (key, cand, v)
                if best is not None:
                    break
            if best is None:
                raise RuntimeError(f"could not find a basis for output {ir_out} at degree {nu}: "
                                   f"{len(chosen)} of {rank} directions")
            _, cand, v = best
            r = _residual(v, q_sel)
            q_sel = np.concatenate([q_sel, (r / np.linalg.norm(r))[:, None]], axis=1)
            chosen.append((cand, v))
            self._commit(o, cand, slot0 + len(chosen) - 1)
        if rank == 0:
            return [], np.zeros((0, k))
        basis = np.stack([self._vector_of(o, nu, cand) for cand, _ in chosen], axis=1)
        a, *_ = np.linalg.lstsq(basis, target, rcond=None)
        misfit = np.linalg.norm(basis @ a - target) / max(np.linalg.norm(target), 1e-300)
        if misfit > max(tol, _FIT_TOL):
            raise RuntimeError(f"basis of output {ir_out} at degree {nu} misfits MACE's U by {misfit:.2e}")
        return chosen, a

    def _vector_of(self, o: int, nu: int, cand) -> np.ndarray:
        if cand[0] == "lin":
            return self.sym.vector(self.inputs[cand[1]], 1)
        _, left, i = cand
        ll, _ = self._irrep_of(left)
        return self.sym.vector(self._couple(self.tensor(left), ll, i, self.p.outputs[o].l), nu)

    def _cost(self, o: int, cand) -> int:
        ir_out = self.p.outputs[o]
        if cand[0] == "lin":
            return ir_out.dim
        _, left, i = cand
        ll, lp = self._irrep_of(left)
        cost = self.node_cost(left) + 2 * ll + 2
        if (o, ll, lp, i) not in self.groups:
            cost += _coupling_cost(sparse_cg(ll, self.coupling[i].l, ir_out.l))
        return cost

    def _commit(self, o: int, cand, slot: int) -> None:
        ir_out = self.p.outputs[o]
        if cand[0] == "lin":
            self.linear.setdefault(o, []).append(Linear(slot, cand[1]))
            return
        _, left, i = cand
        ll, lp = self._irrep_of(left)
        ref = self.make(left)
        group = self.groups.setdefault((o, ll, lp, i), {"cg": sparse_cg(ll, self.coupling[i].l, ir_out.l), "terms": []})
        group["terms"].append(Term(slot, ref))


def build_sc_schedule(problem: SCProblem) -> SCSchedule:
    builder = _Builder(problem)
    transforms, slot, k0 = [], 0, 0
    for o in range(len(problem.outputs)):
        for nu in range(1, problem.correlation[o] + 1):
            chosen, a = builder.choose(o, nu, slot)
            transforms.append(Transform(o, nu, slot, k0, a))
            slot += len(chosen)
            k0 += problem.num_params(o, nu)
    outputs, offset = [], 0
    channels = problem.channels
    for o, ir in enumerate(problem.outputs):
        groups = tuple(Group(key[3], key[1], key[2], g["cg"], tuple(g["terms"]))
                       for key, g in builder.groups.items() if key[0] == o)
        outputs.append(OutputPlan(ir.l, ir.p, offset, tuple(builder.linear.get(o, [])), groups))
        offset += channels * ir.dim
    return SCSchedule(problem, tuple(builder.nodes), tuple(outputs), tuple(transforms), slot, k0)
