"""Which layers store K/V for later layers and which reuse it (``kv_cache.shared``), and what the wire carries.

A family with `distconf.loader.spec_kv.SharedKVSpec` reads each layer's mode from the config attribute
``modes_field`` (``store``, ``reuse`` or anything else: neither) and keys a stored K/V by the storing layer's
type (`distconf.loader.layer_kind.layer_type`). The wire carries, for every type some layer stores, the keys and
values of the step's new tokens (`shared_kv_slots`, in the order the types are first stored); this module is the
one home of that order and of each part's width (`distconf.loader.wire_layout.wire_width_of` adds them up).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from distconf.errors import ConfigValueError
from distconf.loader.formula import count_on
from distconf.loader.layer_kind import layer_type
from distconf.loader.per_layer import layer_config

__all__ = ["SharedSlot", "LayerSharing", "shared_kv_slots", "layer_sharing"]


class SharedSlot(NamedTuple):
    """One stored K/V on the wire: the layer type it is stored under and its values per token (keys, then
    values)."""

    key: str
    width: int


class LayerSharing(NamedTuple):
    """What one layer does with shared K/V: ``role`` ``store``, ``reuse`` or None, under ``key`` (its type)."""

    role: str | None
    key: str | None


def _spec(config: Any) -> Any:
    spec = getattr(type(config), "family_spec", None)
    return spec.kv_cache.shared if spec is not None else None


def _modes(config: Any) -> list[Any]:
    shared = _spec(config)
    family = type(config).family_spec.family
    modes = getattr(config, shared.modes_field, None)
    layers = int(config.num_hidden_layers)
    if not isinstance(modes, (list, tuple)) or len(modes) != layers:
        raise ConfigValueError(f"family {family!r}: kv_cache.shared.modes_field {shared.modes_field!r} is "
                               f"{modes!r}, not one mode for each of the {layers} layers")
    return list(modes)


def layer_sharing(config: Any, layer_idx: int) -> LayerSharing:
    """Whether layer ``layer_idx`` stores or reuses shared K/V, and under which key (``LayerSharing(None, None)``
    for a family without ``kv_cache.shared`` and a layer doing neither)."""
    shared = _spec(config)
    if shared is None:
        return LayerSharing(None, None)
    mode = _modes(config)[layer_idx]
    role = "store" if mode == shared.store else "reuse" if mode == shared.reuse else None
    return LayerSharing(role, layer_type(config, layer_idx) if role else None)


def shared_kv_slots(config: Any) -> tuple[SharedSlot, ...]:
    """The stored K/V the wire carries, in wire order (() for a family without ``kv_cache.shared``); a type
    some layer reuses but no earlier layer stores is an error naming both."""
    shared = _spec(config)
    if shared is None:
        return ()
    family = type(config).family_spec.family
    keys: dict[str, int] = {}  # stored type -> its first storing layer
    for i in range(int(config.num_hidden_layers)):
        role, key = layer_sharing(config, i)
        if role == "store" and key not in keys:
            keys[key] = i  # type: ignore[index]
        elif role == "reuse" and key not in keys:
            raise ConfigValueError(f"family {family!r}: layer {i} reuses the K/V of {key!r} layers, but no earlier "
                                   f"layer stores it ({shared.modes_field})")
    return tuple(SharedSlot(key, _width(layer_config(config, i), key)) for key, i in keys.items())


def _width(config: Any, key: str) -> int:
    """Values per token of the K/V stored under ``key``, on the storing layer's own config (sizes per layer)."""
    shared = _spec(config)
    family = type(config).family_spec.family
    value = shared.values_per_token
    where = "kv_cache.shared.values_per_token"
    if isinstance(value, dict):
        if key not in value:
            raise ConfigValueError(f"family {family!r}: {where} has no entry for the stored type {key!r}")
        value, where = value[key], f"{where}.{key}"
    return count_on(config, family, where, value)
