"""Writing a state tuple each layer takes and returns (`distconf.tools.drafting.state_returned`) into a draft.

``state.returned_tuple``, the layer's keyword for it, the module given it, and whether a
bfloat16 model keeps the states in float32.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from distconf.tools.drafting.common import field_value, module_path
from distconf.tools.drafting.probe import tiny_model
from distconf.tools.drafting.scan import find_layer_list
from distconf.tools.drafting.state_returned import ReturnedStateFound, run_returning_states

__all__ = ["apply_returned_state"]


_NO_CACHE_NOTES = ("forward takes no cache",)


def _bfloat16_dtypes(config_class: type, tiny: Mapping[str, Any], attn_implementation: str) -> set[str] | None:
    """The dtypes of the states a bfloat16 tiny model's layers return (None when it cannot run in bfloat16)."""
    import torch

    try:
        config, model = tiny_model(config_class, tiny, attn_implementation)
        model = model.to(torch.bfloat16)
        _, layers = find_layer_list(model, field_value(config, "num_hidden_layers"))
        _, found = run_returning_states(model, layers, torch.randint(0, 8, (1, 4)))
    except Exception:  # the float32 run has reported anything wrong with the config
        return None
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
