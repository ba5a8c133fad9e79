"""Family-file models of how positions enter a block: rotary embeddings, ALiBi, values computed outside the layers.

Part of `distconf.loader.spec_block`'s ``block`` section (``block.position``).
"""

from __future__ import annotations

from pydantic import Field, model_validator

from distconf.loader.spec_types import ClassPath, FormulaText, Identifier, StrictModel

__all__ = ["PositionSpec", "ComputedArgument"]


class ComputedArgument(StrictModel):
    """A keyword argument the model computes from the position ids for its layers (outside them)."""

    function: ClassPath = Field(
        description="Function called as function(position_ids) with the positions [batch, seq] of the step; "
                    "its result goes unchanged to the layer's keyword (e.g. a no-rotary layer's "
                    "position-dependent query scaling).",
    )
    layer_kinds: list[str] | None = Field(
        default=None,
        description="Layer types (values of block.mask.layer_types_field) that get the value; the others "
                    "get None. Null: every layer.",
    )


class PositionSpec(StrictModel):
    """How positions enter the layer: rotary embeddings, ALiBi, or nothing (e.g. learned, outside blocks)."""

    rotary_class: ClassPath | None = Field(
        default=None,
        description="Rotary-embedding module built as rotary_class(config=config) on the device of the "
                    "hidden states and called as rotary(hidden_states, position_ids); its result (e.g. "
                    "(cos, sin), or complex frequencies) goes unchanged to call.position_embeddings_argument.",
    )
    rotary_keys: dict[Identifier, str] | None = Field(
        default=None,
        description="The layer takes a dict of rotary embeddings (one per rotary type) in place of one result: key "
                    "-> the rotary type rotary_class computes it for, passed as a third argument "
                    "(rotary(hidden_states, position_ids, type)). Null: one result.",
    )
    rotary_layer_type_argument: bool = Field(
        default=False,
        description="Also pass the layer's type (from mask.layer_types_field) as a third argument to the "
                    "rotary module (per-layer-type rotary parameters).",
    )
    alibi_function: ClassPath | None = Field(
        default=None,
        description="Function alibi_function(mask_2d, num_heads, dtype) -> [batch*heads, 1, kv_len] building "
                    "the ALiBi bias (e.g. the model's own build_alibi_tensor).",
    )
    alibi_when: FormulaText | None = Field(
        default=None,
        description="Formula over config fields: true -> ALiBi, false -> rotary. Needed only when both "
                    "rotary_class and alibi_function are given.",
    )
    alibi_arguments: dict[Identifier, FormulaText] | None = Field(
        default=None,
        description="Calling convention of alibi_function for models that build an additive position bias "
                    "themselves (e.g. a bias passed as 'position_bias'): keyword arguments, each a formula "
                    "over config fields (see also alibi_length_argument). The function also gets "
                    "device=... when it takes a 'device' argument. Its result goes unchanged (any shape the "
                    "layer slices itself, e.g. [heads, 1, max_len]) to call.alibi_argument. Null: the "
                    "default convention alibi_function(mask_2d, num_heads, dtype) -> [batch*heads, 1, kv_len].",
    )
    alibi_length_argument: Identifier | None = Field(
        default=None,
        description="With alibi_arguments: the argument of alibi_function that receives the number of keys "
                    "the layer attends to (tokens cached + new), for functions that build the bias per length.",
    )
    alibi_in_mask: bool = Field(
        default=False,
        description="Also fold alibi / sqrt(key_head_dim) into a float attention mask, as models do that "
                    "pass the mask to scaled_dot_product_attention.",
    )
    rotary_layer_kinds: list[str] | None = Field(
        default=None,
        description="Layer types (values of block.mask.layer_types_field) that use the rotary embeddings; "
                    "the others get None as call.position_embeddings_argument (layers without positions, "
                    "NoPE). Null: every layer.",
    )
    computed_arguments: dict[Identifier, ComputedArgument] = Field(
        default_factory=dict,
        description="Keyword arguments the model computes from the position ids and passes to its layers "
                    "(positions computed outside the layers): keyword -> function and the layer types "
                    "that get it.",
    )
    relative_distance_argument: Identifier | None = Field(
        default=None,
        description="Keyword under which the layer takes each query's distance to each key, [queries, keys] "
                    "(the query's index minus the key's, over the cached and new tokens), which the model "
                    "computes once outside the layers. Null: none.",
    )
    max_positions: FormulaText | None = Field(
        default=None,
        description="Formula over config fields: the most positions a session may hold, where the blocks cannot "
                    "compute past it (e.g. an ALiBi table of max_seq_len entries). Clients never feed past "
                    "it (speculative drafts stop short of it) and the API counts it as the context length. "
                    "Null: no limit the blocks enforce.",
    )
    from_cache_length: bool = Field(
        default=False,
        description="Some layer of the family reads token positions from its cache's length rather than "
                    "from position ids (e.g. a no-rotary layer's attention-temperature scaling). Rows of one "
                    "block call then need equal cached lengths: a server computes sessions together only "
                    "when they stand at the same position.",
    )

    @model_validator(mode="after")
    def _alibi_when_needed(self) -> PositionSpec:
        if self.rotary_class and self.alibi_function and self.alibi_when is None:
            raise ValueError("with both rotary_class and alibi_function, alibi_when must say which one applies")
        if self.alibi_in_mask and not self.alibi_function:
            raise ValueError("alibi_in_mask needs alibi_function")
        if self.alibi_arguments is not None and not self.alibi_function:
            raise ValueError("alibi_arguments needs alibi_function")
        if self.alibi_length_argument is not None and self.alibi_arguments is None:
            raise ValueError("alibi_length_argument needs alibi_arguments")
        if self.alibi_arguments is not None and self.alibi_in_mask:
            raise ValueError("alibi_in_mask folds the default [batch*heads, 1, kv_len] bias; it cannot be "
                             "combined with alibi_arguments")
        if self.rotary_layer_type_argument and not self.rotary_class:
            raise ValueError("rotary_layer_type_argument needs rotary_class")
        if self.rotary_keys is not None and not self.rotary_class:
            raise ValueError("rotary_keys needs rotary_class")
        if self.rotary_keys is not None and self.rotary_layer_type_argument:
            raise ValueError("rotary_keys names the rotary type of each key; it excludes rotary_layer_type_argument")
        if self.rotary_keys is not None and not self.rotary_keys:
            raise ValueError("rotary_keys names no key: remove it (null: one rotary result)")
        if self.rotary_layer_kinds is not None and not self.rotary_class:
            raise ValueError("rotary_layer_kinds needs rotary_class")
        return self
