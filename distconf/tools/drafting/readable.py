"""Which fields of a tiny config the architecture reads (`architecture_fields`).

A field is read when it is a field of the config class (its dataclass fields, or the
attributes of a default instance) or a standard name in its ``attribute_map``, when
the modeling code reads it (``getattr(config, "head_dim", ...)`` of a field the class
does not declare), or when passing it changes a field (legacy names such as
``rope_scaling`` that the class converts). Fields of every config (`PreTrainedConfig`: architectures, dtype ...) are
not the architecture. Null and false values equal to the class default are left out as
noise; numbers and strings are kept even when they equal a default: they document the
real model.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from distconf.tools.drafting.common import MISSING, try_config

__all__ = ["architecture_fields"]


def _base_fields() -> set[str]:
    from transformers import PreTrainedConfig

    if dataclasses.is_dataclass(PreTrainedConfig):
        return {f.name for f in dataclasses.fields(PreTrainedConfig)}
    return set(vars(PreTrainedConfig()))


def _class_fields(config_class: type, defaults: Any) -> set[str]:
    fields = {f.name for f in dataclasses.fields(config_class)} if dataclasses.is_dataclass(config_class) else set()
    fields |= {k for k in vars(defaults) if not k.startswith("_")}
    return (fields - _base_fields()) | set(getattr(config_class, "attribute_map", None) or {})


def _comparable(config: Any, base: set[str]) -> dict[str, Any]:
    return {k: v for k, v in config.to_dict().items() if k not in base}


def _changes_fields(config_class: type, key: str, value: Any, reference: dict[str, Any], base: set[str]) -> bool:
    """Passing ``key`` alone changes another field of the class: the class reads it."""
    alone = try_config(config_class, {key: value})
    if alone is MISSING:  # the class rejects it alone; it is about the architecture, keep it
        return True
    changed = _comparable(alone, base)
    changed.pop(key, None)
    return changed != reference


def _non_finite(value: Any) -> bool:
    """True when ``value`` holds an infinity or a NaN (which a family file, like JSON, cannot hold)."""
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, Mapping):
        return any(_non_finite(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_non_finite(v) for v in value)
    return False


def _same(value: Any, default: Any) -> bool:
    """``value == default``, lists equal to tuples, NaN equal to NaN."""
    if isinstance(value, (list, tuple)) and isinstance(default, (list, tuple)):
        return len(value) == len(default) and all(_same(v, d) for v, d in zip(value, default))
    if isinstance(value, float) and isinstance(default, float) and math.isnan(value) and math.isnan(default):
        return True
    return bool(value == default)


def architecture_fields(tiny: Mapping[str, Any], config_class: type, facts: list[str],
                        model_reads: frozenset[str] = frozenset(),
                        review: list[str] | None = None) -> dict[str, Any]:
    """``tiny`` without the fields the architecture does not read and null / false defaults, sorted.

    Read are the fields of ``config_class``, the names it converts, and ``model_reads``
    (the attributes the modeling code reads, declared or not). A note naming the
    fields left out is appended to ``facts``. A field holding an infinity or a NaN is
    left out too (a family file cannot hold one): noted in ``facts`` when it is the
    class default, in ``review`` when it is not.
    """
    defaults = try_config(config_class)
    if defaults is MISSING:  # some classes need arguments; then keep everything
        return dict(sorted(tiny.items()))
    base = _base_fields()
    fields = _class_fields(config_class, defaults) | model_reads
    reference = _comparable(defaults, base)
    default_values = defaults.to_dict()
    kept, unread = {}, []
    for key, value in tiny.items():
        if _non_finite(value):
            default = default_values.get(key, getattr(defaults, key, None))
            if _same(value, default):
                facts.append(f"{key} is left to {config_class.__name__}'s default {default!r} (a family file "
                             "cannot hold an infinity or a NaN)")
            elif review is not None:
                review.append(f"{key} is {value!r} in the config.json: a family file cannot hold an infinity or a "
                              f"NaN, so tiny_config leaves it to the class default {default!r}; check that it "
                              "does not matter")
            continue
        if key not in fields and not _changes_fields(config_class, key, value, reference, base):
            unread.append(key)
        elif not ((value is None or value is False) and key in default_values and default_values[key] is value):
            kept[key] = value  # a null / false default is noise; numbers and strings document the model
    if unread:
        facts.append(f"left out of tiny_config (neither {config_class.__name__} nor the modeling code reads them, "
                     f"or they leave its defaults unchanged): {', '.join(sorted(unread))}")
    return dict(sorted(kept.items()))
