"""The keys a sparse-attention indexer caches next to K/V, found on a tiny model's cache layers.

transformers' own indexer cache layers keep ``indexer_keys`` ``[batch, tokens, dim]``; a model's own cache
layer may keep one-head keys ``[batch, 1, tokens, dim]`` under another name. Either is a tensor a K/V cache
layer holds besides its keys and values, with the keys' batch and tokens.
"""

from __future__ import annotations

from typing import Any

from distconf.tools.drafting.common import field_value

__all__ = ["find_indexers", "indexer_kinds"]

_KV_ATTRIBUTES = frozenset({"keys", "values"})


def find_indexers(cache: Any) -> tuple[Any | None, list[bool]]:
    """(the last layer's indexer keys as ``[batch, tokens, dim]``, or None; whether each cache layer has one)."""
    found = [_indexer_of(layer) for layer in getattr(cache, "layers", None) or []]
    last = next((t for t in reversed(found) if t is not None), None)
    return last, [t is not None for t in found]


def _indexer_of(layer: Any) -> Any | None:
    import torch

    keys = getattr(layer, "keys", None)
    if not isinstance(keys, torch.Tensor) or keys.dim() != 4:
        return None
    batch, tokens = keys.shape[0], keys.shape[-2]
    for name, value in vars(layer).items():
        if name in _KV_ATTRIBUTES or not isinstance(value, torch.Tensor):
            continue
        if value.dim() == 4 and value.shape[1] == 1:
            value = value[:, 0]
        if value.dim() == 3 and value.shape[0] == batch and value.shape[1] == tokens:
            return value
    return None


def indexer_kinds(run: Any) -> tuple[str | None, list[str]] | None:
    """(None, the layer types) whose layers keep an indexer, when some K/V layers keep none; or (field, its
    values) when another per-layer list of the run's config tells them apart (``indexer_types``: full / shared);
    None when every layer keeps one (or no per-layer list tells which)."""
    has = run.indexer_layers
    if all(has) or not any(has):
        return None
    values = run.config.to_dict() if hasattr(run.config, "to_dict") else {}
    lists = [name for name, value in values.items() if name != "layer_types" and isinstance(value, (list, tuple))
             and len(value) == len(has) and all(isinstance(v, str) for v in value)]
    for name in ("layer_types", *sorted(lists)):
        kinds = _kinds(field_value(run.config, name), has)
        if kinds is not None:
            return (None if name == "layer_types" else name), kinds
    return None


def _kinds(types: Any, has: list[bool]) -> list[str] | None:
    """The values of per-layer list ``types`` on layers keeping an indexer, when no value is on both kinds."""
    if not isinstance(types, (list, tuple)) or len(types) != len(has):
        return None
    kinds = sorted({str(t) for t, keeps in zip(types, has, strict=True) if keeps})
    if any(str(t) in kinds for t, keeps in zip(types, has, strict=True) if not keeps):
        return None  # a type with and without an indexer: not a per-type rule
    return kinds
