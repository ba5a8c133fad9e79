"""``block.call.fresh_arguments``: empty containers the model makes once per forward and hands all its layers.

Some models give every layer the same container (transformers' ``KVSharingDict``: a layer stores its keys
and values there for later layers that share them). A block runs one layer, so it hands its layer an empty
one of the same class on every call; the drafter finds such keywords on a tiny run (the same object for
every layer, still empty when the first layer gets it), and `distconf check` proves that no layer of the
tiny model reads what another stored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from distconf.tools.drafting.render import FamilyDraft

__all__ = ["draft_fresh_arguments", "shared_containers"]

_TRUSTED = ("transformers.", "distconf.")  # class paths a family file may name (spec_types.ClassPath)


def shared_containers(config_class: type, tiny: Mapping[str, Any], attn_implementation: str) -> dict[str, type]:
    """Keyword -> class of the containers the tiny model hands every layer as one object, empty at the first
    layer (empty when the model does not build or run)."""
    from distconf.tools.drafting.probe import CACHED_RUN, observe

    record = observe(config_class, tiny, attn_implementation, CACHED_RUN)
    if record.error is not None:
        return {}
    seen: list[dict[str, tuple[int, int, type]]] = [{} for _ in range(record.layer_count)]
    for call in record.calls:
        seen[call.index] = call.containers
    found = {}
    for name, (identity, size, cls) in seen[0].items():
        if size == 0 and all(calls.get(name, (None,))[0] == identity for calls in seen) \
                and cls.__module__.startswith(_TRUSTED):
            found[name] = cls
    return found


def draft_fresh_arguments(draft: FamilyDraft, config_class: type, tiny: Mapping[str, Any]) -> None:
    """Write ``block.call.fresh_arguments`` for the containers the tiny model hands all its layers."""
    found = shared_containers(config_class, tiny, draft.attn_implementation)
    if not found:
        return
    draft.call["fresh_arguments"] = {name: f"{cls.__module__}.{cls.__qualname__}" for name, cls in found.items()}
    draft.facts.append(f"the model hands all its layers one empty {', '.join(c.__name__ for c in found.values())} "
                       f"({', '.join(found)}): each block's layer gets a fresh one (block.call.fresh_arguments); "
                       "right only while no layer reads what another stored")
