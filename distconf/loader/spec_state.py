"""Family-file model of the per-sequence state a block keeps instead of a KV cache.

Recurrent and state-space layers (convolution + SSM / linear-attention state) keep a
fixed-size state per sequence, whatever its length: the family's ``state`` section gives
its shapes as formulas over config fields, so a server sizes it (bytes per sequence, not
per token), and the block's cache object hands it to the layer the way transformers'
cache does (``get_conv_state`` / ``update_conv_state``, ``get_recurrent_state`` /
``update_recurrent_state``). A layer keeping several conv (or recurrent) states, one per cache
``state_idx``, gives a list of shapes instead of one shape.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from distconf.loader.spec_types import IntOrFormula, StrictModel

__all__ = ["StateSpec", "StateMethods", "StateList", "StateOverride", "ModuleAttributes", "Shapes"]

AttributePath = Annotated[str, Field(pattern=r"^[A-Za-z][A-Za-z0-9_]*(\.[A-Za-z][A-Za-z0-9_]*)*$")]
"""A dotted attribute path below the layer module (``temporal_block.rg_lru.recurrent_states``; no private names)."""
Shape = list[IntOrFormula]
Shapes = Shape | list[Annotated[Shape, Field(min_length=1)]]
"""One shape (a list of entries), or a list of shapes: one per cache ``state_idx`` (0, 1, ...)."""


def _shapes(value: Shapes | None) -> list[Shape]:
    """The shapes of a ``conv_shape`` / ``recurrent_shape`` field: one per ``state_idx`` (none for null)."""
    if value is None:
        return []
    if value and all(isinstance(entry, list) for entry in value):
        return list(value)  # type: ignore[arg-type]
    return [value]  # type: ignore[list-item]


class StateMethods(StrictModel):
    """Methods of its own cache the layer calls to read and write its recurrent state (instead of
    ``get_recurrent_state`` / ``update_recurrent_state``): the block's cache answers them with the session's state."""

    get: str = Field(description="Method the layer calls with its layer index to read its recurrent state "
                                 "(the block answers None before the first step).")
    set: str = Field(description="Method the layer calls with its layer index and the new recurrent state (the "
                                 "one tensor argument) to keep it.")


class StateList(StrictModel):
    """A layer given its state as a list of the model's per-layer tensors ``[batch, size, num_hidden_layers]`` (under
    ``block.call.cache_argument``), of which it reads and writes its own slice ``[..., layer_idx]``.

    The block builds that list from the session's state and collects its slice back: the first
    ``conv_entries`` entries (kept in the block's dtype) form the conv state ``[conv_entries, size]``,
    the others the recurrent state ``[entries, size]``.
    """

    conv_entries: int = Field(default=0, ge=0, description="How many leading entries of the list are kept in the "
                                                           "block's dtype (the conv state); the rest are recurrent.")
    initial: list[float] = Field(min_length=1, description="The value each entry holds before the first token "
                                                           "(the model's initial state), one per entry.")


class ModuleAttributes(StrictModel):
    """A layer whose modules keep their state in attributes of their own (no cache object): the attribute paths,
    below the layer module, of its conv states and of its recurrent states, one per shape of
    ``state.conv_shape`` / ``state.recurrent_shape`` (in order).

    Before each call the block sets them to its session's rows (zeros of the declared shapes before the first
    token), after it reads them back and clears them, so the modules hold nothing between calls.
    """

    conv: list[AttributePath] = Field(default_factory=list, description="Attribute paths of the conv states.")
    recurrent: list[AttributePath] = Field(default_factory=list,
                                           description="Attribute paths of the recurrent states.")


class StateOverride(StrictModel):
    """The state shapes of the layers of one type, where they differ from the section's (fields left out keep
    the section's); each lists as many states as the section's field."""

    conv_shape: Shapes | None = Field(default=None, min_length=1,
                                      description="The conv state shape(s) of this layer type (as state.conv_shape).")
    recurrent_shape: Shapes | None = Field(
        default=None, min_length=1, description="The recurrent state shape(s) of this layer type (as "
                                                "state.recurrent_shape).")


class StateSpec(StrictModel):
    """Per-sequence state of a recurrent block: a convolution window and/or a recurrent (SSM) state.

    Every layer of the family keeps this state and no KV cache, unless ``layer_kinds`` names the
    layer types that do (a hybrid family). Bytes per sequence per block =
    ``prod(conv_shape) x bytes(block dtype) + prod(recurrent_shape) x bytes(recurrent_dtype)``, summed over
    the states when a field lists several shapes (one per cache ``state_idx``).
    ``distconf check`` verifies the shapes against what the layer really keeps.
    """

    conv_shape: Shapes | None = Field(
        default=None, min_length=1,
        description="Shape of the convolution state of one sequence (e.g. [channels, conv_kernel]), each entry "
                    "an integer or a formula over config fields; the layer reads it with get_conv_state and "
                    "writes it with update_conv_state. A list of shapes (e.g. [[channels, kernel], [hidden, "
                    "kernel]]) when the layer keeps several, one per state_idx. Null: no convolution state.",
    )
    recurrent_shape: Shapes | None = Field(
        default=None, min_length=1,
        description="Shape of the recurrent (SSM / linear-attention) state of one sequence (e.g. [num_heads, "
                    "head_dim, state_size]); read with get_recurrent_state, written with update_recurrent_state "
                    "(or in place). A list of shapes when the layer keeps several, one per state_idx. Null: "
                    "the layer keeps no recurrent state.",
    )
    recurrent_dtype: Literal["block", "float32"] = Field(
        default="block",
        description="dtype the layer keeps its recurrent state in: 'block' (the block's dtype) or 'float32' "
                    "(layers whose scan accumulates in float32 whatever the weights' dtype).",
    )
    conv_dtype: Literal["block", "float32"] = Field(
        default="block",
        description="dtype the layer keeps its convolution states in: 'block' (the block's dtype) or 'float32' "
                    "(layers that run their short convolutions in float32 whatever the weights' dtype).",
    )

    layer_kinds: list[str] | None = Field(
        default=None, min_length=1,
        description="Layer types (values of block.mask.layer_types_field) whose layers keep this state, in a "
                    "hybrid family (the others keep a KV cache, see kv_cache.layer_kinds, or nothing). Null: "
                    "every layer keeps it.",
    )
    layer_overrides: dict[str, StateOverride] = Field(
        default_factory=dict,
        description="Layer type (value of block.mask.layer_types_field) -> the state shapes of layers of that type "
                    "where they differ (e.g. conv windows sized by KV heads that differ per type).",
    )
    continuation: Literal["any_length", "one_token"] = Field(
        default="any_length",
        description="How the layer continues from an earlier state: 'any_length' (a step of several tokens "
                    "starts from the state, as chunked scans do) or 'one_token' (the layer reads its state "
                    "only in one-token steps; the block then feeds a longer step one token at a time).",
    )

    recurrent_methods: StateMethods | None = Field(
        default=None,
        description="When the layer keeps its recurrent state through methods of a cache class of its own "
                    "(an attribute of that cache outside transformers' cache layers): their names. Null: the "
                    "layer uses get_recurrent_state / update_recurrent_state.",
    )
    layer_list: StateList | None = Field(
        default=None,
        description="When the layer takes its state as a list of the model's [batch, size, layers] tensors (see "
                    "StateList). Null: the layer gets a cache object.",
    )
    returned_tuple: bool = Field(
        default=False,
        description="The layer takes its states as one tuple under block.call.cache_argument (None before the "
                    "first token; the conv states, then the recurrent ones) and returns the new tuple as its "
                    "output's second entry, instead of keeping them in a cache object. False: it gets a cache.",
    )
    module_attributes: ModuleAttributes | None = Field(
        default=None,
        description="When the layer's modules keep their states in attributes of their own (see "
                    "ModuleAttributes). Null: the layer gets its state through a cache object.",
    )
    counts_positions: bool = Field(
        default=False,
        description="The layer reads true positions (e.g. it resets its state at position 0): the block keeps the "
                    "tokens each sequence has seen next to its state (one int64 per sequence, the state's last "
                    "entry) and gives a layer keeping no K/V its positions from it. False: such a layer gets "
                    "positions from 0 at every step.",
    )
    one_token_rows: Literal["together", "one_at_a_time"] = Field(
        default="together",
        description="How the block runs a one-token step after an earlier state: 'together' (all rows in one "
                    "call) or 'one_at_a_time' (a layer whose one-token step is right for one row only, e.g. "
                    "one broadcasting its state's rows against its input's).",
    )

    @property
    def conv_shapes(self) -> list[Shape]:
        """The convolution states' shapes, one per ``state_idx`` (empty: none kept)."""
        return _shapes(self.conv_shape)

    @property
    def recurrent_shapes(self) -> list[Shape]:
        """The recurrent states' shapes, one per ``state_idx`` (empty: none kept)."""
        return _shapes(self.recurrent_shape)

    @property
    def slots(self) -> tuple[int, int]:
        """Entries of the state part of a block's past: conv states, then recurrent states (at least one each,
        None when the family keeps no such state), so a one-state family's past stays ``(conv, recurrent)``."""
        return max(1, len(self.conv_shapes)), max(1, len(self.recurrent_shapes))

    @property
    def width(self) -> int:
        """Entries of the state part of a block's past: the `slots`, then the token count (``counts_positions``)."""
        return sum(self.slots) + int(self.counts_positions)

    def shapes_for(self, kind: str, layer_type: str | None) -> list[Shape]:
        """The ``kind`` (``conv`` / ``recurrent``) shapes of layers of ``layer_type`` (None: the section's)."""
        override = self.layer_overrides.get(layer_type) if layer_type is not None else None
        listed = getattr(override, f"{kind}_shape") if override is not None else None
        return _shapes(listed) if listed is not None else _shapes(getattr(self, f"{kind}_shape"))

    @model_validator(mode="after")
    def _some_state(self) -> StateSpec:
        if self.conv_shape is None and self.recurrent_shape is None:
            raise ValueError("state needs conv_shape, recurrent_shape or both")
        attributes = self.module_attributes
        if attributes is not None:
            for field in ("conv", "recurrent"):
                paths, shapes = getattr(attributes, field), _shapes(getattr(self, f"{field}_shape"))
                if len(paths) != len(shapes):
                    raise ValueError(f"state.module_attributes.{field} names {len(paths)} attributes, "
                                     f"state.{field}_shape declares {len(shapes)} states (one attribute each)")
            others = [name for name in ("recurrent_methods", "layer_list") if getattr(self, name) is not None]
            if others or self.returned_tuple:
                raise ValueError("state.module_attributes: the layer's modules keep the state themselves, so "
                                 f"{', '.join(others) or 'returned_tuple'} cannot be set besides")
        for kind, override in self.layer_overrides.items():
            for field in ("conv", "recurrent"):
                listed = getattr(override, f"{field}_shape")
                if listed is not None and len(_shapes(listed)) != len(_shapes(getattr(self, f"{field}_shape"))):
                    raise ValueError(f"state.layer_overrides.{kind}.{field}_shape lists {len(_shapes(listed))} "
                                     f"shapes, state.{field}_shape {len(_shapes(getattr(self, f'{field}_shape')))}"
                                     " (every layer keeps as many states)")
        return self
