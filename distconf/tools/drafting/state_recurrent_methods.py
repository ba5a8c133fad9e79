"""A recurrent state kept by methods of a model's own cache class (``state.recurrent_methods`` of a draft).

Some models subclass transformers' cache and keep their recurrent states in a list attribute
of it, one entry per layer, read by a getter taking the layer index and written by a setter
taking the layer index and the new state. `find_state_methods` recognises that structure on
the tiny model's cache by calling its own methods on a copy; `with_method_states` adds those
states to the per-layer `LayerState` list, so the state section is drafted as for any state.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, replace
from typing import Any

from distconf.tools.drafting.layer_state import LayerState

__all__ = ["StateMethodsFound", "find_state_methods", "with_method_states"]


@dataclass(frozen=True)
class StateMethodsFound:
    """The list attribute of a cache holding per-layer states, and its getter and setter."""

    attribute: str
    get: str
    set: str


def _per_layer_lists(cache: Any) -> list[str]:
    """Attributes of ``cache`` (besides its layers) holding a list with a tensor in some entries."""
    import torch

    return sorted(name for name, value in vars(cache).items()
                  if name != "layers" and isinstance(value, list)
                  and any(isinstance(item, torch.Tensor) for item in value))


def _own_methods(cache: Any, arity: int) -> list[str]:
    """Methods defined by the model's own cache classes (not transformers') taking ``arity`` positional arguments."""
    from transformers.cache_utils import Cache

    names = []
    for cls in type(cache).__mro__:
        if cls is object or issubclass(Cache, cls) or cls.__module__ == Cache.__module__:
            continue
        for name, function in vars(cls).items():
            if name.startswith("_") or not inspect.isfunction(function):
                continue
            params = list(inspect.signature(function).parameters.values())[1:]
            required = [p for p in params if p.default is p.empty
                        and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
            if len(required) == arity:
                names.append(name)
    return list(dict.fromkeys(names))


def _trial(cache: Any, attribute: str) -> Any:
    """A copy of ``cache`` whose ``attribute`` list can be changed without touching the original."""
    trial = copy.copy(cache)
    setattr(trial, attribute, list(getattr(cache, attribute)))
    return trial


def find_state_methods(cache: Any) -> StateMethodsFound | None:
    """The getter and setter through which ``cache`` keeps per-layer states in a list attribute (None: none)."""
    import torch
    from transformers.cache_utils import Cache

    if not isinstance(cache, Cache):
        return None
    for attribute in _per_layer_lists(cache):
        entries = getattr(cache, attribute)
        index = next(i for i, item in enumerate(entries) if isinstance(item, torch.Tensor))
        marker = torch.zeros_like(entries[index])
        setter = getter = None
        for name in _own_methods(cache, 2):
            trial = _trial(cache, attribute)
            try:
                getattr(trial, name)(index, marker)
            except Exception:  # not a setter of this list
                continue
            if getattr(trial, attribute)[index] is marker:
                setter = name
                break
        for name in _own_methods(cache, 1):
            trial = _trial(cache, attribute)
            getattr(trial, attribute)[index] = marker
            try:
                if getattr(trial, name)(index) is marker:
                    getter = name
                    break
            except Exception:  # not a getter of this list
                continue
        if setter is not None and getter is not None:
            return StateMethodsFound(attribute, getter, setter)
    return None


def with_method_states(cache: Any, states: list[LayerState], found: StateMethodsFound | None) -> list[LayerState]:
    """``states`` (one per cache layer) with the recurrent states ``found`` keeps, one entry per model layer."""
    if found is None:
        return states
    import torch

    entries = getattr(cache, found.attribute)
    out = list(states) + [LayerState() for _ in range(len(entries) - len(states))]
    for i, item in enumerate(entries):
        if isinstance(item, torch.Tensor):
            out[i] = replace(out[i], recurrent=tuple(int(d) for d in item.shape[1:]),
                             recurrent_dtype=str(item.dtype).removeprefix("torch."))
    return out
