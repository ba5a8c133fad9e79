"""The one place that reaches into transformers internals (not its public API).

Masks and checkpoint conversion rules are not part of transformers' stable API; every
use in distconf goes through this module, so a transformers upgrade touches one file.
Everything is imported lazily: importing this module imports no transformers code.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "build_attention_mask", "checkpoint_conversions", "rename_checkpoint_key", "stacking_operations",
]


def build_attention_mask(implementation: str, *, batch_size: int, q_length: int, past: int,
                         window: int | None, allow_skip: bool, dtype: Any, config: Any, device: Any) -> Any:
    """The 4D mask a transformers model would give a layer (None when the implementation needs none).

    Causal, or causal limited to ``window`` tokens back; built by transformers' own mask
    functions for ``implementation`` (``sdpa``, ``eager``, ...).
    """
    from transformers.masking_utils import (
        ALL_MASK_ATTENTION_FUNCTIONS,
        causal_mask_function,
        sliding_window_causal_mask_function,
    )

    if implementation not in ALL_MASK_ATTENTION_FUNCTIONS:
        return None  # implementations that need no mask (e.g. paged kernels)
    mask_function = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    return ALL_MASK_ATTENTION_FUNCTIONS[implementation](
        batch_size=batch_size, q_length=q_length, kv_length=past + q_length, q_offset=past, kv_offset=0,
        mask_function=mask_function, attention_mask=None, allow_is_causal_skip=allow_skip,
        local_size=window, dtype=dtype, config=config, use_vmap=False, device=device,
    )


def checkpoint_conversions(model_type: str) -> tuple[list[Any], list[Any]]:
    """transformers' checkpoint conversion rules of ``model_type``: (renamings, converters)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    mapping = get_checkpoint_conversion_mapping(model_type) or []
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    return renamings, converters


def rename_checkpoint_key(name: str, renamings: list[Any], converters: list[Any]) -> tuple[str, str | None]:
    """The parameter name a checkpoint tensor maps to, and the converter source pattern it matched (or None)."""
    from transformers.core_model_loading import rename_source_key

    return rename_source_key(name, renamings, converters)


def stacking_operations() -> tuple[type, type]:
    """transformers' ``(MergeModulelist, Concatenate)`` conversion operations (MoE expert fusion)."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    return MergeModulelist, Concatenate
