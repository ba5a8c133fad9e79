"""A layer whose modules keep their per-sequence state in attributes of their own, and the token count a block
keeps next to its state.

Some layers keep no cache object: their modules store the conv and recurrent states as attributes
(``self.conv1d_state``, ``self.rg_lru.recurrent_states``) and reuse them at the next call. The family
names those attributes (``state.module_attributes``, paths below the layer module) and their shapes
(``state.conv_shape`` / ``state.recurrent_shape``); `held_in_modules` sets them to one call's rows (a
session's states, zeros of the declared shapes before the first token), reads them back into the block's
state after the call and clears them, so the modules hold nothing between calls and sessions, batches,
beams and replays go through the block's state tuple like every other state. A lock per layer keeps
two calls of one block (several compute threads) from sharing the attributes.

A layer reading true positions (``state.counts_positions``, e.g. resetting its state at position 0) has
no K/V to count the tokens seen: the block keeps one int64 per sequence as the last entry of its state
(`split_count`, `with_count`) and gives the layer its positions from it (`counted_positions`).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["held_in_modules", "split_count", "with_count", "counted_positions"]

_LOCKS: weakref.WeakKeyDictionary[Any, threading.Lock] = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def _lock(layer: Any) -> threading.Lock:
    with _LOCKS_GUARD:
        lock = _LOCKS.get(layer)
        if lock is None:
            lock = _LOCKS[layer] = threading.Lock()
        return lock


def _owner(layer: Any, path: str) -> tuple[Any, str]:
    """The module holding attribute ``path`` (dotted, below ``layer``) and the attribute's name."""
    prefix, _, name = path.rpartition(".")
    try:
        return (layer.get_submodule(prefix) if prefix else layer), name
    except AttributeError:
        raise AttributeError(f"state.module_attributes: the layer has no module {prefix!r} (for {path!r})") from None


def _state_of(cache: Any) -> Any:
    """The `distconf.blocks.state.BlockStateCache` of a block's cache object (None: no cache this call)."""
    return getattr(cache, "state", cache) if cache is not None else None


@contextmanager
def held_in_modules(layer: Any, settings: Any, cache: Any, hidden_states: Any) -> Iterator[None]:
    """Around one layer call: the family's ``state.module_attributes`` hold this call's states, then go back into
    ``cache``'s state and are cleared (nothing to do for a family without them)."""
    spec = type(settings.config).family_spec.state
    attributes = spec.module_attributes if spec is not None and settings.keeps_state else None
    if attributes is None:
        yield
        return
    import torch

    from distconf.blocks.state import state_geometry

    geometry = state_geometry(settings.config, settings.layer_idx)
    state = _state_of(cache)
    entries = [("conv", i, path, shape, geometry.conv_float32)
               for i, (path, shape) in enumerate(zip(attributes.conv, geometry.conv_shapes, strict=True))]
    entries += [("recurrent", i, path, shape, geometry.recurrent_float32)
                for i, (path, shape) in enumerate(zip(attributes.recurrent, geometry.recurrent_shapes, strict=True))]
    batch, device = hidden_states.shape[0], hidden_states.device
    with _lock(layer):
        try:
            for kind, i, path, shape, float32 in entries:
                past = getattr(state, f"{kind}s")[i] if state is not None and state.has_previous_state else None
                value = past if past is not None else torch.zeros(
                    (batch, *shape), dtype=torch.float32 if float32 else hidden_states.dtype, device=device)
                owner, name = _owner(layer, path)
                setattr(owner, name, value)
            yield
            if state is not None:
                for kind, i, path, _, _ in entries:
                    owner, name = _owner(layer, path)
                    getattr(state, f"{kind}s")[i] = getattr(owner, name, None)
        finally:
            for _, _, path, _, _ in entries:
                owner, name = _owner(layer, path)
                setattr(owner, name, None)


def split_count(state_past: tuple[Any, ...] | None, settings: Any) -> tuple[tuple[Any, ...] | None, Any]:
    """(the states, the token count ``[batch, 1]``) of the state part of a block's past (the count None when the
    family keeps none, ``state.counts_positions``, or before the first token)."""
    if not settings.counts_positions or state_past is None:
        return state_past, None
    *states, count = state_past
    return (None if all(t is None for t in states) else tuple(states)), count


def counted_positions(count: Any, hidden_states: Any) -> Any:
    """Each row's positions ``[batch, seq]`` after ``count`` ``[batch, 1]`` tokens seen."""
    import torch

    steps = torch.arange(hidden_states.shape[1], device=hidden_states.device)
    return count.to(hidden_states.device) + steps.unsqueeze(0)


def with_count(present: tuple[Any, ...] | None, count: Any, hidden_states: Any, settings: Any) -> Any:
    """``present`` followed by the token count after this call's tokens (unchanged without ``counts_positions``,
    or when the layer kept nothing)."""
    if not settings.counts_positions or present is None:
        return present
    import torch

    batch, new = hidden_states.shape[:2]
    seen = count if count is not None else torch.zeros(batch, 1, dtype=torch.long, device=hidden_states.device)
    return (*present, seen + new)
