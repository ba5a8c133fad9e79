"""``hidden_state.carried[].grows``: a stack of earlier layers' inputs the layer loop grows and hands every layer.

``stack = torch.cat([stack, hidden_states.unsqueeze(-2)], dim=-2)`` in the loop (`streams.stacked_streams`
finds the name). The drafter reads, from the loop, the layer argument it is passed as and the module reading the
stack after the loop; from tiny runs, how many entries each layer gets (``ceil(i / every)``) and the config
field giving ``every``: the one whose value 1 makes every layer append and 2 every other one (the tiny config
keeps 2, so the check sees layers that append and layers that do not).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Mapping
from typing import Any

from distconf.tools.drafting.common import is_int
from distconf.tools.drafting.probe import TinyFacts
from distconf.tools.drafting.render import FamilyDraft

__all__ = ["stack_places", "stack_lengths", "draft_growing_stacks"]

_CANDIDATES = 12  # config fields tried as `every` (each one tiny run)


def stack_places(owner: Any, layers_attribute: str, layer_class: type) -> dict[str, tuple[str, str | None]]:
    """``{loop name: (the layer argument it is passed as, the module reading it after the loop or None)}`` of the
    `stacked_streams` (the module: ``self.<path>(stack, ...)`` after the loop)."""
    from distconf.tools.drafting.streams import stacked_streams

    stacked = set(stacked_streams(owner, layers_attribute))
    if not stacked:
        return {}
    params = [p.name for p in list(inspect.signature(layer_class.forward).parameters.values())[1:]]
    tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(type(owner).forward))))
    found: dict[str, tuple[str, str | None]] = {}
    readers: dict[str, str] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        args = [(params[j] if j < len(params) else None, arg) for j, arg in enumerate(node.args)]
        args += [(k.arg, k.value) for k in node.keywords]
        for argument, value in args:
            if not isinstance(value, ast.Name) or value.id not in stacked:
                continue
            if isinstance(node.func, ast.Name) and argument:  # the loop's call of a layer
                found.setdefault(value.id, (argument, None))
            elif _self_path(node.func) and node.args and node.args[0] is value:
                readers[value.id] = _self_path(node.func)  # type: ignore[assignment]
    return {name: (argument, readers.get(name)) for name, (argument, _) in found.items()}


def _self_path(func: ast.AST) -> str | None:
    """``a.b`` of a call of ``self.a.b(...)``."""
    parts = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    return ".".join(reversed(parts)) if isinstance(func, ast.Name) and func.id == "self" and parts else None


def stack_lengths(config_class: type, tiny: Mapping[str, Any], attn_implementation: str,
                  argument: str) -> tuple[list[int], int] | None:
    """Entries of the stack each layer of the tiny model gets as ``argument`` and each entry's width (None: no
    run, or the argument is no ``[..., entries, width]`` tensor)."""
    import torch

    from distconf.tools.drafting.probe import UNCACHED_RUN, observe

    record = observe(config_class, tiny, attn_implementation, UNCACHED_RUN)
    if record.error is not None:
        return None
    seen: list[tuple[int, int]] = []
    for call in record.calls:
        try:
            value = inspect.signature(call.module.forward).bind_partial(*call.args, **call.kwargs).arguments.get(
                argument)
        except (TypeError, ValueError):  # a call the layer's signature does not take: no stack read
            return None
        if isinstance(value, torch.Tensor) and value.ndim >= 2:
            seen.append((int(value.shape[-2]), int(value.shape[-1])))
    if len(seen) != record.layer_count or len({width for _, width in seen}) != 1:
        return None
    return [entries for entries, _ in seen], seen[0][1]


def _every(lengths: list[int]) -> int | None:
    """The ``every`` with ``lengths[i] == ceil(i / every)``, when only one below the layer count fits."""
    fits = [every for every in range(1, len(lengths)) if lengths == [-(-i // every) for i in range(len(lengths))]]
    return fits[0] if len(fits) == 1 else None


def draft_growing_stacks(facts: TinyFacts, draft: FamilyDraft) -> None:
    """Write ``hidden_state.carried`` with ``grows`` for each stack the loop grows from its layers' inputs whose
    ``every`` field is confirmed by setting it to 1; the tiny config keeps that field at 2 when it can.

    :raises DraftingError: a stack whose growth no config field explains (``owner``: the model's class name).
    """
    config_class, tiny = facts.config_class, facts.tiny
    places, owner = facts.stacks, facts.owner
    from distconf.tools.drafting.common import DraftingError

    layers = tiny.get("num_hidden_layers")
    carried = []
    for name, (argument, reader) in places.items():
        field = _every_field(config_class, tiny, draft.attn_implementation, argument)
        seen = stack_lengths(config_class, tiny, draft.attn_implementation, argument)
        if field is None or seen is None or seen[1] != tiny.get("hidden_size"):
            raise DraftingError(f"{owner} gives each layer {name}, a stack of earlier layers' hidden states it "
                                "grows in its layer loop, and no config field tells after how many layers it grows "
                                "(hidden_state.carried[].grows.every), so no family file can serve this model")
        if is_int(layers) and layers > 2:
            draft.tiny_config[field] = 2  # the check sees layers that append and layers that do not
        grows: dict[str, Any] = {"every": field}
        if reader is not None:
            grows["read_by"] = _model_path(draft, reader)
        carried.append({"argument": argument, "width": "hidden_size", "grows": grows})
        draft.review[:] = [note for note in draft.review if f"requires {argument!r}" not in note]
        draft.facts.append(f"each layer reads {name}, a stack the loop grows by the layer's input after every "
                           f"{field} layers: blocks carry the whole stack on the wire after the hidden state "
                           f"(ceil(num_hidden_layers / {field}) entries of hidden_size, zeros until made) and "
                           "append to it themselves (hidden_state.carried[].grows)")
    if carried:
        draft.hidden_state = {**draft.hidden_state, "carried": [*draft.hidden_state.get("carried", []), *carried]}


def _model_path(draft: FamilyDraft, reader: str) -> str:
    """``reader`` (a path below the module holding the layer list) as a path in the causal LM."""
    owner = draft.prefix.rpartition(".")[0]
    return f"{owner}.{reader}" if owner else reader


def _every_field(config_class: type, tiny: Mapping[str, Any], attn_implementation: str,
                 argument: str) -> str | None:
    """The integer field of ``tiny`` that is the stack's ``every``: set to 1, every layer appends; set to 2,
    every other one (each checked on a tiny run)."""
    seen = stack_lengths(config_class, tiny, attn_implementation, argument)
    if seen is None:
        return None
    count = len(seen[0])
    if count < 3:
        return None
    every = _every(seen[0])
    candidates = [name for name, value in tiny.items() if is_int(value) and value >= 1
                  and (value == every or value >= count - 1)][:_CANDIDATES]
    for name in candidates:
        ones = stack_lengths(config_class, {**tiny, name: 1}, attn_implementation, argument)
        twos = stack_lengths(config_class, {**tiny, name: 2}, attn_implementation, argument)
        if ones is not None and twos is not None and _every(ones[0]) == 1 and _every(twos[0]) == 2:
            return name
    return None
