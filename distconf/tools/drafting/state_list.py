"""A state the model hands its layers as a list of per-layer tensors (``state.layer_list`` of a draft).

Some models keep their whole state as a list of ``[batch, size, num_hidden_layers]`` tensors,
returned under a model output key and passed to every layer under the same keyword; each
layer reads and writes its own slice ``[..., layer_idx]``. `find_state_list` recognises that
structure on the tiny model's output (`distconf.tools.drafting.state_list_draft` writes it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from distconf.tools.drafting.layer_state import LayerState

__all__ = ["StateListFound", "find_state_list", "list_states"]

_STATE_OUTPUTS = ("state", "states", "cache_params")


@dataclass(frozen=True)
class StateListFound:
    """The model output key (and layer keyword) of the state list, and each entry's size."""

    name: str
    sizes: tuple[int, ...]


def find_state_list(result: Any, layers: int) -> StateListFound | None:
    """The list of ``[batch, size, layers]`` tensors a tiny model's output holds as its state (None: none)."""
    import torch

    get = getattr(result, "get", None)
    if not callable(get):
        return None
    for name in _STATE_OUTPUTS:
        value = get(name)
        if isinstance(value, (list, tuple)) and value and all(
                isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[-1] == layers for t in value):
            return StateListFound(name, tuple(int(t.shape[1]) for t in value))
    return None


def list_states(found: StateListFound, layers: int) -> list[LayerState]:
    """One `LayerState` per layer: the entries' common size as its recurrent shape (the entry count is added
    by `distconf.tools.drafting.state_list_draft`, which refuses entries of different sizes)."""
    return [LayerState(recurrent=(found.sizes[0],), recurrent_dtype="float32") for _ in range(layers)]
