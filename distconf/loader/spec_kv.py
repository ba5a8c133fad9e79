"""Family-file models describing the KV cache of a block: its geometry per token, per layer type, and how the
attention hands entries over (``distconf check`` proves them against what a block really caches)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from distconf.loader.spec_types import Identifier, IntOrFormula, StrictModel

__all__ = ["KVCacheSpec", "KVGeometryOverride", "SharedKVSpec"]


class SharedKVSpec(StrictModel):
    """K/V that later layers reuse from an earlier layer instead of computing their own (Gemma 3n's KV sharing).

    The model hands every layer one container (``argument``, a ``block.call.fresh_arguments`` entry): a layer
    whose entry in ``modes_field`` is ``store`` puts its keys and values there under its layer type (the value
    of ``block.mask.layer_types_field``), and a later ``reuse`` layer of that type attends with them. Blocks
    may sit on different servers, so the wire carries each stored type's keys and values of the step's new
    tokens (``values_per_token`` each, after the hidden state and its carried values, zeros until stored); a
    reuse layer's block appends them to its own K/V cache and hands the layer the whole. Every reuse layer so
    keeps a copy, sized as its K/V geometry says: sessions, beams, rewinds and failover hold as for any K/V.
    """

    argument: Identifier = Field(description="The layers' keyword of the container (a block.call.fresh_arguments "
                                             "entry, e.g. shared_kv_states).")
    modes_field: Identifier = Field(description="Config attribute listing each layer's sharing mode (e.g. "
                                                "kv_sharing_modes: null, store or reuse per layer).")
    values_per_token: IntOrFormula | dict[str, IntOrFormula] = Field(
        description="Key and value entries per token a storing layer hands on (num_kv_heads * (key_head_dim + "
                    "value_head_dim), e.g. 2 * num_key_value_heads * head_dim), or that per layer type.")
    store: str = Field(default="store", description="The mode of a layer that stores its K/V for later layers.")
    reuse: str = Field(default="reuse", description="The mode of a layer that attends with a stored K/V.")


class KVGeometryOverride(StrictModel):
    """KV geometry of the layers of one type, where it differs from the family's (e.g. sliding-window layers
    with twice the KV heads); a field left out keeps the kv_cache section's value."""

    num_kv_heads: IntOrFormula | None = Field(default=None, description="KV heads kept by a layer of this type.")
    key_head_dim: IntOrFormula | None = Field(default=None, description="Size of one key head.")
    value_head_dim: IntOrFormula | None = Field(default=None, description="Size of one value head.")
    values_per_token: IntOrFormula | None = Field(default=None, description="Override of the whole count.")


class KVCacheSpec(StrictModel):
    """KV-cache geometry of one block: values kept per token, and how the layer hands them over.

    Values per token per block = ``values_per_token`` if given, else
    ``num_kv_heads * (key_head_dim + value_head_dim) + indexer_head_dim``. It must equal what the block
    really caches (``distconf check`` verifies it).
    """

    num_kv_heads: IntOrFormula | None = Field(
        default=None,
        description="KV heads kept per block; default num_attention_heads // num_key_value_groups.",
    )
    key_head_dim: IntOrFormula | None = Field(
        default=None,
        description="Size of one key head; default the config's head_dim when it has one (not None), "
                    "else hidden_size // num_attention_heads.",
    )
    value_head_dim: IntOrFormula | None = Field(
        default=None, description="Size of one value head; default key_head_dim."
    )
    values_per_token: IntOrFormula | None = Field(
        default=None,
        description="Override of the whole count (e.g. latent attention caching kv_lora_rank + "
                    "qk_rope_head_dim); when set the head fields are only used to lay out the cache.",
    )
    layer_kinds: list[str] | None = Field(
        default=None, min_length=1,
        description="Layer types (values of block.mask.layer_types_field) whose layers keep a KV cache, in a "
                    "family whose layers differ (recurrent, hybrid, MLP-only layers). Null: every layer that "
                    "keeps no `state` (every layer of a family without a state section).",
    )
    indexer_head_dim: IntOrFormula | None = Field(
        default=None,
        description="Values per token of the key cache a sparse-attention indexer keeps next to K/V (the layer "
                    "calls cache.update_indexer with [batch, tokens, indexer_head_dim] keys), e.g. "
                    "'index_head_dim'. Null: no indexer cache.",
    )
    indexer_layer_kinds: list[str] | None = Field(
        default=None, min_length=1,
        description="Layer types (values of block.mask.layer_types_field) whose layers keep the indexer cache, "
                    "when only some K/V layers have an indexer (sparse-attention layers next to dense ones). "
                    "Null: every K/V layer keeps one.",
    )
    indexer_types_field: Identifier | None = Field(
        default=None,
        description="Config field listing each layer's indexer kind (e.g. indexer_types: full / shared), when it, "
                    "not block.mask.layer_types_field, tells which layers keep the indexer cache; "
                    "indexer_layer_kinds then names its values. Null: the mask's layer types.",
    )
    layer_overrides: dict[str, KVGeometryOverride] = Field(
        default_factory=dict,
        description="Layer type (value of block.mask.layer_types_field) -> the KV geometry of layers of that type "
                    "where it differs (fields left out keep this section's values).",
    )
    sublayers: int = Field(
        default=1, ge=1,
        description="Attention sublayers of one block that each keep their own K/V of the geometry above (a "
                    "layer module calling the cache with several layer indices); the block keeps them side by "
                    "side along the head axis, so it caches this many times the values per token.",
    )
    shared: SharedKVSpec | None = Field(
        default=None,
        description="K/V later layers reuse from an earlier layer (SharedKVSpec), carried on the wire between "
                    "blocks. Null: every K/V layer computes its own.",
    )
    layer_writes: Literal["kv_heads", "repeat_interleave"] = Field(
        default="kv_heads",
        description="How the attention hands new entries to the cache: 'kv_heads' = one entry per KV head; "
                    "'repeat_interleave' = every KV head repeated once per query head of its group "
                    "(consecutively); the block then stores one copy (num_kv_heads heads) and expands it "
                    "again when handing the cache back.",
    )

    @model_validator(mode="after")
    def _indexer_field_names_kinds(self) -> KVCacheSpec:
        if self.indexer_types_field is not None and self.indexer_layer_kinds is None:
            raise ValueError("kv_cache.indexer_types_field needs kv_cache.indexer_layer_kinds (the values of that "
                             "field whose layers keep the indexer cache)")
        return self
