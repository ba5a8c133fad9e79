"""Step 4 of the check: the KV cache (or per-sequence state) the blocks really hold, and their size, against
the family's formulas."""

from __future__ import annotations

from typing import Any

from distconf.blocks.sizing import SIZE_MARGIN
from distconf.loader.config_protocol import DistributedConfig
from distconf.loader.layer_stack import model_layer
from distconf.tools.checker.failures import CheckFailure, located_failure
from distconf.tools.checker.reference import BATCH, SEQ_LEN
from distconf.tools.checker.result import CheckResult

__all__ = ["check_kv_cache", "check_state", "check_block_sizes", "loaded_block_bytes"]


def check_kv_cache(cls: type, config: DistributedConfig, caches: list[Any], result: CheckResult,
                   tokens: int = SEQ_LEN) -> None:
    """Bytes per token each K/V block caches must equal ``kv_cache_bytes_per_token``, and each state block's state
    must have the family's ``state`` shapes; else name the wrong field. Which block keeps which:
    `distconf.blocks.layer_types` (a hybrid family has both kinds, an MLP-only layer neither). The caches hold
    ``tokens`` positions."""
    import torch

    from distconf.blocks.kvcache import kv_geometry
    from distconf.blocks.layer_types import keeps_kv_at, keeps_state_at
    from distconf.blocks.sizing import kv_cache_bytes_per_token

    kv_layers = [i for i in range(len(caches)) if keeps_kv_at(config, model_layer(config, i))]
    state_layers = [i for i in range(len(caches)) if keeps_state_at(config, model_layer(config, i))]
    for i in kv_layers + state_layers:
        where = ("kv_cache", "layer_kinds") if i in kv_layers else ("state", "layer_kinds")
        part = _kv_part(config, i, caches[i]) if i in kv_layers else _state_part(config, i, caches[i])
        if part is None or all(t is None for t in part):
            raise located_failure(cls, where, f"block {i} kept no {'K/V' if i in kv_layers else 'state'}, "
                                  f"though the family file says its layer type keeps one")
    if state_layers:
        check_state(cls, config, [_state_part(config, i, caches[i]) for i in state_layers], result, state_layers)
        if not kv_layers:
            return
        result.notes.append(f"state: {result.kv_declared:,} bytes per sequence on {len(state_layers)} of "
                            f"{len(caches)} blocks")
        result.cache_unit = "token"
    kv_caches = [_kv_part(config, i, caches[i]) for i in kv_layers]
    if not kv_caches:
        result.kv_declared = result.kv_actual = 0
        return
    declared = [kv_cache_bytes_per_token(config, torch.float32, i) for i in kv_layers]
    held = [sum(t.numel() for t in kv) * kv[0].element_size() // (BATCH * tokens) for kv in kv_caches]
    worst = max(range(len(kv_caches)), key=lambda i: abs(held[i] - declared[i]))
    result.kv_declared, result.kv_actual = max(declared), max(held)
    if held[worst] != declared[worst]:
        key, value = kv_caches[worst][:2]
        heads = [int(kv[0].shape[1]) for kv in kv_caches]
        overrides = cls.family_spec.kv_cache.layer_overrides  # type: ignore[attr-defined]
        if len(set(heads)) > 1 and not overrides:  # no single kv_cache section fits: say what does
            per_block = ", ".join(f"block {kv_layers[i]}: {h}" for i, h in enumerate(heads))
            raise located_failure(cls, ("kv_cache",), f"blocks cache different numbers of KV heads per layer "
                                  f"({per_block}; the family declares {kv_geometry(config).num_kv_heads} for "
                                  "every layer): the KV geometry differs per layer kind; declare the layers of "
                                  "the other type in kv_cache.layer_overrides")
        raise _geometry_failure(cls, config, key, value, held[worst], declared[worst], kv_layers[worst])


def _kv_part(config: DistributedConfig, layer_idx: int, cache: Any) -> Any:
    """The ``(key, value)`` of a block's cache, with a sparse-attention indexer's keys when it keeps them."""
    from distconf.blocks.layer_types import keeps_state_at

    if cache is None:
        return None
    return tuple(cache[:2]) if keeps_state_at(config, model_layer(config, layer_idx)) else tuple(cache[:3])


def _state_part(config: DistributedConfig, layer_idx: int, cache: Any) -> Any:
    """The ``(conv, recurrent)`` of a block's cache (its last entries: every conv state, then every recurrent
    state, and the token count when it is kept: `distconf.loader.spec_state.StateSpec.width`)."""
    width = type(config).family_spec.state.width
    return None if cache is None else tuple(cache[-width:])


def _geometry_failure(cls: type, config: DistributedConfig, key: Any, value: Any, actual: int,
                      declared: int, layer_idx: int = 0) -> CheckFailure:
    """The field of the family's KV section that explains a cache of the wrong size (block ``layer_idx``)."""
    from distconf.blocks.kvcache import kv_geometry

    geometry = kv_geometry(config, model_layer(config, layer_idx))
    if key.shape[1] != geometry.num_kv_heads:
        return _kv_heads_failure(cls, config, key.shape[1], geometry.num_kv_heads, key)
    if key.shape[-1] != geometry.key_head_dim:
        return located_failure(cls, ("kv_cache", "key_head_dim"), f"blocks cache keys of {key.shape[-1]} values "
                               f"per head, declared {geometry.key_head_dim}")
    if value.shape[-1] != geometry.value_head_dim:
        return located_failure(cls, ("kv_cache", "value_head_dim"), f"blocks cache values of {value.shape[-1]} "
                               f"values per head, declared {geometry.value_head_dim}")
    return located_failure(cls, ("kv_cache", "values_per_token"),
                           f"blocks cache {actual} bytes per token, the family declares {declared}")


def _repeated(key: Any, kv_heads: int) -> bool:
    """The cached key heads are ``kv_heads`` heads each repeated once per query head of its group."""
    import torch

    batch, heads, tokens, dim = key.shape
    if kv_heads < 1 or heads % kv_heads:
        return False
    grouped = key.reshape(batch, kv_heads, heads // kv_heads, tokens, dim)
    return bool(torch.equal(grouped, grouped[:, :, :1].expand_as(grouped)))


def _kv_heads_failure(cls: type, config: DistributedConfig, cached: int, declared: int,
                      key: Any = None) -> CheckFailure:
    """Blocks cache ``cached`` KV heads, the family declares ``declared``: blame kv_cache or kv_groups."""
    kv_cache = cls.family_spec.kv_cache  # type: ignore[attr-defined]
    loc = ("kv_cache", "num_kv_heads") if kv_cache.num_kv_heads is not None else ("kv_groups",)
    if cached == config.num_attention_heads and declared < cached and kv_cache.layer_writes == "kv_heads" \
            and (key is None or _repeated(key, declared)):
        hint = " (the layer writes every KV head once per query head: set kv_cache.layer_writes: repeat_interleave)"
    elif kv_cache.num_kv_heads is None and cached < declared:
        hint = (" (if the attention caches a compressed or latent representation, declare "
                "kv_cache.num_kv_heads, kv_cache.key_head_dim and kv_cache.value_head_dim)")
    else:
        hint = ""
    return located_failure(cls, loc, f"blocks cache {cached} KV heads but the family declares {declared}{hint}")


def loaded_block_bytes(block: Any) -> int:
    """Bytes a loaded block takes by the sizing rule: its parameter bytes x `SIZE_MARGIN`."""
    return int(sum(p.numel() * p.element_size() for p in block.parameters()) * SIZE_MARGIN)


def check_block_sizes(cls: type, config: DistributedConfig, blocks: list[Any], result: CheckResult) -> None:
    """``block_size_bytes`` (meta build) must equal the size of every loaded block."""
    import torch

    from distconf.blocks.sizing import block_size_bytes

    for i, block in enumerate(blocks):
        declared = block_size_bytes(config, torch.float32, layer_idx=i)
        actual = loaded_block_bytes(block)
        if declared != actual:
            raise located_failure(cls, ("block", "constructor"), f"block_size_bytes gives {declared} for block {i}, "
                                  f"the loaded block takes {actual}")
    result.size_declared = block_size_bytes(config, torch.float32)
    result.size_actual = max(loaded_block_bytes(b) for b in blocks)


def check_state(cls: type, config: DistributedConfig, states: list[Any], result: CheckResult,
                layers: list[int] | None = None) -> None:
    """Each block's ``(conv, recurrent)`` state (every one, when the layer keeps several) must have the family's
    ``state`` shapes (those of its layer type, ``layers`` giving each state's block) and dtypes per sequence.

    ``result.kv_declared`` / ``kv_actual`` then hold bytes per sequence (not per token).
    """
    import torch

    from distconf.blocks.sizing import state_bytes_per_sequence
    from distconf.blocks.state import state_geometry

    geometry = state_geometry(config)
    assert geometry is not None  # the caller checks only families with a state section
    declared = state_bytes_per_sequence(config, torch.float32)
    result.kv_declared, result.cache_unit = declared, "sequence"
    for i, state in zip(layers if layers is not None else range(len(states)), states, strict=True):
        own = state_geometry(config, model_layer(config, i)) if layers is not None else None
        expected = (own or geometry).expected
        for (field, shape), held in zip(expected, state, strict=True):
            got = None if held is None else tuple(held.shape[1:])
            if got != shape:
                raise located_failure(cls, ("state", field.split("[")[0]), f"block {i} keeps a "
                                      f"{field.split('_')[0]} state of shape {got} per sequence, the family "
                                      f"declares {shape}" + (f" ({field})" if "[" in field else ""))
            # the blocks run in float32 here: a state kept in the block's dtype is float32 too
            if field.startswith("recurrent") and held is not None and geometry.recurrent_float32 \
                    and held.dtype != torch.float32:
                raise located_failure(cls, ("state", "recurrent_dtype"), f"block {i} keeps its recurrent state "
                                      f"in {held.dtype}")
    held_bytes = [sum(t.numel() * t.element_size() for t in state if t is not None) // BATCH for state in states]
    result.kv_actual = max(held_bytes)
    if result.kv_actual != declared:
        raise located_failure(cls, ("state",), f"blocks keep {result.kv_actual} bytes per sequence, the family "
                              f"declares {declared}")
