"""Bugs injected by AST mutation: one small change in one function, as a human slip would be.

Each mutation flips one site of a function: an arithmetic operator (`+`/`-`, `*`/`//`), a
comparison (`<` and `<=`, `==` and `!=`, ...), a boolean operator (`and`/`or`), an integer
constant (off by one) or a `not` dropped. The mutated function is unparsed and spliced back over
the original's lines, so the rest of the file (comments included) is untouched.
"""

from __future__ import annotations

import ast
import copy
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass

_SWAP_BIN: dict[type[ast.operator], type[ast.operator]] = {
    ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.FloorDiv, ast.FloorDiv: ast.Mult, ast.Div: ast.Mult,
    ast.Mod: ast.FloorDiv,
}  # fmt: skip
_SWAP_CMP: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
}  # fmt: skip


@dataclass(frozen=True)
class Mutation:
    """One injected bug: the function, what changed, and the whole mutated file."""

    function: str
    description: str
    source: str


def _sites(function: ast.AST) -> Iterator[tuple[ast.AST, str]]:
    """Every node of `function` a mutation can flip, with what the flip does."""
    for node in ast.walk(function):
        match node:
            case ast.BinOp(op=op) if type(op) in _SWAP_BIN:
                yield node, f"{type(op).__name__} -> {_SWAP_BIN[type(op)].__name__}"
            case ast.Compare(ops=[op]) if type(op) in _SWAP_CMP:
                yield node, f"{type(op).__name__} -> {_SWAP_CMP[type(op)].__name__}"
            case ast.BoolOp(op=op):
                yield node, f"{type(op).__name__} -> {'Or' if isinstance(op, ast.And) else 'And'}"
            case ast.Constant(value=int() as value) if not isinstance(value, bool):
                yield node, f"constant {value} -> {value + 1}"
            case ast.UnaryOp(op=ast.Not()):
                yield node, "not dropped"


def _flip(node: ast.AST) -> ast.AST:
    match node:
        case ast.BinOp(op=op):
            node.op = _SWAP_BIN[type(op)]()
        case ast.Compare(ops=[op]):
            node.ops = [_SWAP_CMP[type(op)]()]
        case ast.BoolOp(op=op):
            node.op = ast.Or() if isinstance(op, ast.And) else ast.And()
        case ast.Constant(value=int() as value):
            node.value = value + 1
        case ast.UnaryOp(operand=operand):
            return operand
    return node


class _Replace(ast.NodeTransformer):
    def __init__(self, target: ast.AST) -> None:
        self.target = target

    def generic_visit(self, node: ast.AST) -> ast.AST:
        if node is self.target:
            return _flip(node)
        return super().generic_visit(node)


def functions(tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef]]:
    """Top-level functions and methods of classes, with their qualified names."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            yield node.name, node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    yield f"{node.name}.{item.name}", item


def mutations(source: str, covered: set[str]) -> Iterator[Mutation]:
    """Every single-site mutation of the functions whose (last) name is in `covered`."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    for name, function in functions(tree):
        if name.split(".")[-1] not in covered or function.end_lineno is None:
            continue
        start = function.decorator_list[0].lineno if function.decorator_list else function.lineno
        indent = " " * function.col_offset
        body = ast.get_docstring(function)
        for index, (_, description) in enumerate(_sites(function)):
            clone = copy.deepcopy(function)
            target = [node for node, _ in _sites(clone)][index]
            if body is not None and isinstance(target, ast.Constant) and target.value == body:
                continue
            mutated = ast.fix_missing_locations(_Replace(target).visit(clone))
            text = textwrap.indent(ast.unparse(mutated), indent) + "\n"
            new = "".join(lines[: start - 1]) + text + "".join(lines[function.end_lineno :])
            if new != source:
                yield Mutation(function=name, description=description, source=new)
