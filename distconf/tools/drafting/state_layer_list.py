"""A state the model hands its layers as a list of per-layer tensors (``state.layer_list`` of a draft).

Some models keep their whole state as a list of ``[batch, size, num_hidden_layers]`` tensors,
returned under a model output key and passed to every layer under the same keyword; each
layer reads and writes its own slice ``[..., layer_idx]``. `find_state_list` recognises that
structure on the tiny model's output; `apply_state_list` writes it into the draft: the entries'
split (leading entries kept in the model's dtype form the conv state, the float32 rest the
recurrent one), their initial values (read as the first layer receives them), whether one-token
steps of several rows need running row by row, and the layer's keyword.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from distconf.tools.drafting.common import DraftingError
from distconf.tools.drafting.layer_state import LayerState
from distconf.tools.drafting.render import FamilyDraft

__all__ = ["StateListFound", "find_state_list", "list_states", "apply_state_list"]

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
    by `apply_state_list`, which refuses entries of different sizes)."""
    return [LayerState(recurrent=(found.sizes[0],), recurrent_dtype="float32") for _ in range(layers)]

_NO_CACHE_NOTES = ("forward takes no cache",)


def _first_layer_state(config_class: type, tiny: Mapping[str, Any], attn_implementation: str,
                       name: str, dtype: Any) -> tuple[list[Any], list[Any]] | None:
    """(the state list as the first layer receives it, as the model returns it), in ``dtype``; None if it fails."""
    from distconf.tools.drafting.probe import Forward, observe

    record = observe(config_class, tiny, attn_implementation,
                     Forward(use_cache=True, tokens=4, dtype=str(dtype).removeprefix("torch."), quiet=False))
    if record.error is not None:  # the float32 run has reported anything wrong with the config
        return None
    seen = next((call.lists[name] for call in record.of_layer(0) if name in call.lists), [])
    result = record.result
    returned = result.get(name) if callable(getattr(result, "get", None)) else None
    return (seen, list(returned)) if seen and returned else None


def _initial(entries: list[Any]) -> list[float]:
    """The one value each entry holds before the first token; raises `DraftingError` when one varies."""
    values = []
    for i, entry in enumerate(entries):
        distinct = entry.unique()
        if distinct.numel() != 1:
            raise DraftingError(f"the layers keep a per-sequence state, but entry {i} of the model's state list "
                                "does not start from one value; a family file for it needs its state section "
                                "written by hand")
        values.append(float(f"{distinct.item():.7g}"))  # as written in float32 (-1e30, not -1.00000002e30)
    return values


def _conv_entries(dtypes: list[Any]) -> int:
    """How many leading entries a bfloat16 model keeps in bfloat16 (the rest must be float32)."""
    import torch

    count = next((i for i, dtype in enumerate(dtypes) if dtype != torch.bfloat16), len(dtypes))
    if any(dtype != torch.float32 for dtype in dtypes[count:]):
        raise DraftingError("the layers keep a per-sequence state, but the entries of the model's state list kept "
                            "in the model's dtype do not all come before the float32 ones; a family file for it "
                            "needs its state section written by hand")
    return count


def apply_state_list(draft: FamilyDraft, layout: Any, found: StateListFound, config_class: type,
                     tiny: Mapping[str, Any]) -> bool:
    """Write ``layout.state`` for a state list (shapes, ``layer_list``) and the layer's keyword into ``draft``;
    whether the recurrent entries are float32. Raises `DraftingError` when the list cannot be declared."""
    import torch

    from distconf.tools.drafting.probe import rows_step_together

    if len(set(found.sizes)) > 1:
        raise DraftingError(f"the layers keep a per-sequence state, but the entries of the model's state list have "
                            f"different sizes ({', '.join(map(str, found.sizes))}); a family file for it needs its "
                            "state section written by hand")
    first = _first_layer_state(config_class, tiny, draft.attn_implementation, found.name, torch.float32)
    if first is None:
        raise DraftingError("the layers keep a per-sequence state as a list, but the first layer was not given it; "
                            "a family file for it needs its state section written by hand")
    initial = _initial(first[0])
    low = _first_layer_state(config_class, tiny, draft.attn_implementation, found.name, torch.bfloat16)
    if low is None:
        conv, float32 = 0, True
        draft.facts.append("the tiny model does not run in bfloat16 here: every entry of the state list is taken "
                           "as float32")
    else:
        conv = _conv_entries([t.dtype for t in low[1]])
        float32 = conv < len(initial) and low[1][-1].dtype == torch.float32
    size = layout.state.pop("recurrent_shape")
    state: dict[str, Any] = {}
    if conv:
        state["conv_shape"] = [conv, *size]
    if conv < len(initial):
        state["recurrent_shape"] = [len(initial) - conv, *size]
    state["layer_list"] = {"conv_entries": conv, "initial": initial}
    if not rows_step_together(config_class, tiny, draft.attn_implementation, found.name):
        state["one_token_rows"] = "one_at_a_time"
        draft.facts.append("the model's one-token step after a state of several rows differs from each row's own: "
                           "blocks run such steps one row at a time")
    layout.state = {**state, **layout.state}
    draft.call["cache_argument"] = found.name
    draft.facts[:] = [fact for fact in draft.facts if not any(note in fact for note in _NO_CACHE_NOTES)]
    carried = f" passes {found.name} from each layer's output"  # the list is that stream: each block keeps it
    draft.review[:] = [note for note in draft.review
                       if not any(n in note for n in _NO_CACHE_NOTES) and carried not in note]
    draft.facts.append(f"the model passes its layers their state as a list of {len(initial)} [batch, size, layers] "
                       f"tensors ('{found.name}'), each layer using its own slice")
    return float32
