"""Values each layer hands the next besides the hidden states: ``hidden_state.carried`` and
``block.call.carried_arguments``.

``hidden_states, carried = layer(hidden_states, carried, ...)`` starting from None (`streams.carried_streams`
finds the name in the loop): the drafter reads, from the loop, the layer argument it is passed as and its index
in the layer's output tuple; from the tiny run, its width (the last dimension of the first layer's output at that
index), and the config field giving the width: the one whose change changes it (`draft_carried_streams`).

A loop such as ``hidden_states, topk_indices = layer(..., prev_topk_indices=topk_indices)`` carries a value by
keyword. A block is handed hidden states only. When the tiny model's carried value is, for every query, the index
of every key (a top-k selection over no more than k keys), the block can pass exactly that (``all_keys``), up to
the config field bounding the selection: the one whose change to fewer keys than the run has makes the value that
much narrower (`draft_carried_arguments`).
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

__all__ = ["carried_values", "draft_carried_arguments", "carried_places", "carried_width_seen", "draft_carried_streams"]

_TOKENS = 5  # of the tiny run
_NARROW = 3  # keys the bounding field is set to
_CANDIDATES = 8  # config fields tried (each one tiny run)


def carried_values(config_class: type, tiny: Mapping[str, Any], attn_implementation: str,
                   index: int) -> list[Any] | None:
    """Output ``index`` of every layer of the tiny model on ``_TOKENS`` token ids (None when it does not run)."""
    from distconf.tools.drafting.probe import Forward, observe

    record = observe(config_class, tiny, attn_implementation, Forward(use_cache=True, tokens=_TOKENS, seed=0))
    if record.error is not None:
        return None
    return [call.output[index] if isinstance(call.output, (tuple, list)) and len(call.output) > index else None
            for call in record.calls]


def _every_key(values: list[Any]) -> bool:
    """Each value is ``[batch, queries, keys]`` integer indices holding every key once for each query."""
    import torch

    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if not tensors or len(tensors) != len(values):
        return False
    for value in tensors:
        if value.dtype.is_floating_point or value.dim() != 3 or value.shape[-1] != _TOKENS:
            return False
        wanted = torch.arange(_TOKENS, dtype=value.dtype).expand_as(value)
        if not torch.equal(value.sort(dim=-1).values, wanted):
            return False
    return True


def _bounding_field(config_class: type, tiny: Mapping[str, Any], attn_implementation: str, index: int) -> str | None:
    """The integer field of ``tiny`` that, set to fewer keys than the run has, narrows the value to that many."""
    candidates = sorted((name for name, value in tiny.items() if is_int(value) and value >= _TOKENS),
                        key=lambda name: -tiny[name])[:_CANDIDATES]
    for name in candidates:
        values = carried_values(config_class, {**tiny, name: _NARROW}, attn_implementation, index)
        shapes = {tuple(v.shape) for v in values or [] if hasattr(v, "shape")}
        if shapes == {(1, _TOKENS, _NARROW)}:
            return name
    return None


def draft_carried_arguments(facts: TinyFacts, draft: FamilyDraft) -> None:
    """Write ``block.call.carried_arguments`` for each carried value (``{name: (keyword, output index)}``) the
    tiny run shows to be every key's index, bounded by a config field; their review notes then go."""
    config_class, tiny = facts.config_class, facts.tiny
    carried = facts.carried_keywords
    found: dict[str, dict[str, Any]] = {}
    for name, (keyword, index) in carried.items():
        values = carried_values(config_class, tiny, draft.attn_implementation, index)
        if values is None or not _every_key(values):
            continue
        field = _bounding_field(config_class, tiny, draft.attn_implementation, index)
        if field is None:
            continue
        found[keyword] = {"stand_in": "all_keys", "exact_up_to": field}
        draft.review = [note for note in draft.review
                        if f"'{keyword}'" not in note and f" passes {name} from each layer's output" not in note]
        draft.facts.append(f"the layers hand each other {name} (as {keyword}): the index of every key for each "
                           f"query while there are at most {field} keys, which the block passes instead "
                           "(block.call.carried_arguments; longer sequences are refused)")
    if found:
        draft.call["carried_arguments"] = found


def carried_places(owner: Any, layers_attribute: str, layer_class: type) -> dict[str, tuple[str, int]]:
    """``{loop name: (the layer argument it is passed as, its index in the layer's output tuple)}`` of the
    `carried_streams` (positional arguments named by the layer's signature)."""
    from distconf.tools.drafting.streams import carried_streams

    carried = set(carried_streams(owner, layers_attribute))
    if not carried:
        return {}
    params = [p.name for p in list(inspect.signature(layer_class.forward).parameters.values())[1:]]
    tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(type(owner).forward))))
    found: dict[str, tuple[str, int]] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign) or not isinstance(node.value, ast.Call):
            continue
        call = node.value
        passed = {arg.id: params[j] for j, arg in enumerate(call.args)
                  if isinstance(arg, ast.Name) and j < len(params)}
        passed.update({k.value.id: k.arg for k in call.keywords if k.arg and isinstance(k.value, ast.Name)})
        for target in node.targets:
            if isinstance(target, ast.Tuple):
                for index, element in enumerate(target.elts):
                    if isinstance(element, ast.Name) and element.id in carried and element.id in passed and index:
                        found[element.id] = (passed[element.id], index)
    return found


def carried_width_seen(config_class: type, tiny: Mapping[str, Any], attn_implementation: str,
                       index: int) -> int | None:
    """The last dimension of the tiny model's first layer's output ``index`` (None: no tensor or no run)."""
    import torch

    from distconf.tools.drafting.probe import UNCACHED_RUN, observe

    record = observe(config_class, tiny, attn_implementation, UNCACHED_RUN)
    if record.error is not None:
        return None
    for call in record.of_layer(0):
        output = call.output
        value = output[index] if isinstance(output, (tuple, list)) and len(output) > index else None
        if isinstance(value, torch.Tensor):
            return int(value.shape[-1])
    return None


def draft_carried_streams(facts: TinyFacts, draft: FamilyDraft) -> None:
    """Write ``hidden_state.carried`` for each value carried from layer to layer whose width's field is
    confirmed by changing it (the review note saying a block gets None goes), else leave the note."""
    config_class, tiny = facts.config_class, facts.tiny
    places = {k: v for k, v in facts.carried_places.items() if k not in facts.carried_keywords}
    carried = []
    for name, (argument, index) in places.items():
        width = carried_width_seen(config_class, tiny, draft.attn_implementation, index)
        field = None if width is None else _width_field(config_class, tiny, draft.attn_implementation, index, width)
        if field is None:
            continue
        carried.append({"argument": argument, "width": field, "output_index": index})
        draft.review[:] = [note for note in draft.review if f"passes {name} from" not in note]
        draft.facts.append(f"the layers carry {name} ({field} values per token, output {index}) from each layer "
                           f"to the next: blocks exchange it on the wire after the hidden state, zeros standing "
                           f"for the model's None before the first layer (hidden_state.carried)")
    if carried:
        draft.hidden_state = {**draft.hidden_state, "carried": carried}


def _width_field(config_class: type, tiny: Mapping[str, Any], attn_implementation: str, index: int,
                 width: int) -> str | None:
    """The integer field of ``tiny`` equal to ``width`` whose doubling doubles the carried value's width."""
    candidates = [name for name, value in tiny.items() if is_int(value) and value == width][:_CANDIDATES]
    for name in candidates:
        if carried_width_seen(config_class, {**tiny, name: 2 * width}, attn_implementation, index) == 2 * width:
            return name
    return None
