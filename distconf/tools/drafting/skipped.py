"""``block.skipped_layer_kinds``: layer types the model does not run for token ids alone.

Some models hold layers that run only with an input besides the hidden states (e.g.
cross-attention layers run only when given image features): for text alone the model's
forward skips them. A swarm carries hidden states only, so the block of such a layer
passes them through. The drafter runs the tiny model on token ids and names the layer
types none of whose layers ran.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from distconf.tools.drafting.common import field_value
from distconf.tools.drafting.probe import TinyFacts
from distconf.tools.drafting.render import FamilyDraft

__all__ = ["draft_skipped_layers", "layers_not_run"]


def layers_not_run(config_class: type, tiny: Mapping[str, Any], attn_implementation: str,
                   ) -> tuple[Any, list[int]] | None:
    """The tiny config and the indices of the layers its model does not call on token ids (None if it fails)."""
    from distconf.tools.drafting.probe import CACHED_RUN, observe

    record = observe(config_class, tiny, attn_implementation, CACHED_RUN)
    if record.error is not None:
        return None
    ran = {call.index for call in record.calls}
    return record.config, [i for i in range(record.layer_count) if i not in ran]


def draft_skipped_layers(facts: TinyFacts, draft: FamilyDraft) -> None:
    """Name the layer types (of ``block.mask.layer_index_fields``) whose layers the tiny model never runs."""
    config_class, tiny = facts.config_class, facts.tiny
    fields = draft.mask.get("layer_index_fields")
    if not fields:
        return
    seen = layers_not_run(config_class, tiny, draft.attn_implementation)
    if seen is None or not seen[1]:
        return
    config, skipped = seen
    kinds = []
    for kind, field in fields.items():
        indices = field_value(config, field)
        if isinstance(indices, (list, tuple)) and indices and set(indices) <= set(skipped):
            kinds.append(kind)
    if kinds:
        draft.skipped_layer_kinds = kinds
        draft.facts.append(f"the model skips its layers of type {', '.join(kinds)} for token ids alone (they run "
                           "only with another input): their blocks pass hidden states through "
                           "(block.skipped_layer_kinds)")
