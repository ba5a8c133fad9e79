"""A state each layer takes as a tuple and returns anew (``state.returned_tuple`` of a draft).

Some models keep their recurrent states in a cache class of their own (no transformers
``Cache``) and hand each layer its entry: the layer takes a tuple of state tensors (None without
a cache) and returns ``(hidden_states, new_state_tuple)``. `returned_state` recognises that
structure in the layer calls of a tiny model's run without a cache: the layer's
parameter that was given None and the shapes and dtypes of the tuple it returned, so the
state section is drafted as for any state (`returned_states` gives the per-layer states;
`apply_returned_state` writes the rest: the layer's keyword for it, the module given it, and
whether a bfloat16 model keeps the states in float32).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from distconf.tools.drafting.common import module_path
from distconf.tools.drafting.layer_state import LayerState

__all__ = ["ReturnedStateFound", "returned_state", "returned_states", "apply_returned_state"]

_STATE_WORDS = frozenset({"state", "states", "cache", "past"})


@dataclass(frozen=True)
class ReturnedStateFound:
    """The layer parameter taking the state tuple, and the shapes (without the batch) and dtypes it returns."""

    argument: str
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    mixer: type | None = None  # the module inside the layer that takes the state (the layer's recurrent mixer)


def _state_parameter(layer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """The parameter of ``layer.forward`` named like a state that this call gave None."""
    try:
        params = list(inspect.signature(layer.forward).parameters)
    except (TypeError, ValueError):
        return None
    given = {**dict(zip(params, args, strict=False)), **kwargs}
    names = [name for name, value in given.items()
             if value is None and _STATE_WORDS & set(name.lower().split("_"))]
    return names[0] if len(names) == 1 else None


def _mixer(layer: Any, argument: str) -> type | None:
    """The class of the first module inside ``layer`` whose forward takes ``argument``."""
    for module in layer.modules():
        try:
            if module is not layer and argument in inspect.signature(type(module).forward).parameters:
                return type(module)
        except (TypeError, ValueError):
            continue
    return None


def _returned(output: Any, batch: int) -> tuple[Any, ...] | None:
    """The tuple of state tensors a layer's output holds as its second entry (None: none)."""
    import torch

    if not isinstance(output, (tuple, list)) or len(output) != 2:
        return None
    state = output[1]
    if isinstance(state, (tuple, list)) and state and all(
            isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[0] == batch for t in state):
        return tuple(state)
    return None


def returned_state(calls: list[Any], layers: int, batch: int) -> ReturnedStateFound | None:
    """The state tuple every layer takes and returns, from the layer calls (`probe.LayerCall`) of a run of
    ``batch`` rows without a cache (None: not so)."""
    found: set[ReturnedStateFound] = set()
    for call in calls:
        state, name = _returned(call.output, batch), _state_parameter(call.module, call.args, call.kwargs)
        if state is None or name is None:
            return None
        found.add(ReturnedStateFound(name, tuple(tuple(int(d) for d in t.shape[1:]) for t in state),
                                     tuple(str(t.dtype).removeprefix("torch.") for t in state),
                                     _mixer(call.module, name)))
    return found.pop() if len(calls) == layers and len(found) == 1 else None


def returned_states(found: ReturnedStateFound, layers: int) -> list[LayerState]:
    """One `LayerState` per layer: the tuple's entries as its recurrent states (one per ``state_idx``)."""
    first, *rest = found.shapes
    return [LayerState(recurrent=first, extra_recurrents=tuple(rest), recurrent_dtype=found.dtypes[0])
            for _ in range(layers)]

_NO_CACHE_NOTES = ("forward takes no cache",)


def _bfloat16_dtypes(config_class: type, tiny: Mapping[str, Any], attn_implementation: str) -> set[str] | None:
    """The dtypes of the states a bfloat16 tiny model's layers return (None when it cannot run in bfloat16)."""
    from distconf.tools.drafting.probe import Forward, observe

    record = observe(config_class, tiny, attn_implementation,
                     Forward(use_cache=False, tokens=4, dtype="bfloat16", quiet=False))
    if record.error is not None:  # the float32 run has reported anything wrong with the config
        return None
    found = returned_state(record.calls, record.layer_count, 1)
    return set(found.dtypes) if found is not None else None


def apply_returned_state(draft: Any, layout: Any, found: ReturnedStateFound, config_class: type,
                         tiny: Mapping[str, Any]) -> bool:
    """Write ``state.returned_tuple`` and the layer's state keyword into ``draft``; whether a bfloat16 model keeps
    the states in float32."""
    layout.state["returned_tuple"] = True
    draft.call["cache_argument"] = found.argument
    if found.mixer is not None:
        draft.attention_class = module_path(found.mixer)
        draft.review[:] = [note for note in draft.review if not note.startswith("no *Attention module")]
    draft.facts[:] = [fact for fact in draft.facts if not any(note in fact for note in _NO_CACHE_NOTES)]
    draft.review[:] = [note for note in draft.review if not any(n in note for n in _NO_CACHE_NOTES)]
    draft.facts.append(f"each layer takes its {len(found.shapes)} states as a tuple ('{found.argument}') and "
                       "returns the new tuple next to its hidden states; blocks keep it per session")
    dtypes = _bfloat16_dtypes(config_class, tiny, draft.attn_implementation)
    if dtypes is None:
        draft.facts.append("the tiny model does not run in bfloat16 here: recurrent_dtype float32 is assumed")
    return dtypes is None or "float32" in dtypes
