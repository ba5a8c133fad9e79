"""What the block adapter resolves once per layer from the family file's ``block`` section
(`LayerSettings`: its mask kind, window, position functions, KV geometry, what it keeps), and the
layout of rows of different lengths computed together (`RowLayout`)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

from distconf.blocks.kvcache import KVGeometry, kv_geometry
from distconf.blocks.layer_types import keeps_kv_at, keeps_state_at, layer_type, skipped_at
from distconf.blocks.past import BlockCapabilities
from distconf.blocks.stream_form import to_layer_form, to_wire_form
from distconf.loader.config_protocol import DistributedConfig
from distconf.loader.formula import FormulaError
from distconf.loader.kv_sharing import LayerSharing, layer_sharing
from distconf.loader.per_layer import layer_config
from distconf.loader.source import FamilySource
from distconf.loader.spec_block import BlockSpec
from distconf.loader.spec_wire import stream_axis_of, streams_of
from distconf.loader.synthesis import resolve_object
from distconf.loader.wire_layout import WireLayout, wire_layout

if TYPE_CHECKING:
    import torch

__all__ = ["LayerSettings", "RowLayout", "layer_settings", "evaluate_field"]


@dataclass(frozen=True)
class RowLayout:
    """Rows of one block call that have different lengths (sessions computed together).

    Rows are padded on the left, so every row's new tokens start at the same index:
    ``padding_mask`` ``[batch, past + seq]`` is True where a key is a real token, and
    ``position_ids`` ``[batch, seq]`` holds each row's own positions (rotary, chunks).
    """

    padding_mask: torch.Tensor
    position_ids: torch.Tensor


_NO_SHARING = LayerSharing(None, None)


@dataclass(frozen=True)
class LayerSettings:
    """What the adapter resolves once per layer; everything else is read from ``spec``."""

    spec: BlockSpec
    config: DistributedConfig
    layer_idx: int
    mask_kind: str
    sliding_window: int | None
    chunk_size: int | None
    rotary_class: type | None
    rotary_layer_type: str | None
    alibi_function: Any
    geometry: KVGeometry
    layer_writes: str
    alibi_takes_device: bool = False
    keeps_kv: bool = True
    keeps_state: bool = False
    one_token_steps: bool = False
    """The layer reads its state only in one-token steps (``state.continuation: one_token``)."""
    state_slots: tuple[int, int] = (1, 1)
    """Conv and recurrent states the layer keeps (``StateSpec.slots``): the state part of its past."""
    counts_positions: bool = False
    """The state part of its past ends with each sequence's token count (``state.counts_positions``)."""
    no_rotary: bool = False
    """The family has rotary embeddings, but not for this layer's type: it gets None."""
    computed_arguments: tuple[tuple[str, Any], ...] = ()
    """(keyword, function of the position ids or None) the model computes for its layers."""
    recomputes: bool = False
    """The layer keeps no cache (``block.call.cache_argument: null``): the block keeps its inputs and reruns them."""
    skipped: bool = False
    """The model skips this layer for hidden states alone (``block.skipped_layer_kinds``): the block passes them."""
    fresh_arguments: tuple[tuple[str, type], ...] = ()
    """(keyword, class) of the empty containers the layer gets anew on every call (``block.call.fresh_arguments``)."""
    streams: int = 1
    """Streams of hidden_size values the layer takes and returns (``hidden_state.streams``; 1: ``[B, S, H]``)."""
    stream_axis: int = 2
    """Where the streams sit in the layer's hidden state (``hidden_state.stream_axis``: 2 or 0)."""
    sharing: LayerSharing = _NO_SHARING
    """Whether the layer stores or reuses K/V shared across layers (``kv_cache.shared``), under which key."""
    wire: WireLayout | None = None
    """The parts of the wire the block splits and joins around its layer (`distconf.loader.wire_layout`)."""

    def layer_form(self, wire: torch.Tensor) -> torch.Tensor:
        """The wire's hidden state as the layer takes it (`distconf.blocks.stream_form.to_layer_form`)."""
        return to_layer_form(wire, self.streams, self.stream_axis)

    def wire_form(self, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's hidden state as the wire holds it (`distconf.blocks.stream_form.to_wire_form`)."""
        return to_wire_form(hidden, self.streams, self.stream_axis)

    @property
    def state_width(self) -> int:
        """Entries of the state part of the layer's past (``StateSpec.width``)."""
        return sum(self.state_slots) + int(self.counts_positions)

    @cached_property
    def capabilities(self) -> BlockCapabilities:
        """What the layer keeps between calls, as the server reads it (`distconf.blocks.past`)."""
        return BlockCapabilities(keeps_kv=self.keeps_kv, keeps_state=self.keeps_state, state_width=self.state_width,
                                 indexer_dim=self.geometry.indexer_head_dim if self.keeps_kv else 0,
                                 positions_from_cache_length=bool(self.spec.position.from_cache_length))

    @property
    def alibi_in_mask(self) -> bool:
        """ALiBi is folded into a float mask (and the mask is then always materialized)."""
        return self.spec.position.alibi_in_mask and self.alibi_function is not None


def _source(block_cls: type) -> FamilySource:
    """The family file of a block class (block classes carry it through their config class)."""
    return block_cls.config_class.family_source  # type: ignore[attr-defined]


def evaluate_field(block_cls: type, loc: tuple[str, ...], formula: Any, config: DistributedConfig,
                   layer_idx: int | None = None) -> Any:
    """``formula`` (the field at ``loc`` of the block class's family file) evaluated on ``config`` (on layer
    ``layer_idx``'s own config, `distconf.loader.per_layer.layer_config`); an error located at that field when it
    cannot be."""
    try:
        return formula.evaluate_on(layer_config(config, layer_idx))
    except FormulaError as exc:
        raise _source(block_cls).error(loc, str(exc)) from None


def layer_settings(block_cls: type, config: DistributedConfig, layer_idx: int) -> LayerSettings:
    """Resolve the family file's ``block`` section for layer ``layer_idx`` of ``config``."""
    spec = block_cls.family_spec
    block, position, mask = spec.block, spec.block.position, spec.block.mask
    kind_of_layer = layer_type(config, layer_idx)
    kind = mask.kind
    skipped = skipped_at(config, layer_idx)
    if skipped:
        kind = "none"
    elif kind_of_layer is not None and kind_of_layer in mask.layer_index_fields:
        kind = mask.layer_kinds.get(kind_of_layer, mask.kind)
    elif kind_of_layer is not None:
        if kind_of_layer not in mask.layer_kinds:
            raise _source(block_cls).error(
                ("block", "mask", "layer_kinds"),
                f"layer {layer_idx} has type {kind_of_layer!r}, which block.mask.layer_kinds does not map")
        kind = mask.layer_kinds[kind_of_layer]
    window = chunk = None
    if kind == "sliding_window":
        window = evaluate_field(block_cls, ("block", "mask", "sliding_window"), mask.sliding_window, config, layer_idx)
        if window is None:
            kind = "causal"
    elif kind == "chunked":
        chunk = evaluate_field(block_cls, ("block", "mask", "chunk_size"), mask.chunk_size, config, layer_idx)
        if chunk is None:
            kind = "causal"
    use_alibi = position.alibi_function is not None
    if use_alibi and position.rotary_class and position.alibi_when is not None:
        use_alibi = bool(evaluate_field(block_cls, ("block", "position", "alibi_when"), position.alibi_when, config,
                                        layer_idx))
    rotary_class = None
    rotary_here = position.rotary_layer_kinds is None or kind_of_layer in position.rotary_layer_kinds
    if position.rotary_class and not use_alibi and rotary_here:
        rotary_class = resolve_object(_source(block_cls), ("block", "position", "rotary_class"),
                                      position.rotary_class)
    computed = tuple(
        (name, resolve_object(_source(block_cls), ("block", "position", "computed_arguments", name, "function"),
                              argument.function)
         if argument.layer_kinds is None or kind_of_layer in argument.layer_kinds else None)
        for name, argument in position.computed_arguments.items())
    alibi_function = None
    if use_alibi:
        alibi_function = resolve_object(_source(block_cls), ("block", "position", "alibi_function"),
                                        position.alibi_function)
    return LayerSettings(
        spec=block, config=config, layer_idx=layer_idx, mask_kind=kind, sliding_window=window, chunk_size=chunk,
        rotary_class=rotary_class,
        rotary_layer_type=kind_of_layer if position.rotary_layer_type_argument else None,
        no_rotary=bool(position.rotary_class) and not use_alibi and not rotary_here, computed_arguments=computed,
        alibi_function=alibi_function, geometry=kv_geometry(config, layer_idx), layer_writes=spec.kv_cache.layer_writes,
        alibi_takes_device=_takes(alibi_function, "device"),
        keeps_kv=keeps_kv_at(config, layer_idx), keeps_state=keeps_state_at(config, layer_idx),
        recomputes=block.call.cache_argument is None,
        one_token_steps=spec.state is not None and spec.state.continuation == "one_token",
        state_slots=spec.state.slots if spec.state is not None else (1, 1), skipped=skipped,
        fresh_arguments=tuple((name, resolve_object(_source(block_cls), ("block", "call", "fresh_arguments", name),
                                                    path, want_class=True))
                              for name, path in block.call.fresh_arguments.items()),
        counts_positions=spec.state is not None and spec.state.counts_positions,
        streams=streams_of(config), stream_axis=stream_axis_of(config),
        sharing=layer_sharing(config, layer_idx), wire=wire_layout(config),
    )


def _takes(function: Any, argument: str) -> bool:
    """Whether ``function`` accepts keyword ``argument``."""
    if function is None:
        return False
    try:
        return argument in inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False
