"""``block.call.carried_arguments``: a value each layer hands the next that a block can stand in for.

A layer loop such as ``hidden_states, topk_indices = layer(..., prev_topk_indices=topk_indices)``
carries a second value from layer to layer (`distconf.tools.drafting.streams`). A block is handed
hidden states only. When the tiny model's carried value is, for every query, the index of every key
(a top-k selection over no more than k keys), the block can pass exactly that (``all_keys``), up to the
config field bounding the selection: the one whose change to fewer keys than the run has makes the
value that much narrower.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from distconf.tools.drafting.common import is_int
from distconf.tools.drafting.render import FamilyDraft

__all__ = ["carried_values", "draft_carried_arguments"]

_TOKENS = 5  # of the tiny run
_NARROW = 3  # keys the bounding field is set to
_CANDIDATES = 8


def carried_values(config_class: type, tiny: Mapping[str, Any], attn_implementation: str,
                   index: int) -> list[Any] | None:
    """Output ``index`` of every layer of the tiny model on ``_TOKENS`` token ids (None when it does not run)."""
    from distconf.tools.drafting.probe import Forward, observe

    record = observe(config_class, tiny, attn_implementation, Forward(use_cache=True, tokens=_TOKENS, seed=0))
    if record.error is not None:
        return None
    return [call.output[index] if isinstance(call.output, (tuple, list)) and len(call.output) > index else None
            for call in record.calls]


def _every_key(values: list[Any]) -> bool:
    """Each value is ``[batch, queries, keys]`` integer indices holding every key once for each query."""
    import torch

    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if not tensors or len(tensors) != len(values):
        return False
    for value in tensors:
        if value.dtype.is_floating_point or value.dim() != 3 or value.shape[-1] != _TOKENS:
            return False
        wanted = torch.arange(_TOKENS, dtype=value.dtype).expand_as(value)
        if not torch.equal(value.sort(dim=-1).values, wanted):
            return False
    return True


def _bounding_field(config_class: type, tiny: Mapping[str, Any], attn_implementation: str, index: int) -> str | None:
    """The integer field of ``tiny`` that, set to fewer keys than the run has, narrows the value to that many."""
    candidates = sorted((name for name, value in tiny.items() if is_int(value) and value >= _TOKENS),
                        key=lambda name: -tiny[name])[:_CANDIDATES]
    for name in candidates:
        values = carried_values(config_class, {**tiny, name: _NARROW}, attn_implementation, index)
        shapes = {tuple(v.shape) for v in values or [] if hasattr(v, "shape")}
        if shapes == {(1, _TOKENS, _NARROW)}:
            return name
    return None


def draft_carried_arguments(draft: FamilyDraft, config_class: type, tiny: Mapping[str, Any],
                            carried: Mapping[str, tuple[str, int]]) -> None:
    """Write ``block.call.carried_arguments`` for each carried value (``{name: (keyword, output index)}``) the
    tiny run shows to be every key's index, bounded by a config field; their review notes then go."""
    found: dict[str, dict[str, Any]] = {}
    for name, (keyword, index) in carried.items():
        values = carried_values(config_class, tiny, draft.attn_implementation, index)
        if values is None or not _every_key(values):
            continue
        field = _bounding_field(config_class, tiny, draft.attn_implementation, index)
        if field is None:
            continue
        found[keyword] = {"stand_in": "all_keys", "exact_up_to": field}
        draft.review = [note for note in draft.review
                        if f"'{keyword}'" not in note and f" passes {name} from each layer's output" not in note]
        draft.facts.append(f"the layers hand each other {name} (as {keyword}): the index of every key for each "
                           f"query while there are at most {field} keys, which the block passes instead "
                           "(block.call.carried_arguments; longer sequences are refused)")
    if found:
        draft.call["carried_arguments"] = found
