"""The cache object of a layer that keeps both K/V and a per-sequence state (attention and a recurrent
mixer side by side in one layer).

Its past is ``(key, value, conv, recurrent)``: the K/V part first, then the state part, the order
every block past follows (`distconf.blocks.adapter.BlockAdapter.forward`).
"""

from __future__ import annotations

from typing import Any

from distconf.blocks.kvcache import BlockKVCache
from distconf.blocks.state import BlockStateCache

__all__ = ["BlockHybridCache"]


class BlockHybridCache:
    """K/V calls (``update``, ``get_seq_length``, ``get_mask_sizes``, ``get_query_offset``) go to a `BlockKVCache`,
    state calls to a `BlockStateCache`."""

    def __init__(self, kv: BlockKVCache, state: BlockStateCache) -> None:
        self.kv, self.state = kv, state

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        """Tokens already cached (the K/V part counts them)."""
        return self.kv.get_seq_length(layer_idx)

    def get_mask_sizes(self, query_length: int, layer_idx: int | None = 0) -> tuple[int, int]:
        """See `BlockKVCache.get_mask_sizes`."""
        return self.kv.get_mask_sizes(query_length, layer_idx)

    def get_query_offset(self, layer_idx: int | None = 0) -> int:
        """See `BlockKVCache.get_query_offset`."""
        return self.kv.get_query_offset(layer_idx)

    def update(self, key_states: Any, value_states: Any, layer_idx: int | None = None,
               *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        """Append K/V entries (`BlockKVCache.update`)."""
        return self.kv.update(key_states, value_states, layer_idx, *args, **kwargs)

    def is_recording_past(self, layer_idx: int | None = None) -> bool:
        """See `BlockStateCache.is_recording_past`."""
        return self.state.is_recording_past(layer_idx)

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        """See `BlockStateCache.get_recurrent_states_to_keep`."""
        return self.state.get_recurrent_states_to_keep(layer_idx)

    def increase_count(self, layer_idx: int | None = None, state_idx: int = 0) -> None:
        """See `BlockStateCache.increase_count`."""
        self.state.increase_count(layer_idx, state_idx)

    def get_conv_state(self, layer_idx: int | None = None, state_idx: int = 0) -> Any:
        """See `BlockStateCache.get_conv_state`."""
        return self.state.get_conv_state(layer_idx, state_idx)

    def get_recurrent_state(self, layer_idx: int | None = None, state_idx: int = 0) -> Any:
        """See `BlockStateCache.get_recurrent_state`."""
        return self.state.get_recurrent_state(layer_idx, state_idx)

    def update_conv_state(self, conv_states: Any, layer_idx: int | None = None, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs: Any) -> Any:
        """See `BlockStateCache.update_conv_state`."""
        return self.state.update_conv_state(conv_states, layer_idx, state_idx, conv_kernel_size, **kwargs)

    def update_recurrent_state(self, recurrent_states: Any, layer_idx: int | None = None, state_idx: int = 0,
                               **kwargs: Any) -> Any:
        """See `BlockStateCache.update_recurrent_state`."""
        return self.state.update_recurrent_state(recurrent_states, layer_idx, state_idx, **kwargs)

    @property
    def present(self) -> tuple[Any, ...] | None:
        """``(key, value, conv, recurrent)`` (every conv, then every recurrent state when the layer keeps several),
        or None if the layer kept nothing."""
        kv, state = self.kv.present, self.state.present
        if kv is None and state is None:
            return None
        return (*(kv or (None, None)), *(state or (None,) * self.state.width))
