"""``hidden_state.carried``: a value the model's layer loop hands each layer from the layer before.

``hidden_states, carried = layer(hidden_states, carried, ...)`` starting from None (`streams.carried_streams`
finds the name in the loop). The drafter reads, from the loop, the layer argument it is passed as and its
index in the layer's output tuple; from the tiny run, its width (the last dimension of the first layer's
output at that index), and the config field giving the width: the one whose change changes it.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Mapping
from typing import Any

from distconf.tools.drafting.common import is_int
from distconf.tools.drafting.render import FamilyDraft

__all__ = ["carried_places", "carried_width_seen", "draft_carried_streams"]

_CANDIDATES = 8  # config fields tried as the width (each one tiny run)


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


def draft_carried_streams(draft: FamilyDraft, config_class: type, tiny: Mapping[str, Any],
                          places: Mapping[str, tuple[str, int]]) -> None:
    """Write ``hidden_state.carried`` for each value carried from layer to layer whose width's field is
    confirmed by changing it (the review note saying a block gets None goes), else leave the note."""
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
