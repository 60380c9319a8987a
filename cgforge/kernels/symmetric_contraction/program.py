"""The symmetric contraction as straight-line statements (core.ir) for one (atom, channel).

Inputs ``x{k}``, ``w{r}`` (transformed weights), ``g{o}_{M}`` (grad out); results ``o{o}_{M}``, ``gx{k}``,
``gw{r}``. The backward is written per node and group, not as a reverse of the forward statements: nodes and Zs
are recomputed and node adjoints pushed back in reverse order, so few values stay alive.
"""

from __future__ import annotations

from ..core.ir import Program, Statement
from ..core.tuning import SCTuning
from .schedule import Ref, SCSchedule


class _Writer:
    def __init__(self, pairings: tuple[str, ...], external: tuple[str, ...] = ()):
        self.pairings = pairings
        self.statements: list[Statement] = []
        self.live: set[str] = set(external)
        self._products: dict[tuple[str, str], str] = {}
        self._count = 0

    def add(self, dst: str, coef: float | None, a: str, b: str | None = None) -> None:
        """dst += coef * a * b, skipping operands that are structurally zero (never assigned)."""
        if a not in self.live or (b is not None and b not in self.live):
            return
        self.statements.append(Statement(dst, dst in self.live, ((coef, a, b),)))
        self.live.add(dst)

    def product(self, a: str, b: str) -> str | None:
        """A temporary a * b, made once per (a, b) within the current scope."""
        if a not in self.live or b not in self.live:
            return None
        key = (a, b)
        if key not in self._products:
            name = f"t{self._count}"
            self._count += 1
            self.statements.append(Statement(name, False, ((None, a, b),)))
            self.live.add(name)
            self._products[key] = name
        return self._products[key]

    def temp(self) -> str:
        """A fresh accumulator (declared by its first assignment)."""
        name = f"y{self._count}"
        self._count += 1
        return name

    def new_scope(self) -> None:
        self._products = {}  # products go out of scope: keeps register lifetimes short


def _ref_var(schedule: SCSchedule, ref: Ref, m: int, grad: bool = False) -> str:
    if ref.kind == "x":
        k = schedule.problem.coupling_offsets[ref.index] + m
        return f"gx{k}" if grad else f"x{k}"
    return f"{'gn' if grad else 'n'}{ref.index}_{m}"


def _x(schedule: SCSchedule, i: int, m: int, grad: bool = False) -> str:
    return _ref_var(schedule, Ref("x", i), m, grad)


def _bilinear(w: _Writer, terms: list[tuple[str, str, str, float]]) -> None:
    """dst += v * p * q for every (p, q, dst, v), sharing partial results the cheapest way: one product per distinct
    (p, q), or a partial sum per distinct (p, dst) or (q, dst); each costs the terms plus the distinct pairs, so the
    rarest pairing wins."""
    terms = [t for t in terms if t[0] in w.live and t[1] in w.live]
    if not terms:
        return
    distinct = {"pq": len({(p, q) for p, q, _, _ in terms}), "pd": len({(p, d) for p, _, d, _ in terms}),
                "qd": len({(q, d) for _, q, d, _ in terms})}
    mode = min(w.pairings, key=lambda m: distinct[m])
    if mode == "pq":
        for p, q, d, v in terms:
            w.add(d, v, w.product(p, q))
        return
    groups: dict[tuple[str, str], list[tuple[str, float]]] = {}
    for p, q, d, v in terms:
        outer, inner = (p, q) if mode == "pd" else (q, p)
        groups.setdefault((outer, d), []).append((inner, v))
    for (outer, d), items in groups.items():
        y = w.temp()
        for inner, v in items:
            w.add(y, v, inner)
        w.add(d, None, outer, y)


def _couple(w: _Writer, cg, left, right, dst) -> None:
    """dst(mo) += sum v * left(ma) * right(mb) over cg entries (ma, mb, mo, v)."""
    _bilinear(w, [(left(a), right(b), dst(mo), v) for a, b, mo, v in cg])


def _emit_nodes(schedule: SCSchedule, w: _Writer) -> None:
    for j, node in enumerate(schedule.nodes):
        w.new_scope()
        _couple(w, node.cg, lambda a, n=node: _ref_var(schedule, n.left, a),
                lambda b, n=node: _x(schedule, n.input, b), lambda mo, j=j: f"n{j}_{mo}")


def _inputs(schedule: SCSchedule, grads: bool) -> tuple[str, ...]:
    p = schedule.problem
    names = [f"x{k}" for k in range(p.in_dim)] + [f"w{r}" for r in range(schedule.num_slots)]
    if grads:
        names += [f"g{o}_{m}" for o, out in enumerate(schedule.outputs) for m in range(out.dim)]
    return tuple(names)


def forward_program(schedule: SCSchedule, tuning: SCTuning | None = None) -> Program:
    inputs = _inputs(schedule, grads=False)
    w = _Writer((tuning or SCTuning()).pairings)
    w.live.update(inputs)
    _emit_nodes(schedule, w)
    outputs = []
    for o, out in enumerate(schedule.outputs):
        w.new_scope()
        for lin in out.linear:
            for m in range(out.dim):
                w.add(f"o{o}_{m}", None, f"w{lin.slot}", _x(schedule, lin.input, m))
        for gi, group in enumerate(out.groups):
            w.new_scope()
            z = lambda a, o=o, gi=gi: f"z{o}_{gi}_{a}"
            for term in group.terms:
                for a in range(2 * group.left_l + 1):
                    w.add(z(a), None, f"w{term.slot}", _ref_var(schedule, term.left, a))
            _couple(w, group.cg, z, lambda b, g=group: _x(schedule, g.input, b), lambda mo, o=o: f"o{o}_{mo}")
        outputs += [f"o{o}_{m}" for m in range(out.dim)]
    return Program(tuple(w.statements), inputs, tuple(outputs))


def backward_program(schedule: SCSchedule, grad_weights: bool, external_gw: bool = False,
                     tuning: SCTuning | None = None) -> Program:
    """grad x (and grad W' if asked) of sum_o <g_o, out_o>; gw accumulators may live outside (per species)."""
    p = schedule.problem
    inputs = _inputs(schedule, grads=True)
    external = tuple(f"gw{r}" for r in range(schedule.num_slots)) if (grad_weights and external_gw) else ()
    w = _Writer((tuning or SCTuning()).pairings, external)
    w.live.update(inputs)
    _emit_nodes(schedule, w)

    def gw(slot: int) -> str | None:
        return f"gw{slot}" if grad_weights else None

    for o, out in enumerate(schedule.outputs):
        g = lambda m, o=o: f"g{o}_{m}"
        w.new_scope()
        for lin in out.linear:
            for m in range(out.dim):
                w.add(_x(schedule, lin.input, m, grad=True), None, f"w{lin.slot}", g(m))
                if gw(lin.slot):
                    w.add(gw(lin.slot), None, _x(schedule, lin.input, m), g(m))
        for gi, group in enumerate(out.groups):
            w.new_scope()
            z = lambda a, o=o, gi=gi: f"z{o}_{gi}_{a}"
            gz = lambda a, o=o, gi=gi: f"gz{o}_{gi}_{a}"
            for term in group.terms:
                for a in range(2 * group.left_l + 1):
                    w.add(z(a), None, f"w{term.slot}", _ref_var(schedule, term.left, a))
            # out(mo) += v z(a) x(b):  gz(a) += v x(b) g(mo);  gx(b) += v z(a) g(mo)
            _bilinear(w, [(_x(schedule, group.input, b), g(mo), gz(a), v) for a, b, mo, v in group.cg])
            _bilinear(w, [(z(a), g(mo), _x(schedule, group.input, b, grad=True), v) for a, b, mo, v in group.cg])
            for term in group.terms:
                for a in range(2 * group.left_l + 1):
                    w.add(_ref_var(schedule, term.left, a, grad=True), None, f"w{term.slot}", gz(a))
                    if gw(term.slot):
                        w.add(gw(term.slot), None, _ref_var(schedule, term.left, a), gz(a))
    for j in reversed(range(len(schedule.nodes))):
        node = schedule.nodes[j]
        w.new_scope()
        gn = lambda mo, j=j: f"gn{j}_{mo}"
        # n(mo) += v left(a) x(b):  gleft(a) += v x(b) gn(mo);  gx(b) += v left(a) gn(mo)
        _bilinear(w, [(_x(schedule, node.input, b), gn(mo), _ref_var(schedule, node.left, a, grad=True), v)
                      for a, b, mo, v in node.cg])
        _bilinear(w, [(_ref_var(schedule, node.left, a), gn(mo), _x(schedule, node.input, b, grad=True), v)
                      for a, b, mo, v in node.cg])
    outputs = [f"gx{k}" for k in range(p.in_dim)]
    if grad_weights:
        outputs += [f"gw{r}" for r in range(schedule.num_slots)]
    return Program(tuple(w.statements), inputs, tuple(outputs), external)


