"""Building and running a tiny model (`run_tiny`): what it caches and which kinds of layers it has."""

from __future__ import annotations

import copy
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

from distconf.tools.drafting.common import field_value, is_int, quiet_transformers
from distconf.tools.drafting.indexer import find_indexers
from distconf.tools.drafting.layer_state import LayerState, layer_states
from distconf.tools.drafting.profile import TINY_TEST_TOKENS
from distconf.tools.drafting.scan import find_layer_list, layer_signature
from distconf.tools.drafting.state import foreign_cache_class, foreign_state
from distconf.tools.drafting.state_attributes import ModuleStatesFound, module_states, run_handing_cache
from distconf.tools.drafting.state_list import StateListFound, find_state_list, list_states
from distconf.tools.drafting.state_methods import StateMethodsFound, find_state_methods, with_method_states
from distconf.tools.drafting.state_returned import ReturnedStateFound, returned_states, run_returning_states

__all__ = ["TinyRun", "build_tiny_model", "run_tiny", "state_dtypes", "layer_kinds", "meta_layer_kinds",
           "MAX_TINY_PARAMETERS"]

MAX_TINY_PARAMETERS = 100_000_000  # a tiny model above this missed a size: it is not built for real
_MAX_VALUES_PER_KIND = 4


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


def layer_kinds(layers: Any, config: Any) -> set[Hashable]:
    """Kinds of layers: each layer's modules, with its entries in the config's per-layer lists of categories."""
    count = len(layers)
    columns = [v for v in vars(config).values() if _is_category_list(v, count)]
    return {(layer_signature(layer), tuple(column[i] for column in columns)) for i, layer in enumerate(layers)}


def _is_category_list(value: Any, count: int) -> bool:
    """One category per layer: strings, booleans or 0/1 flags, few distinct ones."""
    if not isinstance(value, (list, tuple)) or count < 1 or len(value) != count:
        return False
    if not all(isinstance(x, (str, bool)) for x in value) and not all(x in (0, 1) and is_int(x) for x in value):
        return False
    return len(set(value)) <= _MAX_VALUES_PER_KIND


def _build(config_class: type, tiny: Mapping[str, Any], attn_implementation: str, *, meta: bool) -> tuple[Any, Any]:
    import torch

    from distconf.blocks.hf_compat import causal_lm_from_config, set_attn_implementation

    with quiet_transformers():
        config = config_class(**copy.deepcopy(dict(tiny)))  # classes may normalize lists in place
        set_attn_implementation(config, attn_implementation)
        if meta:
            with torch.device("meta"):
                return config, causal_lm_from_config(config)
        torch.manual_seed(0)
        return config, causal_lm_from_config(config, dtype=torch.float32).eval()


def build_tiny_model(config_class: type, tiny: Mapping[str, Any], attn_implementation: str) -> tuple[Any, Any]:
    """(config, float32 model in eval mode) of the tiny config, with seeded random weights."""
    return _build(config_class, tiny, attn_implementation, meta=False)


def meta_layer_kinds(config_class: type, tiny: Mapping[str, Any], attn_implementation: str) -> set[Hashable] | None:
    """Kinds of layers of the tiny model built on the meta device (None when it cannot be built)."""
    try:
        config, model = _build(config_class, tiny, attn_implementation, meta=True)
        _, layers = find_layer_list(model, field_value(config, "num_hidden_layers"))
        return layer_kinds(layers, config)
    except Exception:  # the real run reports why
        return None


def run_tiny(config_class: type, tiny: Mapping[str, Any], attn_implementation: str) -> TinyRun | str:
    """Build the tiny model and run 12 tokens through it with a cache; the error text when it fails."""
    import torch

    try:
        config, meta_model = _build(config_class, tiny, attn_implementation, meta=True)
        parameters = sum(p.numel() for p in meta_model.parameters())
        if parameters > MAX_TINY_PARAMETERS:
            return (f"it would have {parameters:,} parameters (a size field of the real model was not "
                    "shrunk), so it was not built")
        config, model = _build(config_class, tiny, attn_implementation, meta=False)
        vocab = int(field_value(config, "vocab_size", 0) or 256)
        ids = torch.randint(0, min(vocab, 256), (1, TINY_TEST_TOKENS))
        _, layers = find_layer_list(model, field_value(config, "num_hidden_layers"))
        own_cache, returned, handed = foreign_cache_class(type(model)), None, None
        if own_cache is not None:  # its cache may not fit the tiny sizes: the layers' own states are read
            result, returned = run_returning_states(model, layers, ids)
        else:
            result, handed = run_handing_cache(model, layers, ids)
    except Exception as exc:  # any failure is reported to the user, never hidden
        return f"{type(exc).__name__}: {exc}"
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
    import torch

    try:
        config, model = _build(config_class, tiny, attn_implementation, meta=False)
        model = model.to(torch.bfloat16)
        with torch.no_grad():
            result = model(torch.randint(0, 8, (1, 4)), use_cache=True)
        cache = getattr(result, "past_key_values", None)
        layers = find_layer_list(model, field_value(config, "num_hidden_layers"))[1] if cache is None else []
    except Exception:  # the float32 run has reported anything wrong with the config
        return None
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
