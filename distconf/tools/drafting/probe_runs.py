"""The runs of a tiny model the drafter makes beyond one instrumented pass (`distconf.tools.drafting.probe` builds
and runs every one of them): each variant's 12-token run (`run_tiny`, giving a `TinyRun`: sizes, kinds of layers,
the cache layout), the dtypes of its states, and the checks that need passes of other shapes (`decodes_as_forward`,
`try_tiny_model`)."""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

from distconf.tools.drafting.common import field_value, quiet_transformers
from distconf.tools.drafting.indexer import find_indexers
from distconf.tools.drafting.layer_state import LayerState, layer_states
from distconf.tools.drafting.probe import (
    BFLOAT16_RUN,
    MAX_TINY_PARAMETERS,
    Forward,
    _attempt,
    _build,
    _cached,
    _Failed,
    _key,
    layer_kinds,
    observe,
    tiny_model,
)
from distconf.tools.drafting.profile import TINY_TEST_TOKENS
from distconf.tools.drafting.state_layer_list import StateListFound, find_state_list, list_states
from distconf.tools.drafting.state_layout import foreign_cache_class, foreign_state
from distconf.tools.drafting.state_module_attributes import ModuleStatesFound, handed_cache, module_states
from distconf.tools.drafting.state_recurrent_methods import StateMethodsFound, find_state_methods, with_method_states
from distconf.tools.drafting.state_returned_tuple import ReturnedStateFound, returned_state, returned_states

__all__ = ["TinyRun", "decodes_as_forward", "run_tiny", "state_dtypes", "try_tiny_model"]


@dataclass
class TinyRun:
    """A tiny model's config, the key and value its last layer cached, and its kinds of layers."""

    config: Any
    key: Any | None = None
    value: Any | None = None
    kinds: set[Hashable] = field(default_factory=set)
    layer_shapes: list[tuple[int, ...] | None] = field(default_factory=list)
    """The cached (key heads, key head size, value heads, value head size) of every layer, in order."""
    states: list[LayerState] = field(default_factory=list)
    """What every layer of the cache holds: a conv / recurrent state, K/V."""
    indexer: Any | None = None
    """The keys ``[batch, tokens, dim]`` a sparse-attention indexer cached next to the last K/V layer's K/V."""
    indexer_layers: list[bool] = field(default_factory=list)
    """Whether each cache layer keeps an indexer's keys (`distconf.tools.drafting.indexer`)."""
    foreign_state: str | None = None
    """Where the model keeps a per-sequence state outside transformers' cache layers, in words (`foreign_state`)."""
    state_methods: StateMethodsFound | None = None
    """The methods of the model's own cache keeping its recurrent states (`find_state_methods`)."""
    state_list: StateListFound | None = None
    """The list of per-layer state tensors the model passes its layers (`find_state_list`)."""
    returned_state: ReturnedStateFound | None = None
    """The state tuple each layer takes and returns, for a model with a cache class of its own."""
    module_states: ModuleStatesFound | None = None
    """The attributes the layers' modules keep their states in, for a model keeping them there."""

    @property
    def shape(self) -> tuple[int, int, int, int] | None:
        """(key heads, key head size, value heads, value head size) cached per token, if read."""
        if self.key is None or self.value is None or self.key.dim() != 4 or self.value.dim() != 4:
            return None
        return (int(self.key.shape[1]), int(self.key.shape[-1]), int(self.value.shape[1]),
                int(self.value.shape[-1]))


def run_tiny(config_class: type, tiny: Mapping[str, Any], attn_implementation: str) -> TinyRun | str:
    """Build the tiny model and run 12 tokens through it with a cache; the error text when it fails (once per
    `probe_session`)."""
    return _cached(_key("run", config_class, tiny, attn_implementation),
                   lambda: _run_tiny(config_class, tiny, attn_implementation))


def _run_tiny(config_class: type, tiny: Mapping[str, Any], attn_implementation: str) -> TinyRun | str:
    meta = _attempt(lambda: _build(config_class, tiny, attn_implementation, meta=True))
    if isinstance(meta, _Failed):  # any failure is reported to the user, never hidden
        return str(meta)
    config, meta_model = meta
    parameters = sum(p.numel() for p in meta_model.parameters())
    if parameters > MAX_TINY_PARAMETERS:
        return (f"it would have {parameters:,} parameters (a size field of the real model was not "
                "shrunk), so it was not built")
    own_cache = foreign_cache_class(type(meta_model))
    vocab = int(field_value(config, "vocab_size", 0) or 256)
    # a model with a cache of its own runs without it (it may not fit the tiny sizes): the layers' states are read
    record = observe(config_class, tiny, attn_implementation, Forward(
        use_cache=own_cache is None, tokens=TINY_TEST_TOKENS, high=min(vocab, 256), quiet=False))
    if record.error is not None:
        return record.error
    config, layers, result, ids = record.config, record.layers, record.result, record.input_ids
    model = record.model
    returned = returned_state(record.calls, len(layers), int(ids.shape[0])) if own_cache is not None else None
    handed = handed_cache(record.calls) if own_cache is None else None
    cache = getattr(result, "past_key_values", None)
    held, held_states = (None, []) if cache is not None or own_cache is not None else \
        module_states(layers, int(ids.shape[0]), layer_states(handed))
    if held is not None:  # the modules keep the states; the K/V is in the cache the model handed its layers
        cache = handed
    key, value = _last_cache(cache)
    indexer, indexer_layers = find_indexers(cache)
    methods = find_state_methods(cache)
    listed = find_state_list(result, len(layers))
    states = list_states(listed, len(layers)) if listed is not None else _states(cache, methods)
    foreign = None if methods is not None or listed is not None else (own_cache or foreign_state(result, model))
    if returned is not None:
        states, foreign = returned_states(returned, len(layers)), None
    if held is not None:
        states, foreign = held_states, None
    return TinyRun(config=config, key=key, value=value, kinds=layer_kinds(layers, config),
                   layer_shapes=_layer_shapes(cache), states=states, indexer=indexer, indexer_layers=indexer_layers,
                   foreign_state=foreign, state_methods=methods, state_list=listed, returned_state=returned,
                   module_states=held)


def _states(cache: Any, methods: StateMethodsFound | None = None) -> list[LayerState]:
    """What every layer of ``cache`` holds, with the states its own methods keep (`with_method_states`)."""
    return with_method_states(cache, layer_states(cache), methods)


def state_dtypes(config_class: type, tiny: Mapping[str, Any], attn_implementation: str,
                 ) -> dict[str, set[str]] | None:
    """The dtypes of the ``recurrent`` and of the ``conv`` states a bfloat16 tiny model keeps (None when it cannot
    run in bfloat16)."""
    record = observe(config_class, tiny, attn_implementation, BFLOAT16_RUN)
    if record.error is not None:  # the float32 run has reported anything wrong with the config
        return None
    cache = getattr(record.result, "past_key_values", None)
    layers = record.layers if cache is None else []
    states = _states(cache, find_state_methods(cache)) if cache is not None else module_states(layers, 1, [])[1]
    return {"recurrent": {s.recurrent_dtype for s in states if s.recurrent_dtype},
            "conv": {s.conv_dtype for s in states if s.conv_dtype}}


def _layer_shapes(cache: Any) -> list[tuple[int, ...] | None]:
    """(key heads, key size, value heads, value size) each layer of a transformers Cache holds (None: not K/V)."""
    shapes: list[tuple[int, ...] | None] = []
    for layer in getattr(cache, "layers", None) or []:
        key, value = getattr(layer, "keys", None), getattr(layer, "values", None)
        ok = all(getattr(t, "dim", lambda: 0)() == 4 for t in (key, value))
        shapes.append((int(key.shape[1]), int(key.shape[-1]), int(value.shape[1]), int(value.shape[-1]))
                      if ok else None)
    return shapes


def _last_cache(cache: Any) -> tuple[Any, Any]:
    layers = getattr(cache, "layers", None)  # a transformers Cache: one entry per layer
    try:
        kv = [layer for layer in layers if getattr(getattr(layer, "keys", None), "dim", lambda: 0)() == 4]
        last = kv[-1] if kv else layers[-1]  # a hybrid's last layer may keep a state, not K/V
        return last.keys, last.values
    except (AttributeError, IndexError, TypeError):
        return None, None


def try_tiny_model(config_class: type, tiny: Mapping[str, Any], attn_implementation: str) -> tuple[Any, Any] | None:
    """`tiny_model`, or None when it does not build (the run of the tiny config reports why)."""
    built = _attempt(lambda: tiny_model(config_class, tiny, attn_implementation))
    return None if isinstance(built, _Failed) else built


def decodes_as_forward(config_class: type, tiny: Mapping[str, Any], attn_implementation: str, tokens: int,
                       tolerance: float) -> bool | None:
    """Whether the tiny model's decoding of ``tokens`` ids (the last two one at a time) with its own cache gives its
    full forward pass's logits, within ``tolerance`` relative to the largest (None when it does not run)."""
    import torch

    def run() -> bool:
        _, model = tiny_model(config_class, tiny, attn_implementation)
        ids = torch.randint(0, 8, (1, tokens), generator=torch.Generator().manual_seed(1))
        with torch.no_grad(), quiet_transformers():
            full = model(ids, use_cache=False).logits
            out = model(ids[:, :-2], use_cache=True)
            keyword = "cache" if hasattr(out, "cache") else "past_key_values"
            cache = getattr(out, keyword)
            steps = [out.logits]
            for t in range(tokens - 2, tokens):
                out = model(ids[:, t:t + 1], use_cache=True, **{keyword: cache})
                cache = getattr(out, keyword)
                steps.append(out.logits)
        scale = float(full.abs().max()) or 1.0  # relative: a tiny model's logits may all be small
        return float((torch.cat(steps, dim=1) - full).abs().max()) <= tolerance * scale

    exact = _attempt(run)
    return None if isinstance(exact, _Failed) else exact
