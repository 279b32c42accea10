"""The size and format habits, enforced: in services, schemas and trainer no function is over 60
lines, no module over 450 code lines (blank lines and comments aside), and no `# fmt: skip`."""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("services", "schemas", "trainer")
MAX_FUNCTION_LINES = 60
MAX_MODULE_CODE_LINES = 450
SKIPPED = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}


def code_lines(source: str) -> int:
    """Lines holding at least one token that is not a comment or layout."""
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in SKIPPED:
            lines.update(range(token.start[0], token.end[0] + 1))
    return len(lines)


def long_functions(source: str) -> list[tuple[str, int]]:
    """(name, lines) of every function over the limit."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append((node.name, length))
    return found


def modules() -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py"))


def test_no_function_over_60_lines() -> None:
    over = [
        f"{p.relative_to(ROOT)}: {name} ({n} lines)" for p in modules() for name, n in long_functions(p.read_text())
    ]
    assert over == []


def test_no_module_over_450_code_lines() -> None:
    over = [
        f"{p.relative_to(ROOT)}: {n}" for p in modules() if (n := code_lines(p.read_text())) > MAX_MODULE_CODE_LINES
    ]
    assert over == []


def test_no_fmt_skip() -> None:
    marker = "fmt: " + "skip"
    assert [str(p.relative_to(ROOT)) for p in modules() if marker in p.read_text()] == []


@pytest.mark.parametrize(
    ("source", "functions", "lines"),
    [
        ("def f():\n" + "    x = 1\n" * 60, 1, 61),
        ("def f():\n" + "    x = 1\n" * 59, 0, 60),
        ("# a comment\n\nx = 1\n'''a\nstring'''\n", 0, 3),
    ],
)
def test_the_counts_themselves(source: str, functions: int, lines: int) -> None:
    assert len(long_functions(source)) == functions
    assert code_lines(source) == lines
