"""Safe arithmetic formulas over config fields.

A formula is a Python expression restricted to: names of config fields, numbers,
``True``/``False``/``None``, ``+ - * // / %``, comparisons (``is``/``is not`` only
against ``None``), ``and``/``or``/``not``, ``x if c else y``, ``min(...)`` and
``max(...)``. Attributes, other calls, subscripts, lambdas, comprehensions and names
starting with ``_`` are rejected when the formula is parsed. A formula is parsed
and compiled once; evaluation is a single `eval` of the checked code object with no
builtins.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["Formula", "FormulaError", "MAX_FORMULA_LENGTH", "evaluate_on"]

MAX_FORMULA_LENGTH = 500
_MAX_CONSTANT = 10**12
_FUNCTIONS: dict[str, Callable[..., Any]] = {"min": min, "max": max}
_BINOPS = (ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Div, ast.Mod)
_UNARY = (ast.UAdd, ast.USub, ast.Not)
_COMPARE = (ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.Is, ast.IsNot)


class FormulaError(ValueError):
    """A formula is not allowed, or could not be evaluated."""


class _Checker(ast.NodeVisitor):
    def __init__(self) -> None:
        self.names: set[str] = set()

    def generic_visit(self, node: ast.AST) -> None:
        raise FormulaError(f"{type(node).__name__} is not allowed in a formula")

    def visit_Expression(self, node: ast.Expression) -> None:
        self.visit(node.body)

    def visit_Constant(self, node: ast.Constant) -> None:
        value = node.value
        if value is None or isinstance(value, bool):
            return
        if not isinstance(value, (int, float)):
            raise FormulaError(f"constant {value!r} is not allowed (numbers, True, False, None only)")
        if abs(value) > _MAX_CONSTANT:
            raise FormulaError(f"constant {value!r} is too large")

    def visit_Name(self, node: ast.Name) -> None:
        if node.id.startswith("_"):
            raise FormulaError(f"name {node.id!r} is not allowed (names may not start with '_')")
        if node.id in _FUNCTIONS:
            raise FormulaError(f"{node.id!r} may only be called")
        self.names.add(node.id)

    def visit_BinOp(self, node: ast.BinOp) -> None:
        if not isinstance(node.op, _BINOPS):
            raise FormulaError(f"operator {type(node.op).__name__} is not allowed")
        self.visit(node.left)
        self.visit(node.right)

    def visit_UnaryOp(self, node: ast.UnaryOp) -> None:
        if not isinstance(node.op, _UNARY):
            raise FormulaError(f"operator {type(node.op).__name__} is not allowed")
        self.visit(node.operand)

    def visit_BoolOp(self, node: ast.BoolOp) -> None:
        for value in node.values:
            self.visit(value)

    def visit_Compare(self, node: ast.Compare) -> None:
        for op, right in zip(node.ops, node.comparators):
            if not isinstance(op, _COMPARE):
                raise FormulaError(f"comparison {type(op).__name__} is not allowed")
            if isinstance(op, (ast.Is, ast.IsNot)) and not (
                isinstance(right, ast.Constant) and right.value is None
            ):
                raise FormulaError("'is' / 'is not' may only compare with None")
        self.visit(node.left)
        for right in node.comparators:
            self.visit(right)

    def visit_IfExp(self, node: ast.IfExp) -> None:
        self.visit(node.test)
        self.visit(node.body)
        self.visit(node.orelse)

    def visit_Call(self, node: ast.Call) -> None:
        if not (isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS):
            raise FormulaError("only min(...) and max(...) may be called")
        if node.keywords or not node.args or any(isinstance(a, ast.Starred) for a in node.args):
            raise FormulaError(f"{node.func.id}() takes plain positional arguments")
        for arg in node.args:
            self.visit(arg)


class Formula:
    """A checked, compiled formula. Construct with the expression text."""

    __slots__ = ("_code", "names", "source")

    def __init__(self, source: str) -> None:
        if not isinstance(source, str):
            raise FormulaError("a formula must be a string")
        text = " ".join(source.split())
        if not text:
            raise FormulaError("empty formula")
        if len(text) > MAX_FORMULA_LENGTH:
            raise FormulaError(f"formula longer than {MAX_FORMULA_LENGTH} characters")
        try:
            tree = ast.parse(text, mode="eval")
        except SyntaxError as exc:
            raise FormulaError(f"not a valid expression: {exc.msg}") from None
        checker = _Checker()
        checker.visit(tree)
        self.source = text
        self.names: frozenset[str] = frozenset(checker.names)
        self._code = compile(tree, "<formula>", "eval")

    def evaluate(self, values: Mapping[str, Any]) -> Any:
        """Evaluate with ``values`` bound to the names (missing names raise)."""
        missing = self.names.difference(values)
        if missing:
            raise FormulaError(f"formula {self.source!r} needs {', '.join(sorted(missing))}")
        scope = {"__builtins__": {}, **_FUNCTIONS}
        try:
            return eval(self._code, scope, dict(values))
        except ArithmeticError as exc:
            raise FormulaError(f"formula {self.source!r} failed with {self._show(values)}: {exc}") from None
        except TypeError as exc:
            raise FormulaError(f"formula {self.source!r} failed with {self._show(values)}: {exc}") from None

    def evaluate_on(self, obj: object) -> Any:
        """Evaluate with each name read as an attribute of ``obj`` (a config)."""
        values = {}
        for name in self.names:
            try:
                values[name] = getattr(obj, name)
            except AttributeError:
                raise FormulaError(
                    f"formula {self.source!r} uses {name!r}, which {type(obj).__name__} does not have"
                ) from None
        return self.evaluate(values)

    def values_on(self, obj: object) -> dict[str, Any]:
        """The values the formula reads from ``obj`` (for error messages)."""
        return {name: getattr(obj, name, "<missing>") for name in sorted(self.names)}

    def _show(self, values: Mapping[str, Any]) -> str:
        return ", ".join(f"{k}={values[k]!r}" for k in sorted(self.names))

    def __repr__(self) -> str:
        return f"Formula({self.source!r})"

    def __str__(self) -> str:
        return self.source

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Formula) and other.source == self.source

    def __hash__(self) -> int:
        return hash(self.source)


def evaluate_on(value: int | Formula, obj: object) -> Any:
    """An integer as it is, or a formula evaluated on ``obj`` (an ``int | Formula`` family field)."""
    return value.evaluate_on(obj) if isinstance(value, Formula) else value
