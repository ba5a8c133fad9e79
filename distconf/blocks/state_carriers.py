"""Handing a block's state to a layer that keeps it outside transformers' cache-layer API.

Some layers read and write their recurrent state through methods of a cache class of their
own (``state.recurrent_methods`` of the family file: a getter taking the layer index, a setter
taking the layer index and the new state). `carry_state` wraps the block's cache object so
those methods answer from the session's state: the block's state tuple, its sizing, beam
reorder and batching stay those of every state-keeping block.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MethodStateCache", "carry_state"]


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


def carry_state(cache: Any, state_spec: Any) -> Any:
    """``cache`` as the layer expects it: wrapped in a `MethodStateCache` when the family's ``state`` section
    names methods of the layer's own cache (``recurrent_methods``), else unchanged."""
    methods = getattr(state_spec, "recurrent_methods", None)
    if cache is None or methods is None:
        return cache
    return MethodStateCache(cache, methods.get, methods.set)
