"""KV-cache geometry of a block, from the family file's ``kv_cache`` section, and the
small cache object a block hands to its attention layer.

Geometry (per token, per block): ``num_kv_heads`` heads of ``key_head_dim`` key values
and ``value_head_dim`` value values, unless the family overrides ``values_per_token``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from distconf.blocks.layer_types import any_layer_keeps_kv, keeps_kv_at, layer_type
from distconf.errors import ConfigValueError
from distconf.loader.config_protocol import DistributedConfig
from distconf.loader.formula import Formula, FormulaError
from distconf.loader.per_layer import is_heterogeneous, layer_config
from distconf.loader.wire_layout import wire_width_of

__all__ = ["KVGeometry", "kv_geometry", "BlockKVCache"]


@dataclass(frozen=True)
class KVGeometry:
    """What one block keeps in its KV cache for one token."""

    num_kv_heads: int
    key_head_dim: int
    value_head_dim: int
    values_per_token: int
    indexer_head_dim: int = 0
    """Values per token of a sparse-attention indexer's key cache (0: none); counted in ``values_per_token``."""


def _family(config: DistributedConfig) -> str:
    spec = getattr(type(config), "family_spec", None)
    return spec.family if spec is not None else type(config).__name__


def _value(config: DistributedConfig, field: str, value: int | Formula | None, default: Any) -> int:
    """Evaluate one ``kv_cache`` field (int, formula or default callable) to a positive int."""
    source = f"kv_cache.{field}"
    try:
        if value is None:
            result = default()
        elif isinstance(value, int):
            result = value
        else:
            result = value.evaluate_on(config)
    except (FormulaError, AttributeError, TypeError, ZeroDivisionError) as exc:
        raise ConfigValueError(f"family {_family(config)!r}: {source}: {exc}") from None
    if isinstance(result, bool) or not isinstance(result, int) or result < 1:
        raise ConfigValueError(
            f"family {_family(config)!r}: {source} gave {result!r}; expected a positive integer"
        )
    return result


def _default_head_dim(config: DistributedConfig) -> int:
    head_dim = getattr(config, "head_dim", None)
    if head_dim:
        return int(head_dim)
    return config.hidden_size // config.num_attention_heads


def kv_geometry(config: DistributedConfig, layer_idx: int | None = None) -> KVGeometry:
    """The KV-cache geometry block ``layer_idx`` of ``config`` keeps per token (from its family file); all 0
    for a layer that keeps none (a recurrent or MLP-only layer, `distconf.blocks.layer_types`).

    Formulas are read on the layer's own config (`distconf.loader.per_layer.layer_config`: a heterogeneous
    config's sizes per layer). Without ``layer_idx``: the geometry of the family's K/V layers (all 0 when no
    layer keeps K/V; of the largest layer for a heterogeneous config). A layer
    that keeps no cache (``block.call.cache_argument: null``) has its inputs kept instead: one head of
    wire-width (`distconf.loader.wire_layout.wire_width_of`) key values and no value values
    (`distconf.blocks.adapter.BlockAdapter.forward`).
    """
    family = type(config).family_spec
    if not any_layer_keeps_kv(config) or (layer_idx is not None and not keeps_kv_at(config, layer_idx)):
        return KVGeometry(0, 0, 0, 0)
    if family.block.call.cache_argument is None:  # the block keeps the layer's inputs: one "head" of them
        hidden = _value(config, "hidden_size", None, lambda: wire_width_of(config))  # its inputs, as on the wire
        return KVGeometry(1, hidden, 0, hidden)
    overrides = family.kv_cache.layer_overrides
    if layer_idx is None and is_heterogeneous(config):  # sizes per layer: the largest layer's
        layers = [i for i in range(config.num_hidden_layers) if keeps_kv_at(config, i)]
        return max((kv_geometry(config, i) for i in layers), key=lambda g: g.values_per_token)
    if layer_idx is None:  # the largest of the family's geometries (what a K/V block keeps at most)
        kinds = [None, *overrides]
        return max((_geometry(config, kind) for kind in kinds), key=lambda g: g.values_per_token)
    by_kind = overrides or family.kv_cache.indexer_layer_kinds is not None
    kind = layer_type(config, layer_idx) if by_kind else None
    return _geometry(layer_config(config, layer_idx), kind, _indexer_kind(config, layer_idx, kind))


def _indexer_kind(config: DistributedConfig, layer_idx: int, kind: str | None) -> str | None:
    """The kind ``kv_cache.indexer_layer_kinds`` names for layer ``layer_idx``: its entry in
    ``kv_cache.indexer_types_field`` when the family names one, else its layer type."""
    field = type(config).family_spec.kv_cache.indexer_types_field
    if field is None:
        return kind
    values = getattr(config, field, None)
    if not isinstance(values, (list, tuple)) or len(values) <= layer_idx:
        raise ConfigValueError(f"family {_family(config)!r}: kv_cache.indexer_types_field {field!r} is not a list "
                               f"with an entry for layer {layer_idx}")
    return str(values[layer_idx])


def _geometry(config: DistributedConfig, kind: str | None, indexer_kind: str | None = None) -> KVGeometry:
    """The KV geometry of the family's section, with the overrides of layer type ``kind`` (None: none); the
    indexer cache counts on a layer of indexer kind ``indexer_kind`` (`_indexer_kind`; None: counted)."""
    spec = type(config).family_spec.kv_cache
    override = spec.layer_overrides.get(kind) if kind is not None else None

    def field(name: str) -> tuple[str, Any]:
        value = getattr(override, name) if override is not None else None
        if value is not None:
            return f"layer_overrides.{kind}.{name}", value
        return name, getattr(spec, name)

    heads = _value(config, *field("num_kv_heads"), lambda: config.num_attention_heads // config.num_key_value_groups)
    key_dim = _value(config, *field("key_head_dim"), lambda: _default_head_dim(config))
    value_dim = _value(config, *field("value_head_dim"), lambda: key_dim)
    indexer_here = (spec.indexer_layer_kinds is None or indexer_kind is None
                    or indexer_kind in spec.indexer_layer_kinds)
    indexer = 0 if spec.indexer_head_dim is None or not indexer_here else _value(
        config, "indexer_head_dim", spec.indexer_head_dim, int)
    total = _value(config, *field("values_per_token"), lambda: heads * (key_dim + value_dim) + indexer)
    return KVGeometry(heads * spec.sublayers, key_dim, value_dim, total * spec.sublayers, indexer)


class _EveryLayer:
    """``cache.layers``: whatever index a layer reads, its block's own cache object."""

    def __init__(self, cache: BlockKVCache) -> None:
        self.cache = cache

    def __getitem__(self, index: Any) -> BlockKVCache:
        return self.cache


class BlockKVCache:
    """The cache object a block passes to its layer for one forward call.

    It implements the part of the transformers ``Cache`` interface attention layers
    use (``update``, ``get_seq_length``). Entries are stored as ``[batch, kv_heads,
    seq, head_dim]`` tensors holding only the real KV heads: when the layer writes every
    KV head repeated per query head (``layer_writes: repeat_interleave``), one copy is
    kept and the layer gets the expanded view back.
    """

    def __init__(self, past: tuple[Any, ...] | None, num_kv_heads: int, layer_writes: str,
                 keeps_indexer: bool = False) -> None:
        self.key, self.value = (past[0], past[1]) if past is not None else (None, None)
        self.indexer = past[2] if past is not None and len(past) > 2 else None
        self.keeps_indexer = keeps_indexer
        self.num_kv_heads = num_kv_heads
        self.layer_writes = layer_writes
        self.expansion = 1
        self.last_written: tuple[Any, Any] | None = None

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        """Tokens already cached."""
        return 0 if self.key is None else int(self.key.shape[-2])

    def get_mask_sizes(self, query_length: int, layer_idx: int | None = 0) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` of the keys `update` will return for ``query_length`` new tokens: every
        cached token is kept (a sliding window is applied by the block's mask), so the offset is 0."""
        return self.get_seq_length() + query_length, 0

    def get_query_offset(self, layer_idx: int | None = 0) -> int:
        """Position of the first new token: the tokens already cached."""
        return self.get_seq_length()

    def update(self, key_states: Any, value_states: Any, layer_idx: int | None = None,
               *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        """Append new entries; return the whole cache in the layout the layer wrote."""
        import torch

        self.last_written = (key_states, value_states)
        factor = 1
        if self.layer_writes == "repeat_interleave":
            written = key_states.shape[1]
            if written % self.num_kv_heads:
                raise ConfigValueError(
                    f"the layer wrote {written} heads, not a multiple of kv_cache.num_kv_heads={self.num_kv_heads}"
                )
            factor = written // self.num_kv_heads
            if factor > 1:
                key_states = key_states[:, ::factor]
                value_states = value_states[:, ::factor]
        self.expansion = factor
        if self.key is None:
            self.key, self.value = key_states.contiguous(), value_states.contiguous()
        else:
            self.key = torch.cat([self.key, key_states], dim=-2)
            self.value = torch.cat([self.value, value_states], dim=-2)
        if factor > 1:
            return self.key.repeat_interleave(factor, dim=1), self.value.repeat_interleave(factor, dim=1)
        return self.key, self.value

    def update_indexer(self, indexer_keys: Any, layer_idx: int | None = None, *args: Any, **kwargs: Any) -> Any:
        """Append a sparse-attention indexer's keys ``[batch, tokens, dim]``; return all of them."""
        import torch

        self.indexer = indexer_keys if self.indexer is None else torch.cat([self.indexer, indexer_keys], dim=1)
        return self.indexer

    def update_index(self, indexer_keys: Any) -> Any:
        """The same for a model's own cache layer API (``cache.layers[i].update_index``): one-head keys
        ``[batch, 1, tokens, dim]``, kept as ``[batch, tokens, dim]``."""
        return self.update_indexer(indexer_keys[:, 0]).unsqueeze(1)

    @property
    def layers(self) -> Any:
        """Every cache layer of this block's layer is this object (a layer indexing ``cache.layers[i]`` for its
        indexer cache reaches `update_index`); only a block keeping an indexer has them."""
        if not self.keeps_indexer:
            raise AttributeError("layers")
        return _EveryLayer(self)

    @property
    def present(self) -> tuple[Any, ...] | None:
        """The cache to hand back to the caller: ``(key, value)`` (``(key, value, indexer)`` when the layer keeps
        an indexer cache), or None if empty."""
        if self.key is None:
            return None
        return (self.key, self.value) if self.indexer is None else (self.key, self.value, self.indexer)
