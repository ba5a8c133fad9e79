"""Family-file models describing a block (one decoder layer); its KV cache is `distconf.loader.spec_kv`.

These sections are what a server reads to build, load, run and size a block. Every
knob is generic: a family describes *how* its decoder layer is built and called, the
adapter in `distconf.blocks` never branches on a family name.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from distconf.loader.spec_position import PositionSpec
from distconf.loader.spec_stack import LayerStackSpec
from distconf.loader.spec_types import ClassPath, FormulaText, Identifier, ScalarValue, StrictModel
from distconf.loader.spec_wire import CarriedArgument

__all__ = [
    "BlockSpec", "ConstructorSpec", "CallSpec", "MaskSpec", "MaskKind", "MaskEntry",
]

_PREFIX = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$"

MaskKind = Literal["causal", "sliding_window", "chunked", "none"]
MaskEntry = Literal["attention", "padding", "none"]


class ConstructorSpec(StrictModel):
    """How the decoder layer's constructor is called: ``layer_class(**arguments)``."""

    config_argument: Identifier = Field(
        default="config", description="Name of the constructor argument that receives the config."
    )
    layer_idx_argument: Identifier | None = Field(
        default="layer_idx",
        description="Name of the constructor argument that receives the layer index (null: the layer takes none).",
    )
    extra: dict[Identifier, FormulaText] = Field(
        default_factory=dict,
        description="More keyword arguments, each a formula over config fields, evaluated per config.",
    )
    layer_type_argument: Identifier | None = Field(
        default=None,
        description="Name of the constructor argument that receives the layer's type (its entry in "
                    "mask.layer_types_field), for a layer class that builds its mixer from it (null: none).",
    )
    from_model: bool = Field(
        default=False,
        description="Take each block's layer from the model built on the meta device instead of constructing "
                    "layer_class: for a model that assembles its layers from modules of its own (hybrid layers "
                    "wrapping shared attention); tensors the model ties to another layer's load from that layer's.",
    )


class CallSpec(StrictModel):
    """How the decoder layer's ``forward`` is called (names of its keyword arguments).

    A name set to null means the layer does not take that input. The layer's output
    may be a tensor or a tuple whose first element is the hidden states.
    """

    cache_argument: Identifier | None = Field(
        default="cache",
        description="Keyword receiving the KV cache object (whose .update(key, value, layer_idx) the "
                    "attention calls), e.g. 'cache' or 'layer_past'. null: the layer keeps no cache (its "
                    "forward takes none); the block then keeps the layer's input hidden states (hidden_size "
                    "values per token, in place of K/V) and reruns the whole sequence at every step.",
    )
    mask_argument: Identifier | None = Field(
        default="attention_mask", description="Keyword receiving the 4D attention mask (or None)."
    )
    position_ids_argument: Identifier | None = Field(
        default="position_ids", description="Keyword receiving the position ids [1, seq]."
    )
    position_embeddings_argument: Identifier | None = Field(
        default="position_embeddings",
        description="Keyword receiving the rotary (cos, sin) pair; passed only when the block uses rotary positions.",
    )
    alibi_argument: Identifier | None = Field(
        default=None,
        description="Keyword receiving the ALiBi bias [batch*heads, 1, kv_len]; when set, it is always passed "
                    "(None when the block does not use ALiBi for this config).",
    )
    layer_idx_argument: Identifier | None = Field(
        default=None,
        description="Keyword receiving the layer's index in the model, for a layer whose forward takes it (null: "
                    "none).",
    )
    carried_arguments: dict[Identifier, CarriedArgument] = Field(
        default_factory=dict,
        description="Keyword -> what the block passes for a value the model hands each layer from the layer "
                    "before (the block is handed hidden states only): e.g. the top-k key indices a layer without "
                    "an indexer of its own reuses.",
    )
    extra: dict[Identifier, ScalarValue] = Field(
        default_factory=dict, description="Constant keyword arguments passed on every call (e.g. use_cache: true)."
    )
    fresh_arguments: dict[Identifier, ClassPath] = Field(
        default_factory=dict,
        description="Keyword -> class the block instantiates (no arguments) on every call and passes to the "
                    "layer: an empty container the model makes once per forward and hands all its layers (e.g. "
                    "transformers' KVSharingDict, where a layer stores its K/V for later layers sharing them). "
                    "Each block's layer gets its own, so nothing one layer stores reaches another: right only "
                    "when no layer reads what another stored, which `distconf check` proves on the tiny model.",
    )


class MaskSpec(StrictModel):
    """Which attention mask each layer gets (built with transformers' own mask functions)."""

    kind: MaskKind = Field(
        default="causal",
        description="Mask of every layer not covered by layer_types_field: 'causal', 'sliding_window' "
                    "(causal and at most `sliding_window` tokens back), 'chunked' (causal within "
                    "consecutive blocks of `chunk_size` tokens), or 'none' (the layer attends to nothing: a "
                    "recurrent, convolution or MLP-only layer, which gets None as its mask).",
    )
    sliding_window: FormulaText | None = Field(
        default=None,
        description="Window size of sliding-window layers, a formula over config fields (e.g. "
                    "'sliding_window'); required when any layer is a sliding-window layer. When it evaluates "
                    "to None the mask is plain causal.",
    )
    chunk_size: FormulaText | None = Field(
        default=None,
        description="Chunk size of chunked layers, a formula over config fields (e.g. 'attention_chunk_size'); "
                    "required when any layer is chunked. When it evaluates to None the mask is plain causal.",
    )
    layer_types_field: Identifier | None = Field(
        default=None,
        description="Config field holding a list with one type per layer (e.g. 'layer_types'); when the "
                    "config has it, the layer's entry is mapped to a mask kind through layer_kinds.",
    )
    layer_index_fields: dict[str, Identifier] = Field(
        default_factory=dict,
        description="Layer type -> config field listing the indices of the layers of that type (e.g. "
                    "cross_attention: cross_attention_layers), for configs that list layer indices rather than "
                    "one type per layer; it takes precedence over layer_types_field. A type not in layer_kinds "
                    "gets the mask `kind`.",
    )
    layer_kinds: dict[str, MaskKind] = Field(
        default_factory=lambda: {"full_attention": "causal", "sliding_attention": "sliding_window"},
        description="Layer type (value in layer_types_field) -> mask kind.",
    )
    boolean: Literal["masked", "attend"] | None = Field(
        default=None,
        description="The layer takes a boolean mask, made from the float mask as the model does: 'masked' = "
                    "True where a position is masked (mask.to(torch.bool) on the eager float mask), 'attend' "
                    "= True where it is attended. Null: the mask as the attention implementation builds it.",
    )
    allow_skip: bool = Field(
        default=True,
        description="Let transformers skip a plain causal mask for sdpa (None + is_causal). False always "
                    "materializes the mask, as models do that modify it afterwards.",
    )
    as_dict: dict[str, MaskEntry] = Field(
        default_factory=dict,
        description="The layer takes its mask argument as a dict (e.g. {causal: attention, conv: padding}): "
                    "key -> what it holds: 'attention' (the layer's attention mask, as built for its kind), "
                    "'padding' (the [batch, tokens] padding mask of this call's tokens, True = a real token; "
                    "None for a call whose rows are not padded) or 'none' (None). Empty: the mask itself.",
    )

    @model_validator(mode="after")
    def _window_given(self) -> MaskSpec:
        uses_window = self.kind == "sliding_window" or (
            self.layer_types_field is not None and "sliding_window" in self.layer_kinds.values())
        if uses_window and self.sliding_window is None:
            raise ValueError("sliding-window layers need sliding_window (a formula such as 'sliding_window')")
        uses_chunks = self.kind == "chunked" or (
            self.layer_types_field is not None and "chunked" in self.layer_kinds.values())
        if uses_chunks and self.chunk_size is None:
            raise ValueError("chunked layers need chunk_size (a formula such as 'attention_chunk_size')")
        return self


class BlockSpec(StrictModel):
    """The decoder layer a server hosts as one block, where its weights live, and how it is run."""

    layer_class: ClassPath = Field(description="Decoder-layer class a server instantiates for one block.")
    layer_classes: dict[str, ClassPath] = Field(
        default_factory=dict,
        description="Layer type (value of mask.layer_types_field) -> decoder-layer class, for models whose "
                    "layers of different types are different classes (e.g. an attention layer class and a "
                    "state-space layer class); layers of other types are layer_class.",
    )
    adapter: ClassPath = Field(
        default="distconf.blocks.make_block_class",
        description="Factory building the served block class from the distributed config class; the "
                    "default wraps layer_class in distconf's generic adapter. Resolved on first use of "
                    "the config class's block_class, like every class path in a family file.",
    )
    attention_class: ClassPath = Field(
        description="Attention class inside the layer (decides the KV-cache layout)."
    )
    attention_classes: dict[str, ClassPath] = Field(
        default_factory=dict,
        description="Layer type -> the attention class inside layers of that type, where a type's own "
                    "decoder-layer class (layer_classes) holds another attention class than attention_class.",
    )
    prefix: str = Field(
        pattern=_PREFIX,
        description="State-dict prefix of the layers: tensors of layer i start with '{prefix}.{i}.'.",
    )
    modules_field: Identifier | None = Field(
        default=None,
        description="Config field counting the model's layer modules, for a model whose every module holds "
                    "several attention sublayers and whose num_hidden_layers counts the sublayers (e.g. "
                    "'num_layers'). A swarm serves one block per module: the family's config then reads "
                    "num_hidden_layers from this field, and kv_cache.sublayers says how many sublayers cache.",
    )
    config_section: Identifier | None = Field(
        default=None,
        description="Config field holding the sub-config of the served layer stack, for a model built of "
                    "several stacks each sized by a nested sub-config and whose config counts no layers at its "
                    "top level (e.g. 'global_config'). The family's config reads every attribute its top level "
                    "lacks (num_hidden_layers, hidden_size, head counts...) from that sub-config.",
    )
    base_model_prefix: str | None = Field(
        default=None, pattern=_PREFIX,
        description="The architecture's base-model prefix (e.g. 'transformer', 'model'). Checkpoints may "
                    "store layer tensors with or without it ('transformer.h.0.' and 'h.0.'); both are accepted.",
    )
    checkpoint_conversion: Literal["transformers", "none"] = Field(
        default="transformers",
        description="'transformers': apply the checkpoint conversion rules transformers registers for the "
                    "model_type (e.g. per-expert MoE tensors merged into fused expert parameters); tensors "
                    "already named like the layer's parameters load as they are. 'none': names must match.",
    )
    attn_implementation: Literal["sdpa", "eager"] | None = Field(
        default=None,
        description="Attention implementation the layer really uses, for layers that support only one "
                    "(e.g. 'eager'); the block then always builds its mask in that format. Null: the "
                    "config's own (set to 'sdpa' when the config has none).",
    )
    constructor: ConstructorSpec = Field(
        default_factory=ConstructorSpec, description="Arguments of the layer's constructor."
    )
    model_buffers: dict[str, ClassPath] = Field(
        default_factory=dict,
        description="Buffers the model registers on each layer after building it (not in checkpoints): "
                    "'submodule.buffer' (a path inside the layer) -> a function of the config returning the "
                    "tensor (e.g. mamba.mup_vector: a module's compute_mup_vector). The block registers them "
                    "the same way, as non-persistent buffers.",
    )
    call: CallSpec = Field(default_factory=CallSpec, description="Keyword arguments of the layer's forward.")
    position: PositionSpec = Field(
        default_factory=PositionSpec, description="Rotary / ALiBi / no position handling inside the block."
    )
    mask: MaskSpec = Field(default_factory=MaskSpec, description="Attention mask kind, per layer if needed.")
    layer_stack: LayerStackSpec | None = Field(
        default=None,
        description="How the model runs its layer list when not each layer once in order (a looped range of "
                    "layers, served unrolled: one block per layer the forward pass runs).",
    )
    skipped_layer_kinds: list[str] = Field(
        default_factory=list,
        description="Layer types the model skips when it gets no input besides the hidden states (e.g. "
                    "cross-attention layers without image features): a swarm carries hidden states only, so "
                    "blocks of these types pass them through unchanged and keep no cache. Their weights still "
                    "load (the block is the layer), so a checkpoint's tensors of those layers are accepted.",
    )

    @field_validator("skipped_layer_kinds")
    @classmethod
    def _skipped_kinds_named(cls, kinds: list[str], info: ValidationInfo) -> list[str]:
        mask = info.data.get("mask")
        if not kinds or mask is None:
            return kinds
        if mask.layer_types_field is None and not mask.layer_index_fields:
            raise ValueError("skipped_layer_kinds needs mask.layer_types_field or mask.layer_index_fields (which "
                             "config field says each layer's type)")
        known = set(mask.layer_kinds) | set(mask.layer_index_fields)
        unknown = [k for k in kinds if k not in known]
        if unknown:
            raise ValueError(f"names {', '.join(map(repr, unknown))}, a type neither mask.layer_kinds nor "
                             f"mask.layer_index_fields names (they name {', '.join(map(repr, sorted(known)))})")
        return kinds

    @model_validator(mode="after")
    def _layer_types_for_classes(self) -> BlockSpec:
        typed = self.mask.layer_types_field is not None or bool(self.mask.layer_index_fields)
        if self.attention_classes and not set(self.attention_classes) <= set(self.layer_classes):
            raise ValueError("attention_classes names layer types layer_classes does not: "
                             f"{', '.join(sorted(set(self.attention_classes) - set(self.layer_classes)))}")
        if self.layer_classes and not typed:
            raise ValueError("layer_classes needs mask.layer_types_field (the config field listing each layer's type) "
                             "or mask.layer_index_fields")
        if self.constructor.layer_type_argument and self.mask.layer_types_field is None:
            raise ValueError("constructor.layer_type_argument needs mask.layer_types_field (the config field "
                             "listing each layer's type)")
        return self

    @model_validator(mode="after")
    def _keyword_for_dict_mask(self) -> BlockSpec:
        if self.mask.as_dict and self.call.mask_argument is None:
            raise ValueError("mask.as_dict needs call.mask_argument (the keyword the layer takes its mask as)")
        return self

    @model_validator(mode="after")
    def _layer_types_for_rotary(self) -> BlockSpec:
        if self.position.rotary_layer_type_argument and self.mask.layer_types_field is None:
            raise ValueError("position.rotary_layer_type_argument needs mask.layer_types_field "
                             "(the config field listing each layer's type)")
        return self
