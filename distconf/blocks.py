"""Blocks: a family's decoder layer plus one generic adapter, built from the family file.

``make_block_class(config_cls)`` synthesizes ``Distributed<Name>Block``, a subclass of
the family's decoder-layer class (same parameter names, so checkpoint tensors load
directly) whose ``forward`` is the same for every family::

    hidden_states, cache = block(hidden_states, layer_past=cache, use_cache=True)

``hidden_states`` is ``[batch, seq, hidden]``; ``cache`` is ``(key, value)``, each
``[batch, num_kv_heads, tokens, head_dim]``, holding only the real KV heads. Positions
(rotary or ALiBi), the causal / sliding-window mask and the layer's keyword names all
come from the family file's ``block`` section; nothing here depends on a family name.
"""

from __future__ import annotations

import inspect
import logging
import math
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from distconf.errors import ConfigValueError
from distconf.formula import Formula, FormulaError
from distconf.kvcache import BlockKVCache, kv_geometry
from distconf.loader import field_error
from distconf.synthesis import import_object

if TYPE_CHECKING:
    import torch

__all__ = [
    "make_block_class", "build_block", "BlockAdapter", "block_class_for", "constructor_kwargs", "prepare_config",
]

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_block_classes: dict[type, type] = {}


def _import(cls: type, loc: tuple[str, ...], path: str) -> Any:
    try:
        return import_object(path)
    except ImportError as exc:
        raise field_error(cls, loc, str(exc)) from None


@dataclass
class _Runtime:
    """Everything the adapter needs per call, resolved once per block."""

    config: Any
    layer_idx: int
    cache_argument: str
    mask_argument: str | None
    position_ids_argument: str | None
    position_embeddings_argument: str | None
    alibi_argument: str | None
    extra: dict[str, Any]
    rotary_class: type | None
    rotary_layer_type: str | None
    alibi_function: Any
    alibi_in_mask: bool
    mask_kind: str
    sliding_window: int | None
    allow_skip: bool
    num_heads: int
    num_kv_heads: int
    key_head_dim: int
    layer_writes: str
    attn_implementation: str | None


def _layer_type(config: Any, field: str | None, layer_idx: int) -> str | None:
    if field is None:
        return None
    types = getattr(config, field, None)
    if types is None:
        return None
    try:
        return str(types[layer_idx])
    except (IndexError, TypeError):
        raise ConfigValueError(f"{field}={types!r} has no entry for layer {layer_idx}") from None


def _runtime(block_cls: type, config: Any, layer_idx: int) -> _Runtime:
    spec = block_cls.family_spec
    block, call, position, mask = spec.block, spec.block.call, spec.block.position, spec.block.mask
    layer_type = _layer_type(config, mask.layer_types_field, layer_idx)
    kind = mask.kind
    if layer_type is not None:
        if layer_type not in mask.layer_kinds:
            raise field_error(block_cls, ("block", "mask", "layer_kinds"),
                              f"layer {layer_idx} has type {layer_type!r}, which block.mask.layer_kinds does not map")
        kind = mask.layer_kinds[layer_type]
    window = None
    if kind == "sliding_window":
        try:
            window = Formula(mask.sliding_window).evaluate_on(config)
        except FormulaError as exc:
            raise field_error(block_cls, ("block", "mask", "sliding_window"), str(exc)) from None
        if window is None:
            kind = "causal"
    use_alibi = False
    if position.alibi_function:
        use_alibi = True
        if position.rotary_class and position.alibi_when:
            try:
                use_alibi = bool(Formula(position.alibi_when).evaluate_on(config))
            except FormulaError as exc:
                raise field_error(block_cls, ("block", "position", "alibi_when"), str(exc)) from None
    rotary_class = None
    if position.rotary_class and not use_alibi:
        rotary_class = _import(block_cls, ("block", "position", "rotary_class"), position.rotary_class)
    alibi_function = None
    if use_alibi:
        alibi_function = _import(block_cls, ("block", "position", "alibi_function"), position.alibi_function)
    geometry = kv_geometry(config)
    return _Runtime(
        config=config, layer_idx=layer_idx,
        cache_argument=call.cache_argument, mask_argument=call.mask_argument,
        position_ids_argument=call.position_ids_argument,
        position_embeddings_argument=call.position_embeddings_argument,
        alibi_argument=call.alibi_argument, extra=dict(call.extra),
        rotary_class=rotary_class,
        rotary_layer_type=layer_type if position.rotary_layer_type_argument else None,
        alibi_function=alibi_function, alibi_in_mask=position.alibi_in_mask and use_alibi,
        mask_kind=kind, sliding_window=window,
        allow_skip=mask.allow_skip and not (position.alibi_in_mask and use_alibi),
        num_heads=config.num_attention_heads, num_kv_heads=geometry.num_kv_heads,
        key_head_dim=geometry.key_head_dim, layer_writes=spec.kv_cache.layer_writes,
        attn_implementation=block.attn_implementation,
    )


class BlockAdapter:
    """Mixin placed before the decoder-layer class: one ``forward`` for every family."""

    family_spec: Any
    config_class: type
    layer_class: type
    _distconf: _Runtime

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
        self._distconf = _runtime(type(self), config, layer_idx if isinstance(layer_idx, int) else 0)
        self._distconf_rotary: dict[Any, Any] = {}

    @property
    def layer_idx_in_model(self) -> int:
        """Index of this block in the model."""
        return self._distconf.layer_idx

    def _rotary(self, hidden_states: torch.Tensor, position_ids: torch.Tensor) -> Any:
        rt = self._distconf
        key = hidden_states.device
        rotary = self._distconf_rotary.get(key)
        if rotary is None:
            import torch

            with torch.device(key):
                rotary = rt.rotary_class(config=rt.config)
            self._distconf_rotary[key] = rotary
        if rt.rotary_layer_type is not None:
            return rotary(hidden_states, position_ids, rt.rotary_layer_type)
        return rotary(hidden_states, position_ids)

    def _mask(self, hidden_states: torch.Tensor, past: int) -> Any:
        from transformers.masking_utils import (
            ALL_MASK_ATTENTION_FUNCTIONS,
            causal_mask_function,
            sliding_window_causal_mask_function,
        )

        rt = self._distconf
        batch, seq = hidden_states.shape[:2]
        impl = rt.attn_implementation or rt.config._attn_implementation
        if impl not in ALL_MASK_ATTENTION_FUNCTIONS:
            return None  # implementations that need no mask (e.g. paged kernels)
        window = rt.sliding_window if rt.mask_kind == "sliding_window" else None
        mask_function = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
        mask = ALL_MASK_ATTENTION_FUNCTIONS[impl](
            batch_size=batch, q_length=seq, kv_length=past + seq, q_offset=past, kv_offset=0,
            mask_function=mask_function, attention_mask=None, allow_is_causal_skip=rt.allow_skip,
            local_size=window, dtype=hidden_states.dtype, config=rt.config, use_vmap=False,
            device=hidden_states.device,
        )
        return mask

    def layer_kwargs(self, hidden_states: torch.Tensor, past: int = 0, cache: Any = None) -> dict[str, Any]:
        """Keyword arguments the decoder layer gets for ``hidden_states`` after ``past`` cached tokens.

        Exactly what a transformers model passes to the layer: positions, rotary
        embeddings or ALiBi, the mask, and ``cache`` under the family's keyword.
        """
        import torch

        rt = self._distconf
        batch, seq = hidden_states.shape[:2]
        kwargs: dict[str, Any] = dict(rt.extra)
        kwargs[rt.cache_argument] = cache
        position_ids = torch.arange(past, past + seq, device=hidden_states.device).unsqueeze(0)
        if rt.position_ids_argument:
            kwargs[rt.position_ids_argument] = position_ids
        if rt.rotary_class is not None and rt.position_embeddings_argument:
            kwargs[rt.position_embeddings_argument] = self._rotary(hidden_states, position_ids)
        mask = self._mask(hidden_states, past) if rt.mask_argument else None
        alibi = None
        if rt.alibi_function is not None:
            ones = torch.ones((batch, past + seq), device=hidden_states.device, dtype=torch.long)
            alibi = rt.alibi_function(ones, rt.num_heads, hidden_states.dtype)
            if rt.alibi_in_mask and mask is not None:
                min_value = torch.finfo(hidden_states.dtype).min
                if mask.dtype == torch.bool:
                    mask = torch.where(mask, torch.zeros((), device=mask.device, dtype=hidden_states.dtype), min_value)
                bias = alibi.reshape(batch, -1, *alibi.shape[1:]) / math.sqrt(rt.key_head_dim)
                mask = torch.masked_fill(bias, mask < -1, min_value)
        if rt.alibi_argument:
            kwargs[rt.alibi_argument] = alibi
        if rt.mask_argument:
            kwargs[rt.mask_argument] = mask
        return kwargs

    def forward(self, hidden_states: torch.Tensor, layer_past: tuple[torch.Tensor, torch.Tensor] | None = None,
                use_cache: bool = False) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """Run the block on ``[batch, seq, hidden]`` hidden states.

        ``layer_past`` is the ``(key, value)`` cache of earlier tokens (or None). Returns
        the new hidden states and, if ``use_cache``, the cache including these tokens.
        """
        rt = self._distconf
        past = int(layer_past[0].shape[-2]) if layer_past is not None else 0
        cache = BlockKVCache(layer_past, rt.num_kv_heads, rt.layer_writes) if (use_cache or layer_past) else None
        output = super().forward(hidden_states, **self.layer_kwargs(hidden_states, past, cache))  # type: ignore[misc]
        if isinstance(output, (tuple, list)):
            output = output[0]
        present = cache.present if (use_cache and cache is not None) else None
        return output, present


def _class_name(config_cls: type) -> str:
    name = config_cls.__name__
    return (name[: -len("Config")] if name.endswith("Config") else name) + "Block"


def make_block_class(config_cls: type) -> type:
    """The block class of a distributed config class (synthesized once per config class)."""
    cls = _block_classes.get(config_cls)
    if cls is not None:
        return cls
    with _lock:
        cls = _block_classes.get(config_cls)
        if cls is not None:
            return cls
        spec = config_cls.family_spec  # type: ignore[attr-defined]
        layer_class = _import(config_cls, ("block", "layer_class"), spec.block.layer_class)
        if not isinstance(layer_class, type):
            raise field_error(config_cls, ("block", "layer_class"), f"{spec.block.layer_class} is not a class")
        import torch

        if not issubclass(layer_class, torch.nn.Module):
            raise field_error(config_cls, ("block", "layer_class"),
                              f"{spec.block.layer_class} is not a torch.nn.Module")
        name = _class_name(config_cls)
        cls = type(name, (BlockAdapter, layer_class), {
            "__module__": __name__,
            "__qualname__": name,
            "__doc__": f"Block of the {spec.family!r} family: {layer_class.__name__} + the generic adapter.",
            "family_spec": spec,
            "config_class": config_cls,
            "layer_class": layer_class,
        })
        _block_classes[config_cls] = cls
        globals()[name] = cls  # latest class of that name, for pickle
        return cls


def __getattr__(name: str) -> type:
    """Resolve ``Distributed<Name>Block`` on first use (so pickle finds block classes)."""
    if name.startswith("Distributed") and name.endswith("Block"):
        from distconf.loader import load_family_by_class_name

        try:
            config_cls = load_family_by_class_name(name[: -len("Block")] + "Config")
        except LookupError:
            pass
        else:
            return make_block_class(config_cls)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def block_class_for(config: Any) -> type:
    """The block class for a config instance (its class's ``block_class``)."""
    config_cls = type(config)
    if not hasattr(config_cls, "family_spec"):
        raise TypeError(f"{config_cls.__name__} is not a distributed config (use distconf.load_family)")
    return make_block_class(config_cls)


def prepare_config(config: Any) -> None:
    """Give a config what a transformers model would set before building its layers.

    A config not yet used by a model has no attention implementation (the layer would
    silently run unmasked eager attention) and no experts implementation.
    """
    spec = getattr(type(config), "family_spec", None)
    if getattr(config, "_attn_implementation", None) is None:
        config._attn_implementation = (spec.block.attn_implementation if spec else None) or "sdpa"
    if getattr(config, "_experts_implementation", "unset") is None:
        config._experts_implementation = "eager"  # a standalone layer gets no dispatch from a model


def constructor_kwargs(config: Any, layer_idx: int) -> dict[str, Any]:
    """Keyword arguments of the family's layer constructor for block ``layer_idx`` (from the family file)."""
    spec = type(config).family_spec.block.constructor
    kwargs: dict[str, Any] = {spec.config_argument: config}
    if spec.layer_idx_argument:
        kwargs[spec.layer_idx_argument] = layer_idx
    for name, text in spec.extra.items():
        try:
            kwargs[name] = Formula(text).evaluate_on(config)
        except FormulaError as exc:
            raise field_error(config, ("block", "constructor", "extra", name), str(exc)) from None
    return kwargs


def build_block(config: Any, layer_idx: int, *, device: Any = "meta", dtype: torch.dtype | None = None) -> Any:
    """Instantiate block ``layer_idx`` of ``config`` (on ``meta`` nothing is allocated).

    Constructor arguments come from the family file (``block.constructor``). The block is
    in eval mode. On ``meta``, load weights with `distconf.weights.load_block`.
    """
    import torch

    num_layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(layer_idx, int) or layer_idx < 0 or (isinstance(num_layers, int) and layer_idx >= num_layers):
        raise IndexError(f"layer_idx={layer_idx!r} out of range for num_hidden_layers={num_layers!r}")
    cls = block_class_for(config)
    kwargs = constructor_kwargs(config, layer_idx)
    try:
        with torch.device(device):
            block = cls(**kwargs)
    except TypeError as exc:
        raise field_error(config, ("block", "constructor"),
                          f"{cls.layer_class.__name__}({', '.join(kwargs)}) failed: {exc}") from None
    if dtype is not None:
        block = block.to(dtype)
    block.eval()
    return block
