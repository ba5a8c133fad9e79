"""What one layer of a tiny model's transformers cache holds: conv and recurrent state shapes, K/V or nothing."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["LayerState", "layer_states"]


@dataclass(frozen=True)
class LayerState:
    """What one layer of a tiny model's cache holds (shapes without the batch dimension)."""

    conv: tuple[int, ...] | None = None
    recurrent: tuple[int, ...] | None = None
    recurrent_dtype: str | None = None  # torch dtype name
    conv_dtype: str | None = None  # torch dtype name of the first conv state
    kv: bool = False
    extra_convs: tuple[tuple[int, ...], ...] = ()  # conv states of cache state_idx 1 and up
    extra_recurrents: tuple[tuple[int, ...], ...] = ()  # recurrent states of state_idx 1 and up
    gap: bool = False  # a state_idx below a kept one keeps nothing

    @property
    def keeps_state(self) -> bool:
        """The layer keeps a conv or a recurrent state."""
        return self.conv is not None or self.recurrent is not None

    def shapes(self, kind: str) -> tuple[tuple[int, ...], ...]:
        """The shapes of the layer's ``kind`` (``conv`` / ``recurrent``) states, one per ``state_idx``."""
        first = getattr(self, kind)
        return () if first is None else (first, *getattr(self, f"extra_{kind}s"))


def layer_states(cache: Any) -> list[LayerState]:
    """One `LayerState` per layer of a transformers cache (empty when it has no layers)."""
    found = []
    for layer in getattr(cache, "layers", None) or []:
        convs, conv_gap = _by_index(getattr(layer, "conv_states", None))
        recurrents, recurrent_gap = _by_index(getattr(layer, "recurrent_states", None))
        keys = getattr(layer, "keys", None)
        found.append(LayerState(
            conv=convs[0] if convs else None, recurrent=recurrents[0] if recurrents else None,
            recurrent_dtype=_first_dtype(getattr(layer, "recurrent_states", None)),
            conv_dtype=_first_dtype(getattr(layer, "conv_states", None)),
            kv=getattr(keys, "dim", lambda: 0)() == 4, extra_convs=tuple(convs[1:]),
            extra_recurrents=tuple(recurrents[1:]), gap=conv_gap or recurrent_gap))
    return found


def _by_index(states: Mapping[int, Any] | None) -> tuple[list[tuple[int, ...]], bool]:
    """The shapes (without the batch dimension) of a cache layer's states in ``state_idx`` order, up to the last
    kept one, and whether a lower ``state_idx`` keeps nothing."""
    items = sorted((states or {}).items())
    kept = [i for i, (_, t) in enumerate(items) if t is not None]
    if not kept:
        return [], False
    listed = items[:kept[-1] + 1]
    gap = any(t is None for _, t in listed)
    return [tuple(int(d) for d in t.shape[1:]) for _, t in listed if t is not None], gap


def _first_dtype(states: Mapping[int, Any] | None) -> str | None:
    """The torch dtype name of a cache layer's first kept state (None: none kept)."""
    first = next((t for _, t in sorted((states or {}).items()) if t is not None), None)
    return None if first is None else str(first.dtype).removeprefix("torch.")
