"""Memory cost of a block and of its KV cache, from the family file alone.

- ``block_size_bytes``: the exact bytes of the block's parameters (built on the meta device,
  no memory) x 1.01: unquantized, every parameter in the dtype; quantized, the rule of
  `distconf.blocks.quant.block_bytes` (Linear weights quantized with their scales/absmax,
  everything else in the dtype), so that a plan and a server agree. By default the largest
  block of the model (every layer is built once on meta per distinct config; later calls
  hit a cache).
- ``kv_cache_bytes_per_token``: values the block caches per token (the family's
  ``kv_cache`` section, see `distconf.kvcache.kv_geometry`) x bytes per value.
"""

from __future__ import annotations

import json
import threading
from typing import TYPE_CHECKING

from distconf.blocks.build import build_block
from distconf.blocks.kvcache import KVGeometry, kv_geometry
from distconf.blocks.quant import QUANT_BYTES, normalize_quant
from distconf.blocks.state import state_geometry
from distconf.loader.config_protocol import DistributedConfig
from distconf.loader.layer_stack import model_layer
from distconf.loader.naming import config_num_blocks

if TYPE_CHECKING:
    import torch

__all__ = [
    "block_size_bytes", "block_param_count", "layer_param_counts", "kv_cache_bytes_per_token", "bytes_per_value",
    "kv_geometry", "KVGeometry", "SIZE_MARGIN", "QUANT_BYTES", "layer_sizes", "state_bytes_per_sequence",
]

SIZE_MARGIN = 1.01
"""Safety margin on a block's parameter bytes (Petals 2.x reserves 1 % more than the parameters)."""


def bytes_per_value(dtype: torch.dtype | None = None, quant: str | None = None) -> float:
    """Bytes per value for ``dtype`` (default bfloat16), or per quantized Linear weight value.

    For ``quant`` (``int8``, ``nf4``) it is `distconf.blocks.quant.QUANT_BYTES`; a block's
    size also counts per-row tables and its unquantized parameters (`block_size_bytes`).
    """
    quant = normalize_quant(quant)
    if quant is not None:
        return QUANT_BYTES[quant]
    import torch

    dtype = torch.bfloat16 if dtype is None else dtype
    return torch.empty((), dtype=dtype, device="meta").element_size()


_counts_lock = threading.Lock()
_counts: dict[tuple[type, str], tuple[int, ...]] = {}
_sizes: dict[tuple[type, str, str, str | None, str], tuple[int, ...]] = {}


def _fingerprint(config: DistributedConfig) -> str:
    return json.dumps(config.to_dict(), sort_keys=True, default=str)


def layer_param_counts(config: DistributedConfig) -> tuple[int, ...]:
    """Parameters of every block of ``config`` (meta builds; cached per config contents).

    Blocks can differ per layer (dense and MoE layers, per-layer constructor choices).
    """
    key = (type(config), _fingerprint(config))
    counts = _counts.get(key)
    if counts is None:
        counts = tuple(sum(p.numel() for p in build_block(config, i, device="meta", buffers_device=None).parameters())
                       for i in range(config_num_blocks(config)))
        with _counts_lock:
            if len(_counts) > 256:
                _counts.clear()
            _counts[key] = counts
    return counts


def block_param_count(config: DistributedConfig, layer_idx: int | None = None) -> int:
    """Parameters of block ``layer_idx`` (default: the largest block), counted on the meta device."""
    counts = layer_param_counts(config)
    if layer_idx is None:
        return max(counts)
    if not 0 <= layer_idx < len(counts):
        raise IndexError(f"layer_idx={layer_idx!r} out of range for {len(counts)} blocks")
    return counts[layer_idx]


def layer_sizes(config: DistributedConfig, dtype: torch.dtype | None = None, quant: str | None = None, *,
                device_type: str = "cpu") -> tuple[int, ...]:
    """Exact parameter bytes of every block of ``config`` in ``dtype``/``quant`` (no margin; cached).

    Unquantized: parameters x the dtype's size. Quantized: `distconf.blocks.quant.block_bytes`
    of each block built on meta (what `quantize_block` leaves on ``device_type``).
    """
    import torch

    dtype = torch.bfloat16 if dtype is None else dtype
    quant = normalize_quant(quant)
    if quant is None:
        value_bytes = int(bytes_per_value(dtype))
        return tuple(count * value_bytes for count in layer_param_counts(config))
    key = (type(config), _fingerprint(config), str(dtype), quant, device_type)
    sizes = _sizes.get(key)
    if sizes is None:
        from distconf.blocks.quant import block_bytes

        sizes = tuple(block_bytes(build_block(config, i, device="meta", buffers_device=None), dtype, quant,
                                  device_type=device_type) for i in range(config_num_blocks(config)))
        with _counts_lock:
            if len(_sizes) > 256:
                _sizes.clear()
            _sizes[key] = sizes
    return sizes


def block_size_bytes(config: DistributedConfig, dtype: torch.dtype | None = None, quant: str | None = None, *,
                     layer_idx: int | None = None, device_type: str = "cpu") -> int:
    """Bytes a block takes: its exact parameter bytes (`layer_sizes`) x 1.01.

    ``layer_idx`` selects the block; by default the largest block of the model (blocks
    differ per layer in MoE families with dense layers). ``dtype`` defaults to bfloat16;
    ``quant`` (None/'none', 'int8', 'nf4') quantizes the Linear weights as a server does.
    """
    sizes = layer_sizes(config, dtype, quant, device_type=device_type)
    if layer_idx is None:
        return int(max(sizes) * SIZE_MARGIN)
    if not 0 <= layer_idx < len(sizes):
        raise IndexError(f"layer_idx={layer_idx!r} out of range for {len(sizes)} blocks")
    return int(sizes[layer_idx] * SIZE_MARGIN)


def kv_cache_bytes_per_token(config: DistributedConfig, dtype: torch.dtype | None = None,
                             layer_idx: int | None = None) -> int:
    """Bytes block ``layer_idx`` keeps in its KV cache per token (per sequence), in ``dtype`` (default bfloat16).

    Without ``layer_idx``: what a K/V-keeping block of the family keeps (0 if none does).
    """
    layer = None if layer_idx is None else model_layer(config, layer_idx)
    return int(kv_geometry(config, layer).values_per_token * bytes_per_value(dtype))


def state_bytes_per_sequence(config: DistributedConfig, dtype: torch.dtype | None = None,
                             layer_idx: int | None = None) -> int:
    """Bytes of state block ``layer_idx`` keeps per sequence in ``dtype`` (the family's ``state`` section; 0 for a
    block that keeps none). Without ``layer_idx``: what a state-keeping block of the family keeps."""
    geometry = state_geometry(config, None if layer_idx is None else model_layer(config, layer_idx))
    if geometry is None:
        return 0
    recurrent_bytes = 4 if geometry.recurrent_float32 else bytes_per_value(dtype)
    conv_bytes = 4 if geometry.conv_float32 else bytes_per_value(dtype)
    counted = 8 if geometry.counts_positions else 0  # the token count: one int64
    return int(geometry.conv_values * conv_bytes + geometry.recurrent_values * recurrent_bytes + counted)
