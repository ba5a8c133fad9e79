"""What the model's loop hands every layer besides the hidden states, read from one tiny run.

Three arguments the block can give a layer itself, found by what each layer of the tiny model receives:

- the layer's own index (``block.call.layer_idx_argument``): an integer argument equal to each layer's index, for a
  layer whose shared modules tell the layers apart by it;
- the embeddings (``hidden_state.carried[].initial: hidden``): a tensor equal to the first layer's input hidden
  states that every layer gets unchanged (a shared block concatenating them with its input); blocks carry it on
  the wire after the hidden state, passed through each layer;
- the 4D attention mask (``block.call.mask_argument``) under another name than the drafted one, when the drafted
  argument gets no 4D mask (it holds a padding mask for the state layers) and one other mask argument does.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from distconf.tools.drafting.common import field_value
from distconf.tools.drafting.probe import TinyFacts
from distconf.tools.drafting.render import FamilyDraft

__all__ = ["layer_call_arguments", "draft_call_inputs"]


def layer_call_arguments(config_class: type, tiny: Mapping[str, Any], attn_implementation: str,
                         ) -> tuple[Any, list[dict[str, Any]]]:
    """(tiny config, each layer's arguments by name in one cached run of a batch with a padded row); ([] when the
    model does not run)."""
    from distconf.tools.drafting.probe import Forward, observe

    # a padded row: the model materializes every mask it builds
    record = observe(config_class, tiny, attn_implementation, Forward(use_cache=True, batch=2, padded=1))
    if not record.built:
        return None, []
    if record.error is not None:
        return record.config, []
    seen: dict[int, dict[str, Any]] = {}
    for call in record.calls:
        try:
            bound = inspect.signature(type(call.module).forward).bind(call.module, *call.args, **call.kwargs)
        except (TypeError, ValueError):
            continue
        seen.setdefault(call.index, {k: v for k, v in bound.arguments.items() if k != "self"})
    if len(seen) != record.layer_count:
        return record.config, []
    return record.config, [seen[i] for i in range(record.layer_count)]


def _layer_index_argument(calls: list[dict[str, Any]]) -> str | None:
    """The argument every layer gets as its own index (None unless exactly one)."""
    if len(calls) < 2:
        return None
    names = [name for name, value in calls[1].items()
             if all(type(call.get(name)) is int and call.get(name) == i for i, call in enumerate(calls))]
    return names[0] if len(names) == 1 else None


def _embeddings_argument(calls: list[dict[str, Any]]) -> str | None:
    """The argument every layer gets as the first layer's input hidden states, unchanged (None unless one)."""
    import torch

    first = calls[0]
    hidden_name = next(iter(first), None)
    hidden = first.get(hidden_name)
    if not isinstance(hidden, torch.Tensor):
        return None
    names = [name for name, value in first.items() if name != hidden_name and isinstance(value, torch.Tensor)
             and value.shape == hidden.shape and torch.equal(value, hidden)
             and all(isinstance(call.get(name), torch.Tensor) and torch.equal(call[name], hidden) for call in calls)]
    return names[0] if len(names) == 1 else None


def _mask_argument(calls: list[dict[str, Any]], drafted: str | None) -> str | None:
    """Another argument receiving the 4D attention mask (named a mask), when the drafted one receives none."""
    import torch

    def four_d(value: Any) -> bool:
        return isinstance(value, torch.Tensor) and value.dim() == 4

    if drafted is not None and any(four_d(call.get(drafted)) for call in calls):
        return None
    names = {name for call in calls for name, value in call.items() if four_d(value) and "mask" in name.split("_")}
    return next(iter(names)) if len(names) == 1 else None


def draft_call_inputs(facts: TinyFacts, draft: FamilyDraft) -> None:
    """Write ``block.call.layer_idx_argument``, the embeddings carried to every layer (``hidden_state.carried``,
    ``initial: hidden``) and the mask argument, from what the tiny model's layers receive."""
    config_class, tiny = facts.config_class, facts.tiny
    config, calls = layer_call_arguments(config_class, tiny, draft.attn_implementation)
    if not calls:
        return
    index = _layer_index_argument(calls)
    if index is not None:
        draft.call["layer_idx_argument"] = index
        draft.facts.append(f"every layer gets its own index as {index!r} (block.call.layer_idx_argument)")
    embeddings = _embeddings_argument(calls)
    hidden = field_value(config, "hidden_size")
    if embeddings is not None and hidden == calls[0][embeddings].shape[-1]:
        carried = [*draft.hidden_state.get("carried", []),
                   {"argument": embeddings, "width": "hidden_size", "initial": "hidden"}]
        draft.hidden_state = {**draft.hidden_state, "carried": carried}
        draft.facts.append(f"every layer gets the first layer's input (the embeddings) as {embeddings!r}: blocks "
                           "carry it on the wire after the hidden state, unchanged through each layer "
                           "(hidden_state.carried, initial: hidden)")
    mask = _mask_argument(calls, draft.call.get("mask_argument", "attention_mask"))
    if mask is not None:
        draft.call["mask_argument"] = mask
        draft.facts.append(f"the layers get the 4D attention mask as {mask!r} (block.call.mask_argument)")
