"""The contract between a served block and whoever keeps its cache: what the block keeps (`BlockCapabilities`)
and the typed slots of what a call continues from and returns (`LayerPast`).

A block is called ``hidden, present = block(hidden, layer_past=past, use_cache=True)`` (`distconf.blocks.adapter`);
``past`` and ``present`` are tuples in one convention, packed and unpacked here only:

- a layer that keeps K/V: ``(key, value)``, or ``(key, value, indexer)`` with a sparse-attention indexer's keys;
- a layer that keeps a per-sequence state: its ``state_width`` tensors (conv states, recurrent states, then the
  token count when the family counts positions);
- a layer that keeps both: ``(key, value, *state)``; a layer that keeps nothing: None.

Keys and values are ``[batch, kv_heads, tokens, head_dim]``, indexer keys ``[batch, tokens, dim]``, every state
tensor has the batch first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["BlockCapabilities", "LayerPast"]


@dataclass(frozen=True)
class BlockCapabilities:
    """What one served block keeps between calls, as the server needs to know it."""

    keeps_kv: bool = True
    """The block keeps a K/V cache (False for a recurrent or MLP-only layer)."""
    keeps_state: bool = False
    """The block keeps a per-sequence state (its family's ``state`` section, for this layer's type)."""
    state_width: int = 2
    """Tensors of the state part: conv states, recurrent states, then the token count (``state.counts_positions``)."""
    indexer_dim: int = 0
    """Width of a sparse-attention indexer's keys kept next to K/V (0: none)."""
    positions_from_cache_length: bool = False
    """The layer reads positions from its cache's length (``block.position.from_cache_length``): rows computed
    together must stand at one position."""

    @property
    def keeps_indexer(self) -> bool:
        """The block keeps a sparse-attention indexer's keys next to K/V."""
        return self.keeps_kv and self.indexer_dim > 0


@dataclass(frozen=True)
class LayerPast:
    """The typed slots of one block call's past or present (any slot None when the block keeps none or has
    seen no token yet)."""

    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    indexer: torch.Tensor | None = None
    state: tuple[Any, ...] | None = None

    def pack(self, caps: BlockCapabilities) -> tuple[Any, ...] | None:
        """The block's calling convention for these slots (None for a block that keeps nothing)."""
        kv: tuple[Any, ...] = (self.keys, self.values)
        if self.indexer is not None and not caps.keeps_state:
            kv = (*kv, self.indexer)
        state = self.state if self.state is not None else (None,) * caps.state_width
        if caps.keeps_kv and caps.keeps_state:
            return (*kv, *state)
        if caps.keeps_kv:
            return kv
        return tuple(state) if caps.keeps_state else None

    @classmethod
    def unpack(cls, packed: tuple[Any, ...] | None, caps: BlockCapabilities) -> LayerPast:
        """The slots of a past or present in the calling convention (empty slots None)."""
        if packed is None:
            return cls()
        keys = values = indexer = None
        state: tuple[Any, ...] | None = None
        if caps.keeps_kv:
            keys, values = packed[0], packed[1]
            if not caps.keeps_state and len(packed) > 2:  # an indexer's keys, declared or not (the checker finds it)
                indexer = packed[2]
            if keys is None:
                keys = values = indexer = None
        if caps.keeps_state:
            start = 2 if caps.keeps_kv else 0
            state = tuple(packed[start:start + caps.state_width])
            if all(t is None for t in state):
                state = None
        return cls(keys, values, indexer, state)
