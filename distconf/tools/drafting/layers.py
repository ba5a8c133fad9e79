"""Which real layers the tiny model keeps, and how per-layer fields are cut to them.

A per-layer field is a list with one entry per layer (its length is the number of
layers; transformers' standard ``layer_types`` may also be a shorter repeating
pattern); a layer-index field is a list of distinct layer numbers whose name speaks of layers or
indices (even when it lists every layer), and a layer-keyed field a mapping from layer
numbers to settings, whose name speaks of layers. Each real layer
has a signature: its entries in the per-layer fields that take few values (types,
flags), whether it is in each layer-index list, its layer-keyed settings, the layer
type the config class derives and the modules the layer is built of. The tiny model
keeps the first layer of each signature, repeated in order up to the tiny depth, and
every per-layer field is cut to those same layers: the fields stay consistent with
each other.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from distconf.tools.drafting.common import is_int
from distconf.tools.drafting.fields import FieldNames

__all__ = ["LayerPlan", "plan_layers", "layer_keys"]

_MAX_KINDS_PER_FIELD = 4  # a per-layer list with more distinct values holds sizes, not kinds


@dataclass(frozen=True)
class LayerPlan:
    """Real layer index behind each tiny layer, and the per-layer / layer-index fields found."""

    chosen: tuple[int, ...]
    per_layer: frozenset[str]
    index_lists: frozenset[str]
    kinds: int  # distinct layer signatures of the real model
    keyed: frozenset[str] = frozenset()  # mappings from layer index to per-layer settings

    @property
    def tiny_layers(self) -> int:
        """Number of layers of the tiny model."""
        return len(self.chosen)

    def cut(self, values: Sequence[Any]) -> list[Any]:
        """A per-layer list reduced to the chosen layers (a short pattern is read cyclically)."""
        return [values[i % len(values)] for i in self.chosen]

    def reindex(self, indices: Sequence[Any]) -> list[int]:
        """A layer-index list renumbered for the tiny model."""
        members = set(indices)
        return [tiny for tiny, real in enumerate(self.chosen) if real in members]

    def rekey(self, mapping: Mapping[Any, Any]) -> dict[Any, Any]:
        """A mapping keyed by layer index renumbered for the tiny model (keys written as they were)."""
        by_index = layer_keys(mapping) or {}
        out: dict[Any, Any] = {}
        for tiny, real in enumerate(self.chosen):
            if real in by_index:
                key = by_index[real]
                out[tiny if isinstance(key, int) else str(tiny).zfill(len(key))] = mapping[key]
        return out


def layer_keys(value: Any, layers: int | None = None) -> dict[int, Any] | None:
    """Layer index -> key, when ``value`` is a mapping keyed by layer indices (ints or digit strings)."""
    if not isinstance(value, Mapping) or not value:
        return None
    found = {}
    for key in value:
        index = key if is_int(key) else int(key) if isinstance(key, str) and key.isdigit() else None
        if index is None or index < 0 or (layers is not None and index >= layers):
            return None
        found[index] = key
    return found


def _is_per_layer(key: str, value: Any, layers: int, names: FieldNames) -> bool:
    if not isinstance(value, list) or not value:
        return False
    return len(value) == layers or (names.standard(key) == "layer_types" and layers % len(value) == 0)


_INDEX_WORDS = frozenset({"layer", "layers", "idx", "idxs", "indices", "indexes"})


def _is_index_list(key: str, value: Any, layers: int, names: FieldNames) -> bool:
    """A list of distinct layer numbers, named so (``dense_layers``, ``full_attn_idxs``)."""
    if not isinstance(value, list) or not names.words(key) & _INDEX_WORDS:
        return False
    return all(is_int(v) and 0 <= v < layers for v in value) and len(set(value)) == len(value)


def plan_layers(config: Mapping[str, Any], names: FieldNames, layers: int | None, *, min_layers: int,
                max_layers: int, extra: Sequence[Sequence[Hashable] | None] = (),
                chosen: Sequence[int] | None = None) -> LayerPlan:
    """The tiny layers of a model with ``layers`` layers.

    ``extra`` holds more per-layer signatures (the layer types the config class derives,
    the structure of each built layer). The tiny depth is ``min_layers`` for a uniform
    model, else the number of signatures (at least 3, so a type comes back after
    another), at most ``max_layers``. ``chosen`` (the real layer behind each tiny layer) overrides that choice.
    """
    if not layers:
        return LayerPlan(tuple(range(min_layers)), frozenset(), frozenset(), 1)
    index_lists = frozenset(k for k, v in config.items() if _is_index_list(k, v, layers, names))
    keyed = frozenset(k for k, v in config.items()
                      if names.words(k) & {"layer", "layers"} and layer_keys(v, layers) is not None)
    per_layer = frozenset(k for k, v in config.items()
                          if k not in index_lists and _is_per_layer(k, v, layers, names))
    columns = [_cyclic(config[k], layers) for k in sorted(per_layer)]
    columns = [c for c in columns if len(set(map(_hashable, c))) <= _MAX_KINDS_PER_FIELD]  # not sizes per layer
    columns += [[i in set(config[k]) for i in range(layers)] for k in sorted(index_lists)]
    columns += [_keyed_column(config[k], layers) for k in sorted(keyed)]
    columns += [list(column) for column in extra if column is not None and len(column) == layers]
    firsts: dict[Hashable, int] = {}
    for i in range(layers):
        firsts.setdefault(tuple(_hashable(column[i]) for column in columns), i)
    first_layers = sorted(firsts.values())
    kinds = len(first_layers)
    count = min_layers if kinds == 1 else min(max(3, kinds, min_layers), max_layers)
    picked = tuple(chosen) if chosen is not None else tuple(first_layers[j % kinds] for j in range(count))
    return LayerPlan(picked, per_layer, index_lists, kinds, keyed)


def _keyed_column(mapping: Mapping[Any, Any], layers: int) -> list[Hashable]:
    keys = layer_keys(mapping) or {}
    return [_hashable(mapping[keys[i]]) if i in keys else None for i in range(layers)]


def _cyclic(values: Sequence[Any], layers: int) -> list[Any]:
    return [values[i % len(values)] for i in range(layers)]


def _hashable(value: Any) -> Hashable:
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value
