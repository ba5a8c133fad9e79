"""The cache object of a block whose layer module holds several attention sublayers, each keeping its own K/V
(``kv_cache.sublayers``).

The module calls ``cache.update(key, value, layer_idx)`` once per sublayer, each with its own layer index.
Each sublayer gets a `BlockKVCache` of its own, in the order the module first calls them; the block's
past keeps them side by side along the head axis (``[batch, sublayers * kv_heads, tokens, head_dim]``), so
sessions, beams and batches handle it as one K/V of more heads.
"""

from __future__ import annotations

from typing import Any

from distconf.blocks.kvcache import BlockKVCache

__all__ = ["BlockSublayerKVCache"]


class BlockSublayerKVCache:
    """K/V calls of each sublayer (told apart by the ``layer_idx`` it passes) go to that sublayer's cache."""

    def __init__(self, past: tuple[Any, ...] | None, num_kv_heads: int, layer_writes: str, sublayers: int) -> None:
        heads = num_kv_heads // sublayers
        parts: list[tuple[Any, Any] | None] = [None] * sublayers
        if past is not None:
            keys, values = past[0].chunk(sublayers, dim=1), past[1].chunk(sublayers, dim=1)
            parts = list(zip(keys, values))
        self.slots = [BlockKVCache(part, heads, layer_writes) for part in parts]
        self.slot_of: dict[Any, BlockKVCache] = {}

    def _slot(self, layer_idx: Any) -> BlockKVCache:
        slot = self.slot_of.get(layer_idx)
        if slot is None:
            if len(self.slot_of) == len(self.slots):
                raise RuntimeError(f"the layer calls its cache with more than {len(self.slots)} layer indices "
                                   "(kv_cache.sublayers)")
            slot = self.slot_of[layer_idx] = self.slots[len(self.slot_of)]
        return slot

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        """Tokens already cached (every sublayer holds the same number)."""
        return self.slots[0].get_seq_length()

    def update(self, key_states: Any, value_states: Any, layer_idx: int | None = None,
               *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        """Append a sublayer's new entries (`BlockKVCache.update`)."""
        return self._slot(layer_idx).update(key_states, value_states, layer_idx, *args, **kwargs)

    @property
    def present(self) -> tuple[Any, Any] | None:
        """Every sublayer's ``(key, value)`` side by side along the head axis, or None if none cached."""
        import torch

        presents = [slot.present for slot in self.slots]
        if any(p is None for p in presents):
            return None
        return (torch.cat([p[0] for p in presents], dim=1), torch.cat([p[1] for p in presents], dim=1))
