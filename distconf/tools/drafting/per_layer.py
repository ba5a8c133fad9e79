"""Drafting a heterogeneous config (sizes per layer, ``per_layer_config``): read each layer through its own config.

The runtime evaluates a family's per-layer formulas on the layer's own config
(`distconf.loader.per_layer.layer_config`), so ``head_dim`` there is the layer's head_dim. The drafter does
the same: the ``kv_cache`` section is searched on the config of the layer whose cache it was read from
(`at_layer`), and a layer type whose K/V differ only because its own config says other sizes needs no
``kv_cache.layer_overrides`` (`section_shape`, `explained_by_layer_configs`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from distconf.loader.per_layer import is_heterogeneous, layer_config
from distconf.tools.drafting.common import field_value, is_int

__all__ = ["last_kv_layer", "at_layer", "section_shape", "explained_by_layer_configs"]


def last_kv_layer(run: Any) -> int | None:
    """The index of the last layer of a tiny run (`TinyRun`) that cached K/V (its ``shape``), or None."""
    found = [i for i, shape in enumerate(run.layer_shapes) if shape is not None]
    return found[-1] if found else None


def at_layer(run: Any, layer_idx: int | None = None) -> Any:
    """``run`` with its config replaced by the config of layer ``layer_idx`` (default: the layer its ``shape`` was
    read from); ``run`` itself for a homogeneous config."""
    if run is None or not is_heterogeneous(run.config):
        return run
    index = last_kv_layer(run) if layer_idx is None else layer_idx
    return run if index is None else dataclasses.replace(run, config=layer_config(run.config, index))


def _value(formula: Any, config: Any) -> int | None:
    from distconf.tools.drafting.kv import formula_value

    value = formula_value(formula, config) if formula is not None else None
    return value if is_int(value) else None


def section_shape(kv_cache: Mapping[str, Any], kv_groups: int | str, config: Any) -> tuple[int | None, ...]:
    """(key heads, key head size, value heads, value head size) the draft's ``kv_cache`` section gives on
    ``config``, with the runtime's defaults for the fields it leaves out (`distconf.blocks.kvcache`)."""
    groups = _value(kv_groups, config)
    heads = _value(kv_cache.get("num_kv_heads"), config)
    if heads is None and groups:
        count = field_value(config, "num_attention_heads")
        heads = count // groups if is_int(count) else None
    key = _value(kv_cache.get("key_head_dim"), config)
    if key is None and kv_cache.get("key_head_dim") is None:
        head_dim = field_value(config, "head_dim")
        key = head_dim if is_int(head_dim) and head_dim else _value("hidden_size // num_attention_heads", config)
    value = _value(kv_cache.get("value_head_dim"), config) if kv_cache.get("value_head_dim") is not None else key
    return heads, key, heads, value


def explained_by_layer_configs(kv_cache: Mapping[str, Any], kv_groups: int | str, run: Any) -> bool:
    """Whether every K/V layer of a heterogeneous tiny run caches what the section gives on its own config (so the
    layers' different shapes need no ``kv_cache.layer_overrides``)."""
    if run is None or not is_heterogeneous(run.config):
        return False
    return all(shape is None or tuple(shape) == section_shape(kv_cache, kv_groups, layer_config(run.config, i))
               for i, shape in enumerate(run.layer_shapes))
