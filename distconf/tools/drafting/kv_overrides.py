"""KV geometry per layer type: ``kv_cache.layer_overrides`` from the caches of two tiny models.

When the layers of one type cache a different number of KV heads (or head sizes) than the
layer the ``kv_cache`` section was read from, the ratio between the two is read on the tiny
model and confirmed on the probe model (other sizes): a constant whole ratio becomes a
formula over the section's own (``2 * (num_key_value_heads)``); anything else stays a review note.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from distconf.tools.drafting.common import field_value, is_int
from distconf.tools.drafting.fields import FieldNames, role_of

__all__ = ["kv_layer_overrides"]

_FIELDS = (("num_kv_heads", 0), ("key_head_dim", 1), ("value_head_dim", 3))
"""Override field and its place in a layer's (key heads, key size, value heads, value size)."""


def kv_layer_overrides(kv_cache: dict[str, Any], kv_groups: int | str, types_field: str,
                       runs: Sequence[Any]) -> dict[str, dict[str, str]] | None:
    """``{layer type: {field: formula}}`` for the types whose K/V differ from the section's, or None
    when a difference is not a constant whole ratio on every run (each a `TinyRun` with per-layer shapes)."""
    bases = {"num_kv_heads": kv_cache.get("num_kv_heads") or f"num_attention_heads // ({kv_groups})",
             "key_head_dim": kv_cache.get("key_head_dim"), "value_head_dim": kv_cache.get("value_head_dim")}
    ratios: dict[tuple[str, str], set[tuple[int, int]]] = {}
    for run in runs:
        types = field_value(run.config, types_field)
        if not isinstance(types, (list, tuple)) or len(types) != len(run.layer_shapes) or run.shape is None:
            return None
        reference = run.shape
        for kind, shape in zip(types, run.layer_shapes, strict=True):
            if shape is None:
                continue
            for name, index in _FIELDS:
                if shape[index] != reference[index]:
                    ratios.setdefault((str(kind), name), set()).add(_ratio(shape[index], reference[index]))
    overrides: dict[str, dict[str, str]] = {}
    for (kind, name), seen in sorted(ratios.items()):
        named = _heads_field(kind, types_field, runs) if name == "num_kv_heads" else None
        if named is not None:
            overrides.setdefault(kind, {})[name] = named
            continue
        if len(seen) != 1 or bases[name] is None:
            return None
        up, down = next(iter(seen))
        if up != 1 and down != 1:
            return None
        base = f"({bases[name]})"
        overrides.setdefault(kind, {})[name] = f"{up} * {base}" if down == 1 else f"{base} // {down}"
    return overrides or None


def _heads_field(kind: str, types_field: str, runs: Sequence[Any]) -> str | None:
    """A KV-heads field of the config (``num_key_value_heads``, ``swa_num_key_value_heads`` ...) giving the KV heads
    the layers of type ``kind`` cache on every run (None: none does)."""
    names = FieldNames.of(type(runs[0].config))
    fields = [key for key, value in runs[0].config.to_dict().items()
              if is_int(value) and role_of(key, value, names) in ("num_key_value_heads", "kv_heads")]
    for key in fields:
        if all(shape[0] == field_value(run.config, key)
               for run in runs for t, shape in zip(field_value(run.config, types_field), run.layer_shapes, strict=True)
               if str(t) == kind and shape is not None):
            return key
    return None


def _ratio(value: int, reference: int) -> tuple[int, int]:
    """(k, 1) when value = k * reference, (1, k) when reference = k * value, else (value, reference)."""
    if reference and value % reference == 0:
        return value // reference, 1
    if value and reference % value == 0:
        return 1, reference // value
    return value, reference
