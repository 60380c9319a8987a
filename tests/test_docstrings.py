"""Docstrings and comments define; measured numbers live in docs/measured-constants.md and docs/performance.md.

Tokenizes every module of the package (no import): its docstrings and other bare string statements, its ``#``
comments, and the ``//`` comments of generated CUDA source in string literals. None may name a device, carry an
ISO date, or carry a timing (a number with a time unit, a rate, or a speed-up).
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "cgforge"

_NUMBER = r"\d[\d,.]*\s?"
OFFENCES = {
    "a device": r"\b(?:[ABHLV]100|H200|GH200|B200|A6000|RTX\s?\d+|MI[123]\d0X?)\b",
    "a date": r"\b20\d\d-[01]\d-[0-3]\d\b",
    "a timing": rf"{_NUMBER}(?:ms|us|µs|ns)\b|(?:\d+\.\d+|\d{{2,}}) s\b|"
                rf"{_NUMBER}(?:ns/day|steps?/s|atoms?/s|[GMT]B/s|[GT]FLOP/s)|{_NUMBER}x (?:faster|slower)\b",
}
_PATTERN = re.compile("|".join(f"(?P<g{i}>{p})" for i, p in enumerate(OFFENCES.values())))


def _texts(path: Path) -> list[tuple[int, str]]:
    """(line, text) of each docstring / bare string line, ``#`` comment and ``//`` comment in a string."""
    out: list[tuple[int, str]] = []
    statement_start = True  # the next token begins a statement: a string there is a docstring or a bare string
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string))
        elif tok.type == tokenize.STRING:
            lines = tok.string.splitlines()
            if statement_start:
                out += [(tok.start[0] + i, line) for i, line in enumerate(lines)]
            else:  # CUDA source: its // comments only (not URLs)
                out += [(tok.start[0] + i, m.group(1)) for i, line in enumerate(lines)
                        for m in [re.search(r"(?<!:)//(.*)", line)] if m]
        if tok.type not in (tokenize.NL, tokenize.COMMENT):
            statement_start = tok.type in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
    return out


def offences(path: Path) -> list[str]:
    found = []
    for line, text in _texts(path):
        for match in _PATTERN.finditer(text):
            kind = list(OFFENCES)[int(match.lastgroup[1:])]
            found.append(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{line}: {kind} "
                         f"({match.group(0).strip()!r})")
    return found


def test_no_measurement_in_docstrings_or_comments():
    found = [o for path in sorted(PACKAGE.rglob("*.py")) for o in offences(path)]
    assert not found, ("docstrings and comments define; move each number with its device and date to "
                       "docs/measured-constants.md:\n" + "\n".join(found))


def test_the_pattern_flags_measurements_and_spares_definitions(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('"""Took 1.5 ms on an H100."""\n\n'
                   "X = 1  # measured 2026-11-29: 30 us, 12 ns/day, 2.3x faster\n"
                   "SRC = '''\n// 40 ms a step\nint i;'''\n")
    kinds = [o.split(": ", 1)[1].split(" (")[0] for o in offences(bad)]
    assert kinds == ["a timing", "a device", "a date", "a timing", "a timing", "a timing", "a timing"]
    good = tmp_path / "good.py"
    good.write_text('"""timestep_fs: the step in fs; times in ms, items of 8 KiB, error (n) / (2 s); https://x.org/a."""\n\n'
                    "def f(items):  # atoms and terms\n    return 'took 3 ms'\n")
    assert offences(good) == []
