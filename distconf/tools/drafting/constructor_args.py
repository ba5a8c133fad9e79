"""Constructor arguments the model passes its layers, read from the source of the module that builds them.

A layer class may require an argument the config does not hold, which the model passes as a
constant when it builds its layer list (``Layer(config, layer_idx, use_flexible_linear=False)``),
or a config field passed on its own (``Layer(config.n_positions, config, scale=True)``). The
``__init__`` of the module holding the list shows them; each becomes a formula of
``block.constructor.extra`` (the constant, or the field's name).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any

__all__ = ["constant_arguments"]


def constant_arguments(owner: Any, layer_class: type, names: list[str]) -> dict[str, str]:
    """``{parameter: formula}`` of the constants and config fields ``type(owner).__init__`` passes ``layer_class``
    for ``names`` (the layer constructor's parameter names, in order; a positional one is matched by its place)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(type(owner).__init__)))
    except (OSError, TypeError, SyntaxError):
        return {}
    found: dict[str, str] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or _called_name(node.func) != layer_class.__name__:
            continue
        values = {**{names[i]: a for i, a in enumerate(node.args) if i < len(names)},
                  **{k.arg: k.value for k in node.keywords if k.arg}}
        for name, value in values.items():
            if isinstance(value, ast.Constant) and isinstance(value.value, (bool, int, float)):
                found.setdefault(name, repr(value.value))
            elif (isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name)
                  and value.value.id == "config"):
                found.setdefault(name, value.attr)  # a config field: the formula naming it
    return found


def _called_name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None
