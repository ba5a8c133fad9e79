"""Values a model carries from each layer's output into the next layer's call, besides the hidden states.

A loop such as ``hidden_states, carried = layer(hidden_states, carried=carried, ...)`` hands
every layer a second stream made by the layer before it. A Petals block exchanges hidden
states only, so every block starts that stream anew (None): right for a layer that then
recomputes it (a sparse-attention indexer's top-k), wrong otherwise. The draft says which
value it is, for the reviewer and for a failing check.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any

__all__ = ["carried_streams", "carried_keywords", "note_carried_streams", "stacked_streams",
           "refuse_stacked_streams"]

_HIDDEN = "hidden_states"


def _names(node: ast.AST) -> list[str]:
    return [n.id for n in ast.walk(node) if isinstance(n, ast.Name)]


def carried_streams(owner: Any, layers_attribute: str) -> list[str]:
    """Names the loop over ``owner.<layers_attribute>`` assigns from a layer's output and passes to the next layer."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(type(owner).forward))))
    except (OSError, TypeError, SyntaxError):
        return []
    found: list[str] = []
    for loop in ast.walk(tree):
        if not isinstance(loop, ast.For) or not any(isinstance(n, ast.Attribute) and n.attr == layers_attribute
                                                    for n in ast.walk(loop.iter)):
            continue
        layer_names = set(_names(loop.target))
        for node in ast.walk(loop):
            call = node.value if isinstance(node, ast.Assign) else None
            if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.func.id not in layer_names:
                continue
            targets = {name for target in node.targets if isinstance(target, ast.Tuple) for name in _names(target)}
            passed = {name for value in [*call.args, *(k.value for k in call.keywords)] for name in _names(value)}
            # the first output fed back as the first argument is the hidden-state stream, whatever its name
            stream = {name for target in node.targets if isinstance(target, ast.Tuple) and target.elts
                      for name in _names(target.elts[0])} & set(_names(call.args[0]) if call.args else ())
            found += sorted((targets & passed) - {_HIDDEN} - stream)
    return list(dict.fromkeys(found))


def carried_keywords(owner: Any, layers_attribute: str) -> dict[str, tuple[str, int]]:
    """``{carried name: (the keyword the next layer gets it as, its index in a layer's output tuple)}`` for the
    `carried_streams` passed by keyword."""
    carried = set(carried_streams(owner, layers_attribute))
    if not carried:
        return {}
    tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(type(owner).forward))))
    found: dict[str, tuple[str, int]] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign) or not isinstance(node.value, ast.Call):
            continue
        for target in node.targets:
            if not isinstance(target, ast.Tuple):
                continue
            for index, element in enumerate(target.elts):
                if not isinstance(element, ast.Name) or element.id not in carried:
                    continue
                for keyword in node.value.keywords:
                    if keyword.arg and isinstance(keyword.value, ast.Name) and keyword.value.id == element.id:
                        found[element.id] = (keyword.arg, index)
    return found


_STACKING = frozenset({"cat", "concat", "concatenate", "stack"})


def _called(call: ast.Call) -> str:
    """The name of the function a call calls (``torch.cat`` -> ``cat``)."""
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def stacked_streams(owner: Any, layers_attribute: str) -> list[str]:
    """Names the loop over ``owner.<layers_attribute>`` passes to its layers and grows from the hidden states
    (``stack = torch.cat([stack, hidden_states...])``): every layer reads the outputs of the layers before it."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(type(owner).forward))))
    except (OSError, TypeError, SyntaxError):
        return []
    found: list[str] = []
    for loop in ast.walk(tree):
        if not isinstance(loop, ast.For) or not any(isinstance(n, ast.Attribute) and n.attr == layers_attribute
                                                    for n in ast.walk(loop.iter)):
            continue
        layer_names = set(_names(loop.target))
        passed = {name for node in ast.walk(loop) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in layer_names
                  for value in [*node.args, *(k.value for k in node.keywords)] for name in _names(value)}
        for node in ast.walk(loop):
            if not isinstance(node, ast.Assign) or len(node.targets) != 1 or not isinstance(node.targets[0], ast.Name):
                continue
            name, used = node.targets[0].id, set(_names(node.value))
            grows = any(isinstance(call, ast.Call) and _called(call) in _STACKING for call in ast.walk(node.value))
            if grows and name in passed and name != _HIDDEN and {name, _HIDDEN} <= used:
                found.append(name)
    return list(dict.fromkeys(found))


def refuse_stacked_streams(owner: Any, layers_attribute: str) -> None:
    """Raise `DraftingError` when every layer reads a stack of the earlier layers' outputs (`stacked_streams`)."""
    from distconf.tools.drafting.common import DraftingError

    stacked = stacked_streams(owner, layers_attribute)
    if stacked:
        raise DraftingError(f"{type(owner).__name__} gives each layer {', '.join(stacked)}, a stack of every "
                            "earlier layer's hidden states it grows in its layer loop; blocks exchange one hidden "
                            "state only (as the Petals wire does), so no family file can serve this model")


def note_carried_streams(review: list[str], owner: Any, layers_attribute: str) -> None:
    """A review note when the model carries a value other than the hidden states between its layers."""
    carried = carried_streams(owner, layers_attribute)
    if carried:
        review.append(f"{type(owner).__name__} passes {', '.join(carried)} from each layer's output to the next "
                      "layer besides the hidden states; a block gets it as None (blocks exchange hidden states "
                      "only, as the Petals wire does): the family is right only if a layer given None recomputes "
                      "it as the model would")
