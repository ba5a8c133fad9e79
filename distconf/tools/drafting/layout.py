"""The layout of layer fields a config class holds (`held_layout`), when it differs from its ``config.json``.

A few config classes store their layers in the file in another layout than they hold
them: each layer written as two entries of ``layer_types`` and every count of layers
doubled, halved again on construction. Shrinking the file's layout cuts the lists and
counts out of step with that conversion (an odd count, a list of the wrong length); the
layout the instance holds shrinks like any other, and the class takes it back unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from distconf.tools.drafting.common import MISSING, field_value, is_int, try_config
from distconf.tools.drafting.fields import Anchors, FieldNames

__all__ = ["held_layout"]


def _plain(value: Any) -> Any:
    """``value`` as JSON would hold it (tuples as lists), or None when it is not a count or a list of scalars."""
    if is_int(value):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, (str, int, float, bool)) or v is None for v in value):
        return list(value)
    return None


def held_layout(raw: Mapping[str, Any], config_class: type) -> Mapping[str, Any]:
    """``raw`` with its layer counts and lists as ``config_class`` holds them, when the class converts them.

    Only when the instance holds another number of layers than the file says, and the class
    built from the held values holds the same layers again; otherwise ``raw`` unchanged.
    """
    held = try_config(config_class, raw)
    if held is MISSING:  # the drafting reports what the class rejects
        return raw
    layers = field_value(held, "num_hidden_layers")
    written = Anchors.read(raw, FieldNames.of(config_class)).layers
    if not is_int(layers) or not is_int(written) or written == layers:
        return raw
    changed = {}
    for key, value in raw.items():
        now = _plain(getattr(held, key, None))
        if now is not None and _plain(value) is not None and now != _plain(value):
            changed[key] = now
    candidate = {**raw, **changed}
    again = try_config(config_class, candidate)
    if again is MISSING or field_value(again, "num_hidden_layers") != layers:
        return raw
    return candidate
