"""Streams between layers besides the one hidden state: values carried from each layer's output into the next
layer's call, and several streams of hidden_size values (``hidden_state``).

A loop such as ``hidden_states, carried = layer(hidden_states, carried=carried, ...)`` hands
every layer a second stream made by the layer before it. A Petals block exchanges hidden
states only, so every block starts that stream anew (None): right for a layer that then
recomputes it (a sparse-attention indexer's top-k), wrong otherwise. The draft says which
value it is, for the reviewer and for a failing check.

Manifold hyper-connections expand the embedding output to N streams before the layer loop
(``[batch, seq, N, hidden_size]``; Gemma 3n's AltUp ``[N, batch, seq, hidden_size]``), every layer takes
and returns that shape, and a model-level module collapses the streams after the last layer, before the
final norm. The drafter runs the tiny model and sees it: the first layer's input has four dimensions, the
last one hidden_size; the module outside the layer list that takes that shape and gives ``[batch, seq,
hidden_size]`` is the collapse module (for streams first, the model collapses them in its forward: the
module it runs first after the last layer, or the list holding it); the config field giving N is the one
whose change changes N (`draft_hidden_state`).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from distconf.tools.drafting.common import field_value, is_int
from distconf.tools.drafting.probe import TinyFacts
from distconf.tools.drafting.render import FamilyDraft

__all__ = ["carried_streams", "carried_keywords", "note_carried_streams", "stacked_streams", "refuse_stacked_streams",
           "StreamsSeen", "streams_seen", "draft_hidden_state"]

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

_CANDIDATES = 8  # config fields tried as the stream count (each one tiny run)
_BATCH, _SEQ = 1, 5  # the tiny run's token ids: the streams' axis is the one that is neither


@dataclass(frozen=True)
class StreamsSeen:
    """What one tiny run shows of the hidden state between layers."""

    streams: int
    """Streams of the first layer's input (1: a plain ``[batch, seq, hidden_size]``)."""
    collapse_module: str | None
    """Dotted name in the causal LM of the module outside the layers that collapses the streams (None: none)."""
    axis: int = 2
    """Where the streams sit: 2 (``[batch, seq, streams, hidden]``) or 0 (``[streams, batch, seq, hidden]``)."""


def streams_seen(config_class: type, tiny: Mapping[str, Any], attn_implementation: str) -> StreamsSeen | None:
    """Run the tiny model on token ids and look at its first layer's input (None when it does not run)."""
    import torch

    from distconf.tools.drafting.probe import Forward, observe

    record = observe(config_class, tiny, attn_implementation, Forward(use_cache=False, batch=_BATCH, tokens=_SEQ))
    if record.error is not None:
        return None
    model, calls = record.model, record.outside
    hidden = field_value(record.config, "hidden_size")
    seen: dict[str, Any] = {}
    for call in record.of_layer(0):
        value = call.args[0] if call.args else call.kwargs.get("hidden_states")
        if isinstance(value, torch.Tensor):
            seen["shape"] = tuple(value.shape)
            break
    last = next((call for call in sorted(record.of_layer(record.layer_count - 1), key=lambda c: c.outside_before)),
                None)
    if last is not None:
        seen["after_last"] = last.outside_before
    shape = seen.get("shape")
    if shape is None or len(shape) != 4 or shape[-1] != hidden or (_BATCH, _SEQ) not in (shape[:2], shape[1:3]):
        return StreamsSeen(1, None)
    axis = 2 if shape[:2] == (_BATCH, _SEQ) else 0
    collapse = next((name for name, given, made in calls
                     if given == shape and made == (_BATCH, _SEQ, shape[-1])), None)
    if collapse is None and axis == 0:  # the model collapses them itself, with the modules it runs right after
        collapse = _module_list_of(model, next((name for name, _, _ in calls[seen.get("after_last", len(calls)):]),
                                               None))
    return StreamsSeen(int(shape[axis]), collapse, axis)


def _module_list_of(model: Any, name: str | None) -> str | None:
    """``name``, or the ModuleList holding it (the model indexing a list of modules, one per stream)."""
    import torch

    if name is None:
        return None
    parent, _, _ = name.rpartition(".")
    if parent and isinstance(model.get_submodule(parent), torch.nn.ModuleList):
        return parent
    return name


def draft_hidden_state(facts: TinyFacts, draft: FamilyDraft) -> None:
    """Write ``hidden_state`` when the tiny model's layers take several streams (the count's field confirmed by
    changing it), or a review note saying what to write by hand."""
    config_class, tiny = facts.config_class, facts.tiny
    seen = streams_seen(config_class, tiny, draft.attn_implementation)
    if seen is None or seen.streams == 1:
        return
    field = _streams_field(config_class, tiny, draft.attn_implementation, seen.streams)
    if field is None or seen.collapse_module is None:
        missing = ("the config field giving the count (no field equal to it changes it)" if field is None
                   else "the module collapsing them after the last layer (none outside the layers takes them)")
        form = (f"[batch, seq, {seen.streams}, hidden_size]" if seen.axis == 2
                else f"[{seen.streams}, batch, seq, hidden_size]")
        draft.review.append(f"the layers take {seen.streams} streams of hidden_size values ({form}), but the "
                            f"drafter did not find {missing}: write "
                            "hidden_state (streams, collapse_module) by hand")
        return
    axis = {} if seen.axis == 2 else {"stream_axis": seen.axis}
    draft.hidden_state = {"streams": field, **axis, "collapse_module": seen.collapse_module, **draft.hidden_state}
    form = f"[batch, seq, {field}, hidden_size]" if seen.axis == 2 else f"[{field}, batch, seq, hidden_size]"
    draft.facts.append(f"the layers take and return {field} streams of hidden_size values ({form}; "
                       f"{seen.collapse_module} collapses them after the last layer): blocks exchange "
                       f"them flattened, {field} * hidden_size values per token (hidden_state)")


def _streams_field(config_class: type, tiny: Mapping[str, Any], attn_implementation: str,
                   streams: int) -> str | None:
    """The integer field of ``tiny`` equal to ``streams`` whose change to ``streams + 1`` gives that many streams."""
    candidates = [name for name, value in tiny.items() if is_int(value) and value == streams][:_CANDIDATES]
    for name in candidates:
        other = streams_seen(config_class, {**tiny, name: streams + 1}, attn_implementation)
        if other is not None and other.streams == streams + 1:
            return name
    return None
