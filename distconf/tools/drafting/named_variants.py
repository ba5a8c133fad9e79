"""A tiny variant per layer type the architecture names that no tiny variant builds yet.

``distconf check`` counts every layer type the modeling code of the layer class or the
config class names (`distconf.tools.checker.named_kinds`) as a kind of the real model, so
a draft whose config.json builds only some of them (a default config that is all
attention, sliding windows switched off) needs a variant that builds the others: its
``layer_types`` written out, the last tiny layer of the missing type. A sliding or
chunked type also gets the tiny window, and the class's switches of that window
(``use_sliding_window``-like booleans named with the window field's words) turned on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from distconf.tools.drafting.common import MISSING, field_value, try_config
from distconf.tools.drafting.profile import TINY

__all__ = ["named_type_variants"]

_LAYER_TYPES = "layer_types"
_WINDOW_FIELDS = {"sliding_attention": "sliding_window", "chunked_attention": "attention_chunk_size"}


def _built_types(config_class: type, values: Mapping[str, Any]) -> list[str] | None:
    held = try_config(config_class, values)
    if held is MISSING:  # the class refuses these values; the run of the tiny config says why
        return None
    types = field_value(held, _LAYER_TYPES)
    return [str(t) for t in types] if isinstance(types, (list, tuple)) and types else None


def _switches(config_class: type, window_field: str) -> list[str]:
    """Boolean fields of the class that are off by default and named with the window field's words."""
    if not dataclasses.is_dataclass(config_class):
        return []
    words = set(window_field.split("_"))
    return [f.name for f in dataclasses.fields(config_class)
            if f.default is False and words & set(f.name.split("_")) and f.name != window_field]


def named_type_variants(config_class: type, layer_class: type, base: Mapping[str, Any],
                        variants: list[Mapping[str, Any]]) -> tuple[str, list[tuple[str, dict[str, Any]]]]:
    """``(where, [(type, variant values over base)])`` for each named layer type no variant builds."""
    from distconf.tools.checker.named_kinds import layer_types_named_by

    where, named = layer_types_named_by(layer_class, config_class)
    built: set[str] = set()
    base_types = None
    for values in [{}, *variants]:
        types = _built_types(config_class, {**base, **values})
        if types is None:
            continue
        base_types = base_types or types
        built.update(types)
    if base_types is None or not built:  # no per-layer layer_types: nothing to vary
        return where, []
    found = []
    for layer_type in sorted(named - built):
        values: dict[str, Any] = {_LAYER_TYPES: [*base_types[:-1], layer_type]}
        window_field = _WINDOW_FIELDS.get(layer_type)
        if window_field is not None:
            values[window_field] = TINY.window
            values.update({name: True for name in _switches(config_class, window_field)})
        if _built_types(config_class, {**base, **values}) == values[_LAYER_TYPES]:
            found.append((layer_type, values))
    return where, found
