"""Positions computed outside the layers: what the model passes each layer, read from a tiny run.

Some models compute position inputs once, outside their layers, and give them only to some
layer types: rotary embeddings for some types and None for the others (layers without
positions), or a tensor made by a module-level function of the position ids (e.g. a
position-dependent query scaling for those layers). The drafter watches the keyword
arguments every layer of the tiny model receives and writes ``block.position.
rotary_layer_kinds`` and ``block.position.computed_arguments`` for what it sees.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from distconf.tools.drafting.common import field_value, quiet_transformers
from distconf.tools.drafting.render import FamilyDraft

__all__ = ["draft_computed_positions"]

_HANDLED = {"cache_argument": "cache", "mask_argument": "attention_mask", "position_ids_argument": "position_ids",
            "alibi_argument": None}
"""Keywords the block passes itself (block.call's fields and their defaults)."""


def draft_computed_positions(draft: FamilyDraft, config_class: type, tiny: Mapping[str, Any],
                             layer_class: type) -> None:
    """Add the position knobs the tiny model's layer calls show (nothing when all layers get the same)."""
    field = draft.mask.get("layer_types_field")
    seen = _layer_calls(config_class, tiny, draft.attn_implementation)
    if not field or seen is None:
        return
    config, calls = seen
    types = field_value(config, field)
    if not isinstance(types, (list, tuple)) or len(types) != len(calls):
        return
    rotary_argument = draft.call.get("position_embeddings_argument", "position_embeddings")
    if "rotary_class" in draft.position and rotary_argument:
        with_rotary = {str(t) for t, kwargs in zip(types, calls, strict=True)
                       if kwargs.get(rotary_argument) is not None}
        if with_rotary and with_rotary != {str(t) for t in types}:
            draft.position["rotary_layer_kinds"] = sorted(with_rotary)
            draft.facts.append(f"only layers of type {', '.join(sorted(with_rotary))} get rotary embeddings "
                               "(the others get none: rotary_layer_kinds)")
    handled = {draft.call.get(k, default) for k, default in _HANDLED.items()} | {rotary_argument}
    handled |= set(draft.call.get("extra", {}))
    names = sorted({k for kwargs in calls for k, v in kwargs.items() if _is_tensor(v)} - handled)
    computed = {}
    for name in names:
        found = _function_of_positions(layer_class, calls, name)
        if found is None:
            draft.review.append(f"the model passes its layers a tensor '{name}' the block does not compute: "
                                "declare it in block.position.computed_arguments")
            continue
        kinds = sorted({str(t) for t, kwargs in zip(types, calls, strict=True) if _is_tensor(kwargs.get(name))})
        entry: dict[str, Any] = {"function": found}
        if set(kinds) != {str(t) for t in types}:
            entry["layer_kinds"] = kinds
        computed[name] = entry
        draft.facts.append(f"the model computes '{name}' from the position ids ({found.rsplit('.', 1)[-1]}) "
                           f"for layers of type {', '.join(kinds)}")
    if computed:
        draft.position["computed_arguments"] = computed


def _is_tensor(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


def _layer_calls(config_class: type, tiny: Mapping[str, Any],
                 attn_implementation: str) -> tuple[Any, list[dict[str, Any]]] | None:
    """The tiny config and the keyword arguments each layer got in one cached forward (None if it fails)."""
    import torch

    from distconf.tools.drafting.probe import build_tiny_model
    from distconf.tools.drafting.scan import find_layer_list

    try:
        config, model = build_tiny_model(config_class, tiny, attn_implementation)
        _, layers = find_layer_list(model, field_value(config, "num_hidden_layers"))
    except Exception:  # the tiny run reports why the config does not build
        return None
    calls: list[dict[str, Any]] = [{} for _ in layers]

    def hook(index: int) -> Any:
        def record(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
            calls[index] = dict(kwargs)
        return record

    handles = [layer.register_forward_pre_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        with torch.no_grad(), quiet_transformers():
            model(torch.randint(0, 8, (1, 5)), use_cache=True)
    except Exception:
        return None
    finally:
        for handle in handles:
            handle.remove()
    return config, calls


def _function_of_positions(layer_class: type, calls: list[dict[str, Any]], name: str) -> str | None:
    """The dotted path of a module-level function of the layer's module that, given the position ids
    the layer got, returns the tensor it got as ``name`` (None when none does)."""
    import torch

    module = inspect.getmodule(layer_class)
    call = next((kwargs for kwargs in calls if _is_tensor(kwargs.get(name))), None)
    if module is None or call is None:
        return None
    positions = call.get("position_ids")
    if not _is_tensor(positions):
        positions = torch.arange(5).unsqueeze(0)
    for attribute, function in sorted(vars(module).items()):
        if not inspect.isfunction(function) or function.__module__ != module.__name__:
            continue
        try:
            parameters = list(inspect.signature(function).parameters.values())
        except (TypeError, ValueError):
            continue
        if len(parameters) != 1 or parameters[0].name != "position_ids":
            continue
        try:
            value = function(positions)
        except Exception:
            continue
        expected = call[name]
        if _is_tensor(value) and value.shape == expected.shape and torch.allclose(value, expected):
            return f"{module.__name__}.{attribute}"
    return None
