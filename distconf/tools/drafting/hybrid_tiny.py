"""A tiny config that transformers cannot run with state-keeping layers only gets an attention layer.

A hybrid's config may build only its recurrent / linear-attention layers (transformers'
defaults, an index list of attention layers left empty). The cache code of such a model
then finds no attention layer to count the tokens seen and fails, while every real
checkpoint of the architecture has attention layers. When the tiny model fails so and the
modeling code names ``full_attention``, the tiny config's last layer is made an attention
layer: through ``layer_types`` when the class takes it, else through a list of layer
indices of the class that is empty by default (``attn_layer_indices``-like).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from distconf.tools.drafting.fields import FieldNames
from distconf.tools.drafting.named_variants import _built_types
from distconf.tools.drafting.probe_runs import TinyRun, run_tiny

__all__ = ["draft_layer_type_argument", "with_attention_layer"]

_ATTENTION_TYPE = "full_attention"
_LAYER_TYPES = "layer_types"
_INDEX_WORDS = frozenset({"idx", "idxs", "indices", "indexes", "index"})


def _index_fields(config_class: type) -> list[str]:
    """Fields of the class that hold layer indices and are empty by default."""
    if not dataclasses.is_dataclass(config_class):
        return []
    names = FieldNames.of(config_class)
    found = []
    for f in dataclasses.fields(config_class):
        default = f.default if f.default is not dataclasses.MISSING else None
        if names.words(f.name) & _INDEX_WORDS and (default is None or default == []):
            found.append(f.name)
    return found


def _candidates(config_class: type, types: list[str]) -> list[dict[str, Any]]:
    """Values over the tiny config that make its last layer an attention layer."""
    last = len(types) - 1
    return [{_LAYER_TYPES: [*types[:-1], _ATTENTION_TYPE]},
            *({name: [last]} for name in _index_fields(config_class))]


def with_attention_layer(config_class: type, layer_class: type | None, tiny: Mapping[str, Any],
                         attn_implementation: str, facts: list[str]) -> dict[str, Any]:
    """``tiny``, or ``tiny`` with an attention last layer when only that makes the tiny model run.

    Unchanged unless the modeling code names ``full_attention``, the tiny config builds no
    such layer and its tiny model fails; each change is tried on a real tiny model.
    """
    from distconf.tools.checker.named_kinds import layer_types_named_by

    tiny = dict(tiny)
    _, named = layer_types_named_by(*(c for c in (layer_class, config_class) if c is not None))
    types = _built_types(config_class, tiny)
    if _ATTENTION_TYPE not in named or not types or _ATTENTION_TYPE in types or len(types) < 2:
        return tiny
    if isinstance(run_tiny(config_class, tiny, attn_implementation), TinyRun):
        return tiny
    want = [*types[:-1], _ATTENTION_TYPE]
    for values in _candidates(config_class, types):
        changed = {**tiny, **values}
        if _built_types(config_class, changed) != want:
            continue
        if isinstance(run_tiny(config_class, changed, attn_implementation), TinyRun):
            field = next(iter(values))
            facts.append(f"the tiny model with only {', '.join(sorted(set(types)))} layers does not run in "
                         f"transformers (its cache code needs an attention layer): {field} gives its last layer "
                         f"type {_ATTENTION_TYPE}, as the real checkpoints of the architecture have")
            return changed
    return tiny


_LAYER_TYPE_ARGUMENT = "layer_type"


def draft_layer_type_argument(draft: Any, layer_class: type) -> None:
    """``block.constructor.layer_type_argument`` when the layer's constructor takes the layer's type.

    Such a layer builds its mixer (attention or recurrent) from that argument, whose default
    is one type: without it every block would be built as that type.
    """
    import inspect

    try:
        params = inspect.signature(layer_class.__init__).parameters
    except (TypeError, ValueError):
        return
    if _LAYER_TYPE_ARGUMENT in params and draft.mask.get("layer_types_field"):
        draft.constructor["layer_type_argument"] = _LAYER_TYPE_ARGUMENT
        draft.facts.append(f"{layer_class.__name__}() takes each layer's type as '{_LAYER_TYPE_ARGUMENT}'")
