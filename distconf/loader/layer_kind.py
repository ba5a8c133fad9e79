"""A layer's type: the one rule naming it, read by every consumer that treats layers of a family differently.

A layer's type is the type whose ``block.mask.layer_index_fields`` field lists its index, else its entry in the
config field ``block.mask.layer_types_field`` (e.g. ``layer_types``). Which cache each type keeps is
`distconf.blocks.layer_types`; which K/V it shares across layers, `distconf.loader.kv_sharing`.
"""

from __future__ import annotations

from typing import Any

from distconf.errors import ConfigValueError

__all__ = ["layer_type"]


def _spec(config: Any) -> Any:
    cls = config if isinstance(config, type) else type(config)
    return getattr(cls, "family_spec", None)


def layer_type(config: Any, layer_idx: int) -> str | None:
    """The type of layer ``layer_idx``: the type whose ``block.mask.layer_index_fields`` field lists the index,
    else its entry in ``block.mask.layer_types_field``; None when the family or the config names no type."""
    spec = _spec(config)
    if spec is None:
        return None
    for kind, index_field in spec.block.mask.layer_index_fields.items():
        indices = getattr(config, index_field, None)
        if indices is not None and not isinstance(indices, (list, tuple, set, frozenset)):
            raise ConfigValueError(f"{index_field}={indices!r} is not a list of layer indices")
        if indices is not None and layer_idx in indices:
            return kind
    field = spec.block.mask.layer_types_field
    if field is None:
        return None
    types = getattr(config, field, None)
    if types is None:
        return None
    try:
        return str(types[layer_idx])
    except (IndexError, TypeError):
        raise ConfigValueError(f"{field}={types!r} has no entry for layer {layer_idx}") from None
