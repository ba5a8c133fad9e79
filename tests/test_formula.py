"""The safe formula evaluator."""

from __future__ import annotations

import pytest

from distconf.loader.formula import Formula, FormulaError


@pytest.mark.parametrize("source,values,expected", [
    ("a // b", {"a": 64, "b": 8}, 8),
    ("a / b", {"a": 3, "b": 2}, 1.5),
    ("a % 5 + -b * 2", {"a": 12, "b": 1}, 0),
    ("max(1, a // b)", {"a": 1, "b": 8}, 1),
    ("min(a, b, 3)", {"a": 5, "b": 4}, 3),
    ("a // b if n else a if m else 1", {"a": 8, "b": 2, "n": False, "m": True}, 8),
    ("x if x is not None else h // n", {"x": None, "h": 64, "n": 4}, 16),
    ("not a and b or c", {"a": False, "b": False, "c": 7}, 7),
    ("1 < a <= 3", {"a": 3}, True),
])
def test_evaluates(source, values, expected) -> None:
    assert Formula(source).evaluate(values) == expected


@pytest.mark.parametrize("source", [
    "a.b", "a[0]", "f(a)", "lambda: 1", "[x for x in a]", "__import__('os')", "_private", "a ** 2",
    "'text'", "a if b is 3 else c", "min(*a)", "max(a=1)", "{}", "(a := 1)", "a << 1", "1e400 * 1e400",
    "", "   ", "x" * 600, "min",
])
def test_rejects(source) -> None:
    with pytest.raises(FormulaError):
        Formula(source)


def test_names_and_errors() -> None:
    f = Formula("num_attention_heads // num_key_value_heads")
    assert f.names == {"num_attention_heads", "num_key_value_heads"}
    with pytest.raises(FormulaError, match="needs num_key_value_heads"):
        f.evaluate({"num_attention_heads": 4})
    with pytest.raises(FormulaError, match="num_key_value_heads=0"):
        f.evaluate({"num_attention_heads": 4, "num_key_value_heads": 0})


def test_no_builtins_reachable() -> None:
    # A name is only ever a config value: builtins such as open are not in scope.
    assert Formula("open").evaluate({"open": 3}) == 3
    with pytest.raises(FormulaError, match="needs open"):
        Formula("open").evaluate({})


def test_evaluate_on_object() -> None:
    class Cfg:
        h = 8
        k = 2

    assert Formula("h // k").evaluate_on(Cfg()) == 4
    with pytest.raises(FormulaError, match="does not have"):
        Formula("h // missing").evaluate_on(Cfg())
