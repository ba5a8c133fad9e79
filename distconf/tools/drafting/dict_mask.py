"""``block.mask.as_dict``: a layer that takes its mask argument as a dict of masks, one per key.

Some models hand each layer ``attention_mask={"causal": <the layer's attention mask>, "conv": <the 2D padding
mask>}``: the attention reads one entry, another sublayer (a convolution zeroing padded tokens) the other.
The drafter runs the tiny model on a batch with a left-padded row and looks at what the first layer gets
under the mask keyword: a dict's ``[batch, tokens]`` tensor is the padding mask, another tensor the
attention mask, None nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from distconf.tools.drafting.probe import TinyFacts
from distconf.tools.drafting.render import FamilyDraft

__all__ = ["dict_mask_entries", "draft_dict_mask"]

_BATCH, _TOKENS, _PADDED = 2, 5, 2  # the probe's rows, tokens per row, left-padded tokens of row 0


def _entry(value: Any) -> str | None:
    """What one entry of the dict mask holds (None: neither a tensor nor None)."""
    import torch

    if value is None:
        return "none"
    if not isinstance(value, torch.Tensor):
        return None
    return "padding" if tuple(value.shape) == (_BATCH, _TOKENS) else "attention"


def dict_mask_entries(config_class: type, tiny: Mapping[str, Any], attn_implementation: str,
                      mask_argument: str) -> dict[str, str]:
    """Key -> what it holds (``attention``, ``padding``, ``none``) of the dict the tiny model's first layer
    gets as ``mask_argument`` for a padded batch (empty: not a dict, an entry of another kind, or no run)."""
    from distconf.tools.drafting.probe import Forward, observe

    record = observe(config_class, tiny, attn_implementation,
                     Forward(use_cache=False, batch=_BATCH, tokens=_TOKENS, low=1, padded=_PADDED))
    if record.error is not None:
        return {}
    seen = [call.kwargs.get(mask_argument) for call in record.of_layer(0)][:1]
    if not seen or not isinstance(seen[0], dict):
        return {}
    entries = {str(key): _entry(value) for key, value in seen[0].items()}
    return {} if None in entries.values() else entries  # type: ignore[return-value]


def draft_dict_mask(facts: TinyFacts, draft: FamilyDraft) -> None:
    """Write ``block.mask.as_dict`` when the tiny model hands its layers the mask as a dict."""
    config_class, tiny = facts.config_class, facts.tiny
    mask_argument = draft.call.get("mask_argument", "attention_mask")
    if not mask_argument:
        return
    entries = dict_mask_entries(config_class, tiny, draft.attn_implementation, mask_argument)
    if not entries:
        return
    draft.mask["as_dict"] = entries
    draft.facts.append(f"the layers take {mask_argument} as a dict ("
                       + ", ".join(f"{key}: {entry}" for key, entry in entries.items())
                       + "): the block builds it the same way (block.mask.as_dict)")
