"""How a model calls its layers, read from the source of the module that runs them.

Some layers take inputs the generic block cannot guess from their names, e.g. an
additive position bias the model builds once from a function of its own
(``position_bias=alibi`` after ``alibi = build_..._tensor(self.num_heads,
self.config.max_seq_len, device=...)``), or a boolean mask cast from the float one
(``create_causal_mask(...).to(torch.bool)``). The ``forward`` of the module holding the
layer list shows where each argument of the layer call comes from; attributes set in
its ``__init__`` from config fields (``self.num_heads = config.n_heads``) turn them into
formulas over config fields.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass, field
from typing import Any

__all__ = ["LayerCall", "read_layer_call"]


def _tree(function: Any) -> ast.AST | None:
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(function))))
    except (OSError, TypeError, SyntaxError):
        return None


def _self_attribute(node: ast.AST) -> str | None:
    """``X`` of ``self.X`` (through subscripts and calls such as ``enumerate(self.X[:n])``)."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
            return sub.attr
    return None


@dataclass
class LayerCall:
    """The keyword arguments the model passes to its layers, and where their values come from."""

    owner: Any
    keywords: dict[str, ast.expr] = field(default_factory=dict)
    assignments: dict[str, ast.expr] = field(default_factory=dict)  # local name -> last value assigned
    init_fields: dict[str, str] = field(default_factory=dict)  # self.<attribute> -> config field

    def origin(self, keyword: str) -> ast.expr | None:
        """The expression passed as ``keyword``, through one local variable."""
        value = self.keywords.get(keyword)
        if isinstance(value, ast.Name):
            return self.assignments.get(value.id, value)
        return value

    def formula(self, node: ast.expr) -> str | None:
        """A formula over config fields for ``node`` (``self.config.x``, ``config.x``, ``self.y``, constants)."""
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, bool)):
            return repr(node.value)
        if isinstance(node, ast.Attribute):
            base = node.value
            if isinstance(base, ast.Name) and base.id == "config":
                return node.attr
            if isinstance(base, ast.Attribute) and base.attr == "config":
                return node.attr
            if isinstance(base, ast.Name) and base.id == "self":
                return self.init_fields.get(node.attr)
        return None

    def function(self, node: ast.expr | None) -> tuple[Any, ast.Call] | None:
        """The module-level function a call expression invokes (``f(...)`` or ``self.f(...)``), with the call."""
        if not isinstance(node, ast.Call):
            return None
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        module = inspect.getmodule(type(self.owner))
        function = getattr(module, name, None) if name else None
        return (function, node) if inspect.isfunction(function) else None

    def casts_to_bool(self, keyword: str) -> bool:
        """The value passed as ``keyword`` is made with ``.to(torch.bool)``."""
        node = self.origin(keyword)
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            return False
        return node.func.attr == "to" and any(isinstance(a, ast.Attribute) and a.attr == "bool" for a in node.args)


def read_layer_call(owner: Any, layers_attribute: str) -> LayerCall | None:
    """How ``owner.forward`` calls the layers of ``owner.<layers_attribute>`` (None when it cannot be read)."""
    tree = _tree(type(owner).forward)
    if tree is None:
        return None
    call = LayerCall(owner)
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            call.assignments[node.targets[0].id] = node.value
        if isinstance(node, ast.For) and _self_attribute(node.iter) == layers_attribute:
            names = {n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)}
            for sub in ast.walk(node):
                if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name) and sub.func.id in names:
                    call.keywords.update({k.arg: k.value for k in sub.keywords if k.arg})
    init = _tree(type(owner).__init__)
    for node in ast.walk(init) if init is not None else ():
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                formula = call.formula(node.value)
                if formula is not None:
                    call.init_fields[target.attr] = formula
    return call if call.keywords else None
