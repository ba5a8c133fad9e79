"""Handing a block's state to a layer that keeps it outside transformers' cache-layer API.

Some layers read and write their recurrent state through methods of a cache class of their
own (``state.recurrent_methods`` of the family file: a getter taking the layer index, a setter
taking the layer index and the new state); others take the model's state as a list of
``[batch, size, layers]`` tensors and use their own slice (``state.layer_list``), or take their own
states as a tuple and return the new one (``state.returned_tuple``).
`carry_state` gives the layer its session's state that way and collects it back: the block's
state tuple, its sizing, beam reorder and batching stay those of every state-keeping block.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MethodStateCache", "LayerStateList", "ReturnedState", "carry_state", "call_with_state",
           "steps_row_by_row", "row_by_row"]


class MethodStateCache:
    """A block cache (`distconf.blocks.state.BlockStateCache` or a hybrid one) with the layer's own state methods.

    The getter answers the recurrent state of earlier tokens (None before the first step), the
    setter keeps the one tensor it is given; every other call goes to the wrapped cache.
    """

    def __init__(self, inner: Any, get: str, set: str) -> None:
        self._inner, self._get, self._set = inner, get, set

    def _read(self, *args: Any, **kwargs: Any) -> Any:
        return self._inner.get_recurrent_state()

    def _write(self, *args: Any, **kwargs: Any) -> Any:
        import torch

        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if len(tensors) != 1:
            raise TypeError(f"{self._set}: expected one state tensor next to the layer index, got {len(tensors)}")
        return self._inner.update_recurrent_state(tensors[0])

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # not set yet (a copy being built): no delegation
            raise AttributeError(name)
        if name == self._get:
            return self._read
        if name == self._set:
            return self._write
        return getattr(self._inner, name)

    @property
    def present(self) -> Any:
        """The wrapped cache's present (the block's state tuple)."""
        return self._inner.present


class LayerStateList(list):  # type: ignore[type-arg]
    """The model's state list a layer taking ``state.layer_list`` gets: one ``[batch, size, layer_idx + 1]`` tensor
    per entry, this layer's slice (the last index) holding the session's state (or the initial values).

    The layer writes its slice in place; `present` reads it back as ``(conv, recurrent)``.
    """

    def __init__(self, state: Any, spec: Any, layer_idx: int, geometry: Any, hidden_states: Any) -> None:
        import torch

        conv_entries, initial = spec.conv_entries, spec.initial
        sizes = [*([geometry.conv_shape[-1]] * conv_entries if conv_entries else []),
                 *([geometry.recurrent_shape[-1]] * (len(initial) - conv_entries))]
        recurrent_dtype = torch.float32 if geometry.recurrent_float32 else hidden_states.dtype
        pasts = ([*(state.conv.unbind(1) if conv_entries else ()), *state.recurrent.unbind(1)]
                 if state.has_previous_state else [None] * len(initial))
        entries = []
        for i, (size, value, past) in enumerate(zip(sizes, initial, pasts, strict=True)):
            dtype = hidden_states.dtype if i < conv_entries else recurrent_dtype
            entry = torch.full((hidden_states.shape[0], size, layer_idx + 1), value, dtype=dtype,
                               device=hidden_states.device)
            if past is not None:
                entry[..., layer_idx] = past
            entries.append(entry)
        super().__init__(entries)
        self._layer_idx, self._conv_entries = layer_idx, conv_entries

    @property
    def present(self) -> tuple[Any, Any]:
        """``(conv, recurrent)``: this layer's slices, stacked as ``[batch, entries, size]`` (conv None without)."""
        import torch

        slices = [entry[..., self._layer_idx] for entry in self]
        conv = torch.stack(slices[:self._conv_entries], dim=1) if self._conv_entries else None
        return conv, torch.stack(slices[self._conv_entries:], dim=1)


def carry_state(cache: Any, settings: Any, hidden_states: Any) -> Any:
    """``cache`` as the layer expects it (``settings``: the block's `distconf.blocks.layer_settings.LayerSettings`).

    Wrapped in a `MethodStateCache` when the family's ``state`` section names methods of the layer's
    own cache (``recurrent_methods``); a `LayerStateList` when the layer takes the model's state list
    (``layer_list``); a `ReturnedState` when it takes and returns a tuple (``returned_tuple``); else unchanged.
    """
    from distconf.blocks.state import BlockStateCache, state_geometry

    spec = type(settings.config).family_spec.state
    if cache is None or spec is None:
        return cache
    if spec.layer_list is not None:
        if not isinstance(cache, BlockStateCache):
            raise TypeError("state.layer_list: a layer taking its state as a list keeps no K/V besides")
        return LayerStateList(cache, spec.layer_list, settings.layer_idx,
                              state_geometry(settings.config, settings.layer_idx), hidden_states)
    if spec.returned_tuple:
        if not isinstance(cache, BlockStateCache):
            raise TypeError("state.returned_tuple: a layer returning its state keeps no K/V besides")
        return ReturnedState(cache)
    if spec.recurrent_methods is not None:
        return MethodStateCache(cache, spec.recurrent_methods.get, spec.recurrent_methods.set)
    return cache


def steps_row_by_row(settings: Any, hidden_states: Any, layer_past: Any, use_cache: bool) -> bool:
    """Whether this call is a one-token step given a state (an earlier one, or a first one kept), of several
    rows, that the family runs one row at a time (``state.one_token_rows: one_at_a_time``)."""
    spec = type(settings.config).family_spec.state
    return (spec is not None and spec.one_token_rows == "one_at_a_time" and settings.keeps_state
            and (layer_past is not None or use_cache) and hidden_states.shape[0] > 1 and hidden_states.shape[1] == 1)


def row_by_row(forward: Any, hidden_states: Any, layer_past: tuple[Any, ...] | None, use_cache: bool,
               rows: Any = None) -> tuple[Any, tuple[Any, ...] | None]:
    """``forward`` (a block's) run on each row alone; the outputs and the caches concatenated back into rows."""
    import dataclasses

    import torch

    outputs, presents = [], []
    for r in range(hidden_states.shape[0]):
        row_rows = None if rows is None else dataclasses.replace(
            rows, padding_mask=rows.padding_mask[r:r + 1], position_ids=rows.position_ids[r:r + 1])
        past = None if layer_past is None else tuple(None if t is None else t[r:r + 1] for t in layer_past)
        out, present = forward(hidden_states[r:r + 1], layer_past=past, use_cache=use_cache, rows=row_rows)
        outputs.append(out)
        presents.append(present)
    if not use_cache or presents[0] is None:
        return torch.cat(outputs, dim=0), None
    merged = tuple(None if parts[0] is None else torch.cat(parts, dim=0) for parts in zip(*presents, strict=True))
    return torch.cat(outputs, dim=0), merged


class ReturnedState:
    """The state a layer taking ``state.returned_tuple`` gets and gives back: its session's states as one tuple
    (None before the first token) under the block's cache keyword, the new tuple as its output's second entry."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    @property
    def argument(self) -> tuple[Any, ...] | None:
        """The tuple the layer gets: the kept conv states, then the recurrent ones (None before the first token)."""
        inner = self._inner
        if not inner.has_previous_state:
            return None
        return tuple(t for t in (*inner.convs, *inner.recurrents) if t is not None)

    def keep(self, output: Any, conv_states: int) -> None:
        """Keep the tuple the layer returned (its first ``conv_states`` entries are conv states)."""
        returned = output[1] if isinstance(output, (tuple, list)) and len(output) > 1 else None
        if not isinstance(returned, (tuple, list)):
            raise TypeError("state.returned_tuple: the layer's output holds no state tuple as its second entry")
        if conv_states:
            self._inner.convs[:conv_states] = list(returned[:conv_states])
        self._inner.recurrents[:] = list(returned[conv_states:])

    @property
    def present(self) -> Any:
        """The wrapped cache's present (the block's state tuple)."""
        return self._inner.present


def call_with_state(forward: Any, hidden_states: Any, kwargs: dict[str, Any], cache: Any, settings: Any) -> Any:
    """``forward(hidden_states, **kwargs)``; a `ReturnedState` cache goes in as its tuple and keeps what comes out."""
    if not isinstance(cache, ReturnedState):
        return forward(hidden_states, **kwargs)
    name = settings.spec.call.cache_argument
    output = forward(hidden_states, **{**kwargs, name: cache.argument})
    cache.keep(output, len(type(settings.config).family_spec.state.conv_shapes))
    return output
