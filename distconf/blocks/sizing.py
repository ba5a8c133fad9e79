"""Memory cost of a block and of its KV cache, from the family file alone.

- ``block_size_bytes``: parameter count of the block built on the meta device (no
  memory) x bytes per value x 1.01; bytes per value is the dtype's size, 1 for int8,
  4.25/8 for nf4. By default the largest block of the model (every layer is built once
  on meta per distinct config; later calls hit a cache).
- ``kv_cache_bytes_per_token``: values the block caches per token (the family's
  ``kv_cache`` section, see `distconf.kvcache.kv_geometry`) x bytes per value.
"""

from __future__ import annotations

import json
import threading
from typing import TYPE_CHECKING, Any

from distconf.blocks.build import build_block
from distconf.blocks.kvcache import KVGeometry, kv_geometry

if TYPE_CHECKING:
    import torch

__all__ = [
    "block_size_bytes", "block_param_count", "layer_param_counts", "kv_cache_bytes_per_token", "bytes_per_value",
    "kv_geometry", "KVGeometry", "SIZE_MARGIN", "QUANT_BYTES",
]

SIZE_MARGIN = 1.01
"""Safety margin on a block's parameter bytes (Petals 2.x reserves 1 % more than the parameters)."""
QUANT_BYTES: dict[str, float] = {"int8": 1.0, "nf4": 4.25 / 8}
"""Bytes per parameter of each supported quantization (the one home of this table)."""


def bytes_per_value(dtype: torch.dtype | None = None, quant: str | None = None) -> float:
    """Bytes per parameter for ``dtype`` (default bfloat16) or a quantization (``int8``, ``nf4``)."""
    if quant is not None:
        if quant not in QUANT_BYTES:
            raise ValueError(f"quant={quant!r} is not supported; use None, 'int8' or 'nf4'")
        return QUANT_BYTES[quant]
    import torch

    dtype = torch.bfloat16 if dtype is None else dtype
    return torch.empty((), dtype=dtype, device="meta").element_size()


_counts_lock = threading.Lock()
_counts: dict[tuple[type, str], tuple[int, ...]] = {}


def _fingerprint(config: Any) -> str:
    return json.dumps(config.to_dict(), sort_keys=True, default=str)


def layer_param_counts(config: Any) -> tuple[int, ...]:
    """Parameters of every block of ``config`` (meta builds; cached per config contents).

    Blocks can differ per layer (dense and MoE layers, per-layer constructor choices).
    """
    key = (type(config), _fingerprint(config))
    counts = _counts.get(key)
    if counts is None:
        counts = tuple(sum(p.numel() for p in build_block(config, i, device="meta", buffers_device=None).parameters())
                       for i in range(config.num_hidden_layers))
        with _counts_lock:
            if len(_counts) > 256:
                _counts.clear()
            _counts[key] = counts
    return counts


def block_param_count(config: Any, layer_idx: int | None = None) -> int:
    """Parameters of block ``layer_idx`` (default: the largest block), counted on the meta device."""
    counts = layer_param_counts(config)
    if layer_idx is None:
        return max(counts)
    if not 0 <= layer_idx < len(counts):
        raise IndexError(f"layer_idx={layer_idx!r} out of range for num_hidden_layers={len(counts)}")
    return counts[layer_idx]


def block_size_bytes(config: Any, dtype: torch.dtype | None = None, quant: str | None = None, *,
                     layer_idx: int | None = None) -> int:
    """Bytes a block takes: parameters x bytes per value x 1.01.

    ``layer_idx`` selects the block; by default the largest block of the model (blocks
    differ per layer in MoE families with dense layers). ``dtype`` defaults to bfloat16;
    ``quant`` ('int8', 'nf4') overrides the bytes per value.
    """
    return int(block_param_count(config, layer_idx) * bytes_per_value(dtype, quant) * SIZE_MARGIN)


def kv_cache_bytes_per_token(config: Any, dtype: torch.dtype | None = None) -> int:
    """Bytes one block keeps in its KV cache per token (per sequence), in ``dtype`` (default bfloat16)."""
    return int(kv_geometry(config).values_per_token * bytes_per_value(dtype))
