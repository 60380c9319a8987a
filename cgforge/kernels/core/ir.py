"""The statement IR of every generated kernel, its CPU evaluator and its C printer.

A statement is ``dst (=|+=) sum_t coef_t * a_t [* b_t]`` on named scalars (``coef`` a literal or None for 1).
The templates print the statements (``c_lines``) and the CPU evaluators run the same ones (``run``), so CI tests
every generated kernel's arithmetic without a GPU.
"""

from __future__ import annotations

from collections.abc import Iterable, MutableMapping
from dataclasses import dataclass
from typing import Any

import numpy as np

# A group of statements printed on one line, in braces when it has more than one: its temporaries are
# scoped to it (a CG coefficient times an adjoint, used by two multiply-adds).
Group = tuple["Statement", ...]


@dataclass(frozen=True)
class Statement:
    dst: str
    accumulate: bool
    terms: tuple[tuple[float | None, str, str | None], ...]  # (coef or None, a, b or None)

    @property
    def multiply_adds(self) -> int:
        return len(self.terms)


@dataclass(frozen=True)
class Program:
    """Straight-line statements with their inputs and outputs (variables never assigned are zero)."""

    statements: tuple[Statement, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    external: tuple[str, ...] = ()  # accumulators declared (and zeroed) outside the statements

    def assigned(self) -> set[str]:
        return {s.dst for s in self.statements}

    def multiply_adds(self) -> int:
        return sum(len(s.terms) for s in self.statements)


def run(statements: Iterable[Statement], values: MutableMapping[str, Any]) -> None:
    """Execute statements in order on `values` (name -> tensor or array), in place."""
    for s in statements:
        total = values[s.dst] if s.accumulate else 0.0
        for coef, a, b in s.terms:
            t = values[a] if b is None else values[a] * values[b]
            total = total + (t if coef is None else coef * t)
        values[s.dst] = total


def evaluate(program: Program, env: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run a program on arrays (one entry per row); returns the program's outputs."""
    values = dict(env)
    missing = [n for n in program.inputs + program.external if n not in values]
    if missing:
        raise KeyError(f"evaluate: inputs missing: {missing[:5]}")
    shape = np.shape(next(iter(env.values()))) if env else ()
    run(program.statements, values)
    return {n: np.broadcast_to(values.get(n, 0.0), shape).copy() for n in program.outputs}


def literal(scalar: str, v: float) -> str:
    """A C literal that round-trips `v` in the kernel's scalar type."""
    if scalar == "float":
        return f"{v:.9e}f"
    if scalar == "double":
        return f"{v:.17e}"
    raise ValueError(f"scalar must be 'float' or 'double', got {scalar!r}")


def c_statement(s: Statement, scalar: str, declared: set[str], const_prefixes: tuple[str, ...]) -> str:
    """One C statement; a first assignment of an undeclared name declares it (`const` by prefix)."""
    parts = []
    for coef, a, b in s.terms:
        factors = ([literal(scalar, coef)] if coef is not None else []) + [a] + ([b] if b else [])
        parts.append(" * ".join(factors))
    expr = " + ".join(parts)
    if s.accumulate:
        return f"{s.dst} += {expr};"
    if s.dst in declared:
        return f"{s.dst} = {expr};"
    declared.add(s.dst)
    const = "const " if s.dst.startswith(const_prefixes) else ""
    return f"{const}scalar_t {s.dst} = {expr};"


def c_lines(statements: Iterable[Statement], scalar: str, declared: Iterable[str] = (),
            const_prefixes: tuple[str, ...] = ("t",)) -> list[str]:
    """One C line per statement, declaring names on their first assignment."""
    seen = set(declared)
    return [c_statement(s, scalar, seen, const_prefixes) for s in statements]


def c_group(group: Group, scalar: str, const_prefixes: tuple[str, ...] = ("cg",)) -> str:
    """A group on one line: braced (its own scope) when it has more than one statement."""
    lines = c_lines(group, scalar, const_prefixes=const_prefixes)
    return lines[0] if len(lines) == 1 else "{ " + " ".join(lines) + " }"
