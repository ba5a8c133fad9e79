"""The generic block adapter: one ``forward`` for every family's decoder layer.

A served block is ``Distributed<Name>Block(BlockAdapter, <family's decoder layer>)``
(built by `distconf.blocks.build`); it keeps the layer's parameter names, so checkpoint
tensors load directly, and is called the same way for every family::

    hidden_states, cache = block(hidden_states, layer_past=cache, use_cache=True)

``hidden_states`` is ``[batch, seq, hidden]`` (``[batch, seq, streams * hidden]`` for a family whose layers
take several streams, reshaped around the layer: `distconf.blocks.wire`); ``cache`` is ``(key, value)``, each
``[batch, num_kv_heads, tokens, head_dim]``, holding only the real KV heads; a layer that keeps a
per-sequence state (`distconf.blocks.state`) has ``(conv, recurrent)`` instead, one that keeps
both ``(key, value, conv, recurrent)``, and one that keeps nothing None
(`distconf.blocks.layer_types`). Positions
(rotary or ALiBi), the mask and the layer's keyword names all come from the family
file's ``block`` section, read directly from the spec; `distconf.blocks.layer_settings.LayerSettings` holds only what
is resolved once per layer (its mask kind, window, position functions, KV geometry).
"""

from __future__ import annotations

import inspect
import math
from typing import TYPE_CHECKING, Any

from distconf.blocks.hf_compat import attn_implementation, build_attention_mask, prepare_standalone_config
from distconf.blocks.hybrid_cache import BlockHybridCache
from distconf.blocks.kvcache import BlockKVCache
from distconf.blocks.layer_settings import LayerSettings, RowLayout, evaluate_field, layer_settings
from distconf.blocks.module_state import counted_positions, held_in_modules, split_count, with_count
from distconf.blocks.past import BlockCapabilities, LayerPast
from distconf.blocks.shared_kv import reuse_into, stored_part
from distconf.blocks.state import BlockStateCache
from distconf.blocks.state_carriers import call_with_state, carry_state, row_by_row, steps_row_by_row
from distconf.blocks.sublayer_cache import BlockSublayerKVCache
from distconf.blocks.wire import (
    carried_stand_ins,
    join_carried,
    split_carried,
)
from distconf.loader.config_protocol import DistributedConfig

if TYPE_CHECKING:
    import torch

__all__ = ["BlockAdapter", "prepare_config"]


def prepare_config(config: DistributedConfig) -> None:
    """Give a config what a transformers model would set before building its layers.

    A config not yet used by a model has no attention implementation (the layer would
    silently run unmasked eager attention) and no experts implementation.
    """
    spec = getattr(type(config), "family_spec", None)
    prepare_standalone_config(config, (spec.block.attn_implementation if spec else None) or "sdpa")


def _split_past(layer_past: tuple[Any, ...] | None, caps: BlockCapabilities,
                ) -> tuple[tuple[Any, ...] | None, tuple[Any, ...] | None]:
    """The K/V part (``(key, value[, indexer])``) and the state part of a block's past (either None when absent)."""
    past = LayerPast.unpack(layer_past, caps)
    kv = None if past.keys is None else (
        (past.keys, past.values) if past.indexer is None else (past.keys, past.values, past.indexer))
    return kv, past.state


def _kv_cache(kv_past: tuple[Any, ...] | None, settings: LayerSettings) -> BlockKVCache | BlockSublayerKVCache:
    """The K/V cache object of one call: one per block, or one per attention sublayer (``kv_cache.sublayers``)."""
    sublayers = type(settings.config).family_spec.kv_cache.sublayers
    if sublayers > 1:
        return BlockSublayerKVCache(kv_past, settings.geometry.num_kv_heads, settings.layer_writes, sublayers)
    return BlockKVCache(kv_past, settings.geometry.num_kv_heads, settings.layer_writes,
                        keeps_indexer=settings.geometry.indexer_head_dim > 0)


def _mask_dict(entries: dict[str, str], mask: Any, padding_mask: torch.Tensor | None, seq: int) -> dict[str, Any]:
    """The mask a layer takes as a dict (``block.mask.as_dict``): each key gets the attention mask, the padding
    of this call's ``seq`` tokens (None for a call whose rows are not padded: no ``padding_mask``) or None."""
    padding = padding_mask[:, -seq:] if padding_mask is not None else None
    held = {"attention": mask, "padding": padding, "none": None}
    return {key: held[entry] for key, entry in entries.items()}


class BlockAdapter:
    """Mixin placed before the decoder-layer class: one ``forward`` for every family."""

    family_spec: Any
    config_class: type
    layer_class: type
    _distconf: LayerSettings
    _distconf_loop: Any = None  # a looped layer stack's block: its `distconf.blocks.layer_stack.BlockLoop`

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Construct the decoder layer with the family's constructor arguments, then the adapter."""
        spec = type(self).family_spec.block.constructor
        layer_class = type(self).layer_class
        bound = inspect.signature(layer_class.__init__).bind_partial(self, *args, **kwargs).arguments
        config = bound.get(spec.config_argument)
        if config is None:
            raise TypeError(f"{type(self).__name__} needs the config as {spec.config_argument!r} "
                            "(block.constructor.config_argument)")
        layer_idx = bound.get(spec.layer_idx_argument) if spec.layer_idx_argument else None
        prepare_config(config)
        super().__init__(*args, **kwargs)
        self._distconf = layer_settings(type(self), config, layer_idx if isinstance(layer_idx, int) else 0)
        self._distconf_rotary: dict[Any, Any] = {}

    @classmethod
    def adopt(cls, layer: Any, config: DistributedConfig, layer_idx: int) -> Any:
        """Make ``layer``, a decoder layer the model built (``block.constructor.from_model``), a block of ``cls``.

        ``cls`` must derive from the layer's own class; the layer keeps its modules and parameter names.
        """
        if not isinstance(layer, cls.layer_class):
            raise TypeError(f"the model's layer {layer_idx} is a {type(layer).__name__}, not the family's "
                            f"{cls.layer_class.__name__}")
        layer.__class__ = cls
        layer._distconf = layer_settings(cls, config, layer_idx)
        layer._distconf_rotary = {}
        return layer

    @property
    def settings(self) -> LayerSettings:
        """What this block resolved once from its family file for its layer (mask, positions, KV geometry)."""
        return self._distconf

    @property
    def capabilities(self) -> BlockCapabilities:
        """What this block keeps between calls (K/V, a state, an indexer's keys): the server's contract."""
        return self._distconf.capabilities

    @property
    def layer_idx_in_model(self) -> int:
        """Index of this block in the model."""
        return self._distconf.layer_idx

    def _rotary(self, hidden_states: torch.Tensor, position_ids: torch.Tensor) -> Any:
        settings = self._distconf
        key = hidden_states.device
        rotary = self._distconf_rotary.get(key)
        if rotary is None:
            import torch

            with torch.device(key):
                rotary = settings.rotary_class(config=settings.config)
            self._distconf_rotary[key] = rotary
        keys = settings.spec.position.rotary_keys
        if keys is not None:  # one result per key, each of the rotary type it names
            return {key: rotary(hidden_states, position_ids, kind) for key, kind in keys.items()}
        if settings.rotary_layer_type is not None:
            return rotary(hidden_states, position_ids, settings.rotary_layer_type)
        return rotary(hidden_states, position_ids)

    def _mask(self, hidden_states: torch.Tensor, past: int, padding_mask: torch.Tensor | None = None) -> Any:
        settings = self._distconf
        batch, seq = hidden_states.shape[:2]
        boolean = settings.spec.mask.boolean
        implementation = "eager" if boolean else (settings.spec.attn_implementation
                                                  or attn_implementation(settings.config))
        mask = build_attention_mask(
            implementation, batch_size=batch, q_length=seq, past=past,
            window=settings.sliding_window if settings.mask_kind == "sliding_window" else None,
            chunk=settings.chunk_size if settings.mask_kind == "chunked" else None,
            allow_skip=settings.spec.mask.allow_skip and not settings.alibi_in_mask and not boolean,
            dtype=hidden_states.dtype, config=settings.config, device=hidden_states.device, padding_mask=padding_mask,
        )
        if boolean is not None and mask is not None:
            mask = mask != 0 if boolean == "masked" else mask == 0
        return mask

    def _alibi_by_arguments(self, hidden_states: torch.Tensor, past: int) -> Any:
        """The bias of a model that builds it from its own function and arguments (``position.alibi_arguments``)."""
        settings = self._distconf
        position = settings.spec.position
        kwargs = {name: evaluate_field(type(self), ("block", "position", "alibi_arguments", name), formula,
                                       settings.config, settings.layer_idx)
                  for name, formula in position.alibi_arguments.items()}
        if position.alibi_length_argument:
            kwargs[position.alibi_length_argument] = past + hidden_states.shape[1]
        if settings.alibi_takes_device:
            kwargs["device"] = hidden_states.device
        return settings.alibi_function(**kwargs)

    def _alibi(self, hidden_states: torch.Tensor, past: int, mask: Any,
               padding_mask: torch.Tensor | None = None) -> tuple[Any, Any]:
        """The ALiBi bias for the layer's alibi argument, and the mask with the bias folded in when asked."""
        import torch

        settings = self._distconf
        if settings.spec.position.alibi_arguments is not None:
            return self._alibi_by_arguments(hidden_states, past), mask
        batch, seq = hidden_states.shape[:2]
        if padding_mask is None:
            keys = torch.ones((batch, past + seq), device=hidden_states.device, dtype=torch.long)
        else:
            keys = padding_mask.to(device=hidden_states.device, dtype=torch.long)
        alibi = settings.alibi_function(keys, settings.config.num_attention_heads, hidden_states.dtype)
        if settings.alibi_in_mask and mask is not None:
            min_value = torch.finfo(hidden_states.dtype).min
            if mask.dtype == torch.bool:
                mask = torch.where(mask, torch.zeros((), device=mask.device, dtype=hidden_states.dtype), min_value)
            bias = alibi.reshape(batch, -1, *alibi.shape[1:]) / math.sqrt(settings.geometry.key_head_dim)
            mask = torch.masked_fill(bias, mask < -1, min_value)
        return alibi, mask

    def layer_kwargs(self, hidden_states: torch.Tensor, past: int = 0, cache: Any = None,
                     rows: RowLayout | None = None, positions: torch.Tensor | None = None) -> dict[str, Any]:
        """Keyword arguments the decoder layer gets for ``hidden_states`` after ``past`` cached tokens.

        Exactly what a transformers model passes to the layer: positions, rotary
        embeddings or ALiBi, the mask, and ``cache`` under the family's keyword. ``rows``
        gives rows of different lengths their own positions and padding (a batch of sessions); ``positions``
        each row's positions when they do not follow from ``past`` (a state's token count).
        """
        import torch

        settings = self._distconf
        call = settings.spec.call
        kwargs: dict[str, Any] = dict(call.extra)
        kwargs.update((name, container()) for name, container in settings.fresh_arguments)
        if call.cache_argument is not None:
            kwargs[call.cache_argument] = cache
        if call.layer_idx_argument is not None:
            kwargs[call.layer_idx_argument] = settings.layer_idx
        if rows is None:
            position_ids = positions if positions is not None else torch.arange(
                past, past + hidden_states.shape[1], device=hidden_states.device).unsqueeze(0)
            padding_mask = None
        else:
            position_ids = rows.position_ids.to(hidden_states.device)
            padding_mask = rows.padding_mask.to(hidden_states.device)
        if call.position_ids_argument:
            kwargs[call.position_ids_argument] = position_ids
        if settings.rotary_class is not None and call.position_embeddings_argument:
            kwargs[call.position_embeddings_argument] = self._rotary(hidden_states, position_ids)
        elif settings.no_rotary and call.position_embeddings_argument:
            kwargs[call.position_embeddings_argument] = None
        if settings.spec.position.relative_distance_argument:  # query index minus key index, over every key
            queries = torch.arange(past, past + hidden_states.shape[1], device=hidden_states.device)
            kwargs[settings.spec.position.relative_distance_argument] = queries[:, None] - torch.arange(
                past + hidden_states.shape[1], device=hidden_states.device)[None, :]
        for name, function in settings.computed_arguments:
            kwargs[name] = function(position_ids) if function is not None else None
        kwargs.update(carried_stand_ins(type(self), settings.config, hidden_states, past))
        wants_mask = call.mask_argument and settings.mask_kind != "none"
        mask = self._mask(hidden_states, past, padding_mask) if wants_mask else None
        alibi = None
        if settings.alibi_function is not None:
            alibi, mask = self._alibi(hidden_states, past, mask, padding_mask)
        if call.alibi_argument:
            kwargs[call.alibi_argument] = alibi
        if call.mask_argument:
            entries = settings.spec.mask.as_dict
            kwargs[call.mask_argument] = _mask_dict(entries, mask, padding_mask, hidden_states.shape[1]) \
                if entries else mask
        return kwargs

    def forward(self, hidden_states: torch.Tensor, layer_past: tuple[torch.Tensor, ...] | None = None,
                use_cache: bool = False, rows: RowLayout | None = None,
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """Run the block on ``[batch, seq, hidden]`` hidden states.

        ``layer_past`` is the cache of earlier tokens (or None): ``(key, value)`` for a layer that keeps
        K/V, ``(conv, recurrent)`` for one that keeps a per-sequence state (`distconf.blocks.state`),
        ``(key, value, conv, recurrent)`` for one that keeps both. Returns the new hidden states and,
        if ``use_cache``, the cache including these tokens (None for a layer that keeps nothing).
        ``rows``: each row's positions and padding, when rows of one call have different lengths.
        """
        if self._distconf_loop is not None:  # the wire ends with the looped stack's input
            return self._distconf_loop.run(self._layer_forward, hidden_states, layer_past, use_cache, rows)
        return self._layer_forward(hidden_states, layer_past, use_cache, rows)

    def _layer_forward(self, hidden_states: torch.Tensor, layer_past: tuple[torch.Tensor, ...] | None = None,
                       use_cache: bool = False, rows: RowLayout | None = None,
                       ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """`forward` on a wire without a looped stack's input."""
        settings = self._distconf
        if settings.skipped:
            return hidden_states, None
        if steps_row_by_row(settings, hidden_states, layer_past, use_cache):
            return row_by_row(self._layer_forward, hidden_states, layer_past, use_cache, rows)  # type: ignore[arg-type]
        if (settings.keeps_state and settings.one_token_steps and layer_past is not None and rows is None
                and hidden_states.shape[1] > 1):
            return self._one_token_at_a_time(hidden_states, layer_past, use_cache)
        kv_past, state_past = _split_past(layer_past, settings.capabilities)
        state_past, seen = split_count(state_past, settings)
        if settings.recomputes:
            return self._recompute(hidden_states, kv_past, use_cache, rows)
        wire = settings.wire
        hidden_states, shared = wire.split_shared(hidden_states)  # kv_cache.shared: last
        layout = wire.carried  # hidden_state.carried: values after the hidden state
        hidden_states, carried = split_carried(hidden_states, layout)
        past = int(kv_past[0].shape[-2]) if kv_past is not None else 0
        cache: BlockKVCache | BlockSublayerKVCache | BlockStateCache | BlockHybridCache | None = None
        if use_cache or layer_past is not None:
            kv = (_kv_cache(kv_past, settings) if settings.keeps_kv else None)
            state = BlockStateCache(state_past, settings.state_slots) if settings.keeps_state else None
            cache = BlockHybridCache(kv, state) if (kv is not None and state is not None) else (kv or state)
            if state is not None:
                cache = carry_state(cache, settings, hidden_states)
        positions = counted_positions(seen, hidden_states) if seen is not None and kv_past is None else None
        kwargs = {**self.layer_kwargs(hidden_states, past, cache, rows, positions),
                  **{slot.argument: slot.layer_part(carried[slot.argument], settings.layer_idx) for slot in layout}}
        role, key = settings.sharing
        if role == "reuse":
            reuse_into(kwargs[self._shared_argument], key, shared[key], cache, settings.geometry)
        with held_in_modules(self, settings, cache, hidden_states):
            output = call_with_state(super().forward, settings.layer_form(hidden_states), kwargs,
                                     cache, settings)
        if role == "store":
            width = wire.shared_slot(key).width
            shared = {**shared, key: stored_part(kwargs[self._shared_argument], key, hidden_states.shape[1], width)}
        hidden = output[0] if isinstance(output, (tuple, list)) else output
        present = with_count(cache.present, seen, hidden_states, settings) if use_cache and cache is not None else None
        joined = join_carried(settings.wire_form(hidden), output, layout, carried, settings.layer_idx, hidden_states)
        return wire.join_shared(joined, shared), present

    @property
    def _shared_argument(self) -> str:
        """The layer's keyword of the container it stores K/V in or reuses it from (``kv_cache.shared``)."""
        return type(self).family_spec.kv_cache.shared.argument

    def _recompute(self, hidden_states: torch.Tensor, kv_past: tuple[torch.Tensor, ...] | None, use_cache: bool,
                   rows: RowLayout | None) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """A layer that keeps no cache: run it on the earlier inputs followed by the new ones, as one sequence.

        Its past is ``(inputs, empty)``: the inputs ``[batch, 1, tokens, wire width]`` where a K/V layer keeps keys
        (so sessions, beams and batches handle them as K/V rows), and a ``[batch, 1, tokens, 0]`` value part. The
        inputs are kept as on the wire, carried values (``hidden_state.carried``) included, so the rerun gets them
        for every earlier token too.
        """
        import torch

        new = hidden_states.shape[1]
        full = hidden_states if kv_past is None else torch.cat([kv_past[0][:, 0].to(hidden_states.dtype),
                                                                hidden_states], dim=1)
        full = full.contiguous()
        full_rows = None
        if rows is not None:  # left-padded rows: each row's positions over its whole sequence
            padding = rows.padding_mask.to(hidden_states.device)
            full_rows = RowLayout(padding, (padding.long().cumsum(-1) - 1).clamp(min=0))
        layout = self._distconf.wire.carried  # values after the hidden state, for the whole sequence
        hidden, carried = split_carried(full, layout)
        output = super().forward(self._distconf.layer_form(hidden),  # type: ignore[misc]
                                 **self.layer_kwargs(hidden, 0, None, full_rows), **carried)
        hidden = output[0] if isinstance(output, (tuple, list)) else output
        output = join_carried(self._distconf.wire_form(hidden), output, layout, carried)
        present = (full.unsqueeze(1), full.new_zeros(*full.shape[:2], 0).unsqueeze(1)) if use_cache else None
        return output[:, full.shape[1] - new:], present

    def _one_token_at_a_time(self, hidden_states: torch.Tensor, layer_past: tuple[torch.Tensor, ...],
                             use_cache: bool) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """A multi-token step after an earlier state, as one-token steps (the layer continues only those)."""
        import torch

        outputs = []
        past: tuple[torch.Tensor, ...] | None = layer_past
        for t in range(hidden_states.shape[1]):
            out, past = self._layer_forward(hidden_states[:, t:t + 1], layer_past=past, use_cache=True)
            outputs.append(out)
        return torch.cat(outputs, dim=1), (past if use_cache else None)
