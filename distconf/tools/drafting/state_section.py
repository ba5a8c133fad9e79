"""Writing a found `StateLayout` into a draft: ``state``, per-type kinds, masks of layers keeping no K/V."""

from __future__ import annotations

import inspect
from typing import Any

from distconf.tools.drafting.common import DraftingError, module_path
from distconf.tools.drafting.continuation import draft_continuation
from distconf.tools.drafting.probe import TinyFacts
from distconf.tools.drafting.render import FamilyDraft
from distconf.tools.drafting.scan import ModelScan, find_attention
from distconf.tools.drafting.sections import mask_kind_of
from distconf.tools.drafting.state_layout import StateLayout

__all__ = ["apply_state", "attention_by_type", "cache_module_class", "finish_state", "kv_attention",
           "refuse_foreign_state"]

_CACHE_PARAMETERS = ("cache_params", "cache", "past_key_values", "past_key_value", "layer_past")
# review notes the state layout answers (written before the tiny model ran)
_ANSWERED = ("no *Attention module inside", "could not read the tiny model's cache", "no num_attention_heads field")


def cache_module_class(layer: Any) -> type | None:
    """The class of the first module inside ``layer`` whose forward takes a cache (a recurrent mixer)."""
    for _, module in layer.named_modules():
        if module is layer:
            continue
        try:
            params = inspect.signature(type(module).forward).parameters
        except (TypeError, ValueError):
            continue
        if any(name in params for name in _CACHE_PARAMETERS):
            return type(module)
    return None


def attention_by_type(scan: ModelScan, layer_types: Any) -> dict[str, type]:
    """The attention class inside the first layer of each layer type (types without one are left out)."""
    found: dict[str, type] = {}
    if not isinstance(layer_types, (list, tuple)) or len(layer_types) != len(scan.layers):
        layer_types = ["*"] * len(scan.layers)
    for layer_type, layer in zip(layer_types, scan.layers, strict=True):
        if str(layer_type) not in found:
            attention, _ = find_attention(layer)
            if attention is not None:
                found[str(layer_type)] = attention
    return found


def kv_attention(draft: FamilyDraft, by_type: dict[str, type], layer_class: type | None = None) -> type | None:
    """The attention class of the layer types that keep K/V in a draft with a state.

    When the config built no attention layer (only a variant has them), the one ``*Attention``
    module class of the layer's modeling module.
    """
    kv_types = draft.kv_cache.get("layer_kinds") or list(by_type)
    found = next((by_type[t] for t in kv_types if t in by_type), None)
    if found is not None or layer_class is None:
        return found
    module = inspect.getmodule(layer_class)
    import torch

    classes = [value for name, value in sorted(vars(module).items()) if name.endswith("Attention")
               and isinstance(value, type) and issubclass(value, torch.nn.Module)
               and value.__module__ == layer_class.__module__] if module is not None else []
    return classes[0] if len(classes) == 1 else None


def refuse_foreign_state(where: str | None) -> None:
    """Raise `DraftingError` when the tiny model keeps a state outside transformers' cache layers (``where``).

    A server's block cache holds the conv / recurrent states of ``DynamicCache`` layers and K/V only,
    so no family file can serve such a state.
    """
    if where is not None:
        raise DraftingError(f"the layers keep a per-sequence state the runtime cannot hold: {where}; distconf "
                            "serves states kept in the layers of a transformers DynamicCache (conv_states / "
                            "recurrent_states) only")


def apply_state(draft: FamilyDraft, layout: StateLayout, float32_state: bool, conv_float32: bool = False) -> None:
    """Set the draft's state section and the per-type kinds ``layout`` found; drop the notes it answers.
    ``float32_state`` / ``conv_float32``: a bfloat16 model keeps its recurrent / conv states in float32.

    Raises `DraftingError` when the layout cannot be declared (the draft could not pass the check).
    """
    if layout.problem is not None:  # a draft without its state would not check: say why, in one line
        if layout.beyond_runtime:
            raise DraftingError(f"the layers keep a per-sequence state the runtime cannot hold: {layout.problem}")
        raise DraftingError(f"the layers keep a per-sequence state, but {layout.problem}; a family file for it "
                            "needs its state section written by hand")
    state = dict(layout.state)
    if float32_state and "recurrent_shape" in state:
        state["recurrent_dtype"] = "float32"
    if conv_float32 and "conv_shape" in state:
        state["conv_dtype"] = "float32"
    types, kv_types = layout.state_types, layout.kv_types or []
    all_types = layout.all_types or list(dict.fromkeys([*(types or []), *kv_types]))
    one_rule = None  # the model masks every layer alike, yet its layer types tell state layers from K/V ones
    if types is not None and kv_types and set(types) != set(all_types) and not draft.mask.get("layer_types_field"):
        one_rule = draft.mask.get("kind", "causal")
        draft.mask = {"layer_types_field": "layer_types", **draft.mask}
    if types is not None and draft.mask.get("layer_types_field"):
        kinds = dict(draft.mask.get("layer_kinds") or {})
        for layer_type in all_types:
            if layer_type not in kinds:  # keeping a state only, or nothing (an MLP layer): no mask
                kinds[layer_type] = (one_rule or mask_kind_of(layer_type)) if layer_type in kv_types else "none"
            elif layer_type not in kv_types:
                kinds[layer_type] = "none"
        draft.mask["layer_kinds"] = kinds
        if kv_types and set(types) != set(all_types):
            state = {"layer_kinds": types, **state}
        # a type keeping both needs the list: without it, layers keeping a state keep no K/V
        if kv_types and (set(kv_types) != set(all_types) or set(kv_types) & set(types)):
            draft.kv_cache = {"layer_kinds": kv_types, **draft.kv_cache}
        draft.review[:] = [note for note in draft.review if not note.startswith("layer_types has [")
                           or not all(t in kinds for t in _listed(note))]
    draft.state = state
    draft.review[:] = [note for note in draft.review if not note.startswith(_ANSWERED) or kv_types]
    draft.facts.append("the layers keep a per-sequence state (conv_shape / recurrent_shape: formulas over config "
                       "fields found on two differently shaped tiny models)"
                       + (f"; layer types {', '.join(types)} keep it" if types and kv_types else ""))


def _listed(note: str) -> list[str]:
    """The layer types a ``layer_types has [...]`` note lists."""
    import ast

    try:
        return [str(t) for t in ast.literal_eval(note[len("layer_types has "):note.index("]") + 1])]
    except (ValueError, SyntaxError):
        return []


def finish_state(facts: TinyFacts, draft: FamilyDraft) -> None:
    """After the tiny runs: the module given the cache (attention of the K/V layers, else the mixer), continuation."""
    by_type, mixer, layer_class = dict(facts.attention_by_type), facts.mixer, facts.layer_class
    if not draft.state:
        return
    attention = kv_attention(draft, by_type, layer_class) if draft.keeps_kv else None
    chosen = attention if attention is not None else mixer if not draft.keeps_kv else None
    if chosen is not None and module_path(chosen) != draft.attention_class:
        draft.attention_class = module_path(chosen)
        draft.facts.append(f"the module given the cache is {chosen.__name__}")
    if chosen is not None:
        draft.review[:] = [note for note in draft.review if not note.startswith("no *Attention module")]
    draft_continuation(draft)
