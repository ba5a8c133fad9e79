"""Safe arithmetic formulas over config fields.

A formula is a Python expression restricted to: names of config fields, numbers,
``True``/``False``/``None``, ``+ - * // / %``, comparisons (``is``/``is not`` only
against ``None``), ``and``/``or``/``not``, ``x if c else y``, ``min(...)``,
``max(...)`` and ``int(x)`` (towards zero, as in ``int(hidden_size * qk_dim_factor) //
num_heads``). Attributes, other calls, subscripts, lambdas, comprehensions, names starting
with ``_`` and nesting deeper than `MAX_FORMULA_DEPTH` are rejected when the formula is parsed.
A formula is parsed and compiled once; evaluation is a single `eval` of the checked code object
with no builtins.

Operands are numbers only: every operand of arithmetic, ordering comparisons and
``min``/``max``/``int`` is checked at evaluation (an int of at most `MAX_OPERAND` in size, a
float or a bool), so a name bound to a string or list (``architectures * 100000000``)
is an error, not a gigabyte-sized value. A formula that is a single name returns that
field's value as it is; ``==``, ``!=``, ``is None``, ``not``, ``and``/``or`` and
``x if c else y`` work on any value. Values quoted in errors are short excerpts.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Mapping
from typing import Any

from distconf.errors import ConfigValueError, excerpt
from distconf.loader.per_layer import global_read_problem

__all__ = ["Formula", "FormulaError", "MAX_FORMULA_LENGTH", "MAX_FORMULA_DEPTH", "MAX_OPERAND", "evaluate_on",
           "count_on"]

MAX_FORMULA_LENGTH = 500
MAX_FORMULA_DEPTH = 32
"""Deepest allowed nesting of a formula's expression tree (``-(-(-x))`` is 3 levels)."""
MAX_OPERAND = 1 << 63
"""Largest magnitude of an integer operand (or intermediate result) of a formula."""
_MAX_CONSTANT = 10**12
_GUARD = "_operand"
_FUNCTIONS: dict[str, Callable[..., Any]] = {"min": min, "max": max, "int": int}
_BINOPS = (ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Div, ast.Mod)
_UNARY = (ast.UAdd, ast.USub, ast.Not)
_COMPARE = (ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.Is, ast.IsNot)


class FormulaError(ValueError):
    """A formula is not allowed, or could not be evaluated."""


class _NotANumber(Exception):
    """An operand of a formula is not a number (raised by the operand guard, reported by `Formula`)."""


def _operand(value: Any) -> Any:
    """The guard wrapped around every operand: numbers (and bools) only, integers bounded."""
    if isinstance(value, bool) or isinstance(value, float):
        return value
    if isinstance(value, int):
        if -MAX_OPERAND <= value <= MAX_OPERAND:
            return value
        raise _NotANumber("an integer operand is beyond ±2**63")
    raise _NotANumber(f"an operand is {_kind(value)}, not a number")


def _kind(value: Any) -> str:
    return "None" if value is None else f"a {type(value).__name__}"


def _check_depth(tree: ast.AST) -> None:
    """Reject trees nested deeper than `MAX_FORMULA_DEPTH` (checked without recursion)."""
    stack = [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (ast.expr_context, ast.operator, ast.unaryop, ast.cmpop, ast.boolop)):
            continue
        if depth > MAX_FORMULA_DEPTH:
            raise FormulaError(f"formula nested deeper than {MAX_FORMULA_DEPTH} levels")
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))


class _GuardOperands(ast.NodeTransformer):
    """Wrap each arithmetic / ordering / min-max operand in the numeric guard."""

    @staticmethod
    def _wrap(node: ast.expr) -> ast.expr:
        return ast.Call(func=ast.Name(id=_GUARD, ctx=ast.Load()), args=[node], keywords=[])

    def visit_BinOp(self, node: ast.BinOp) -> ast.AST:
        self.generic_visit(node)
        node.left, node.right = self._wrap(node.left), self._wrap(node.right)
        return node

    def visit_UnaryOp(self, node: ast.UnaryOp) -> ast.AST:
        self.generic_visit(node)
        if not isinstance(node.op, ast.Not):
            node.operand = self._wrap(node.operand)
        return node

    def visit_Compare(self, node: ast.Compare) -> ast.AST:
        self.generic_visit(node)
        if any(isinstance(op, (ast.Lt, ast.LtE, ast.Gt, ast.GtE)) for op in node.ops):
            node.left = self._wrap(node.left)
            node.comparators = [self._wrap(c) for c in node.comparators]
        return node

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        node.args = [self._wrap(a) for a in node.args]
        return node


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
        if not abs(value) <= _MAX_CONSTANT:
            raise FormulaError(f"constant {excerpt(value)} is too large (at most {_MAX_CONSTANT})")

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
            raise FormulaError("only min(...), max(...) and int(...) may be called")
        if node.keywords or not node.args or any(isinstance(a, ast.Starred) for a in node.args):
            raise FormulaError(f"{node.func.id}() takes plain positional arguments")
        if node.func.id == "int" and len(node.args) != 1:
            raise FormulaError("int() takes one argument")
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
        except (RecursionError, MemoryError):
            raise FormulaError(f"formula nested deeper than {MAX_FORMULA_DEPTH} levels") from None
        _check_depth(tree)
        checker = _Checker()
        checker.visit(tree)
        self.source = text
        self.names: frozenset[str] = frozenset(checker.names)
        guarded = ast.fix_missing_locations(_GuardOperands().visit(tree))
        self._code = compile(guarded, "<formula>", "eval")

    def evaluate(self, values: Mapping[str, Any]) -> Any:
        """Evaluate with ``values`` bound to the names (missing names raise)."""
        missing = self.names.difference(values)
        if missing:
            raise FormulaError(f"formula {self._quoted()} needs {', '.join(sorted(missing))}")
        scope = {"__builtins__": {}, _GUARD: _operand, **_FUNCTIONS}
        try:
            return eval(self._code, scope, {name: values[name] for name in self.names})
        except (ArithmeticError, TypeError, ValueError, _NotANumber) as exc:
            reason = str(exc) if len(str(exc)) <= 120 else str(exc)[:117] + "..."
            raise FormulaError(f"formula {self._quoted()} failed with {self._show(values)}: {reason}") from None

    def evaluate_on(self, obj: object) -> Any:
        """Evaluate with each name read as an attribute of ``obj`` (a config); a name a heterogeneous config holds
        per layer fails in one line (`distconf.loader.per_layer`: evaluate on the layer's own config instead)."""
        values = {}
        for name in self.names:
            try:
                values[name] = getattr(obj, name)
            except AttributeError:
                raise FormulaError(
                    f"formula {self._quoted()} uses {name!r}, which {type(obj).__name__} does not have"
                ) from None
            except RuntimeError:  # a heterogeneous config refuses a per-layer attribute read globally
                problem = global_read_problem(obj, name, f"formula {self._quoted()}")
                if problem is None:
                    raise
                raise FormulaError(problem) from None
        return self.evaluate(values)

    def values_on(self, obj: object) -> dict[str, Any]:
        """The values the formula reads from ``obj`` (for error messages)."""
        values = {}
        for name in sorted(self.names):
            try:
                values[name] = getattr(obj, name, "<missing>")
            except RuntimeError:  # a per-layer attribute of a heterogeneous config
                values[name] = "<per layer>"
        return values

    def _show(self, values: Mapping[str, Any]) -> str:
        return ", ".join(f"{k}={excerpt(values[k])}" for k in sorted(self.names))

    def _quoted(self) -> str:
        return excerpt(self.source, 100)

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


def count_on(config: Any, family: str, where: str, value: Any, minimum: int = 1) -> int:
    """``value`` (an integer or a `Formula`) on ``config`` as an integer of at least ``minimum``; a formula that
    does not evaluate, or a value that is no such integer, is one `ConfigValueError` naming ``family`` and the
    field ``where``."""
    written = value
    if isinstance(value, Formula):
        try:
            value = value.evaluate_on(config)
        except FormulaError as exc:
            raise ConfigValueError(f"family {family!r}: {where}: {exc}") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        wanted = {0: "a non-negative integer", 1: "a positive integer"}.get(minimum, f"an integer >= {minimum}")
        raise ConfigValueError(f"family {family!r}: {where} {excerpt(str(written))} gave {excerpt(value)}; "
                               f"expected {wanted}")
    return value
