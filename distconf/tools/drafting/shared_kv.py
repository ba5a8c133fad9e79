"""Containers the model hands all its layers: ``block.call.fresh_arguments``, and ``kv_cache.shared`` when
later layers attend with the K/V an earlier layer stored there.

Some models give every layer the same container (transformers' ``KVSharingDict``: a layer stores its keys
and values there for later layers that share them). A block runs one layer, so it hands its layer an empty
one of the same class on every call; the drafter finds such keywords on a tiny run (the same object for
every layer, still empty when the first layer gets it), and `distconf check` proves that no layer of the
tiny model reads what another stored.

When layers do read what others stored, the config lists each layer's mode in an attribute (a property, for
Gemma 3n's ``kv_sharing_modes``) holding the schema's ``store`` and ``reuse`` values. The drafter finds that
attribute, confirms on a tiny run that every storing layer puts its keys and values in the container under its
layer type, measures their values per token and writes the formula over the config's K/V fields that gives them
(on each storing layer's own config, for a config with sizes per layer).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from distconf.loader.spec_kv import SharedKVSpec
from distconf.tools.drafting.common import MISSING, field_value
from distconf.tools.drafting.probe import TinyFacts
from distconf.tools.drafting.render import FamilyDraft

__all__ = ["draft_fresh_arguments", "shared_containers", "draft_shared_kv"]

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


def draft_fresh_arguments(facts: TinyFacts, draft: FamilyDraft) -> None:
    """Write ``block.call.fresh_arguments`` for the containers the tiny model hands all its layers."""
    config_class, tiny = facts.config_class, facts.tiny
    found = shared_containers(config_class, tiny, draft.attn_implementation)
    if not found:
        return
    draft.call["fresh_arguments"] = {name: f"{cls.__module__}.{cls.__qualname__}" for name, cls in found.items()}
    draft.facts.append(f"the model hands all its layers one empty {', '.join(c.__name__ for c in found.values())} "
                       f"({', '.join(found)}): each block's layer gets a fresh one (block.call.fresh_arguments); "
                       "right only while no layer reads what another stored")

_STORE = SharedKVSpec.model_fields["store"].default
_REUSE = SharedKVSpec.model_fields["reuse"].default
_WIDTHS = ("2 * num_key_value_heads * head_dim", "2 * num_kv_heads * head_dim",
           "2 * num_key_value_heads * (hidden_size // num_attention_heads)")  # K and V of one KV geometry


def _modes_field(config: Any, layers: int) -> str | None:
    """The config attribute (a field or property) listing a mode per layer that stores and reuses."""
    names = sorted({*vars(config), *(n for n in dir(type(config)) if isinstance(getattr(type(config), n, None),
                                                                          property))})
    for name in names:
        if name.startswith("_"):
            continue
        value = field_value(config, name, MISSING)  # a property may not apply to this config
        if value is MISSING:
            continue
        if isinstance(value, (list, tuple)) and len(value) == layers and _STORE in value and _REUSE in value:
            return name
    return None


def _stored(config_class: type, tiny: Mapping[str, Any], attn_implementation: str, argument: str,
            ) -> tuple[Any, list[dict[str, tuple[int, ...]]]] | None:
    """The tiny config and, after each layer, ``{key: K shape + V last dim}`` of what the container holds."""
    from distconf.tools.drafting.probe import UNCACHED_RUN, observe

    record = observe(config_class, tiny, attn_implementation, UNCACHED_RUN)
    if record.error is not None:
        return None
    after: list[dict[str, tuple[int, ...]]] = [{} for _ in range(record.layer_count)]
    for call in record.calls:
        stored = call.stored.get(argument, {})
        if isinstance(stored, Exception):  # the container did not hold what it is read as
            return None
        after[call.index] = stored
    return record.config, after


def draft_shared_kv(facts: TinyFacts, draft: FamilyDraft) -> None:
    """Write ``kv_cache.shared`` when the tiny model's layers store K/V for later layers in a container."""
    config_class, tiny = facts.config_class, facts.tiny
    from distconf.loader.formula import Formula
    from distconf.loader.per_layer import layer_config

    containers = draft.call.get("fresh_arguments") or {}
    types_field = draft.mask.get("layer_types_field")
    if not containers or not types_field:
        return
    layers = int(field_value(config_class(**tiny), "num_hidden_layers"))
    modes_field = _modes_field(config_class(**tiny), layers)
    if modes_field is None:
        return
    for argument in containers:
        run = _stored(config_class, tiny, draft.attn_implementation, argument)
        if run is None:
            continue
        config, after = run
        modes, types = getattr(config, modes_field), getattr(config, types_field)
        widths: dict[str, tuple[int, int]] = {}  # stored type -> (values per token, its first storing layer)
        for i, mode in enumerate(modes):
            if mode == _STORE and str(types[i]) in after[i] and str(types[i]) not in widths:
                shape = after[i][str(types[i])]  # [batch, heads, tokens, key_dim] + value_dim
                widths[str(types[i])] = (shape[1] * (shape[3] + shape[4]), i)
        if not widths or any(mode == _STORE and str(types[i]) not in widths for i, mode in enumerate(modes)):
            continue
        formula = next((text for text in _WIDTHS
                        if all(_evaluates_to(Formula, text, layer_config(config, i), width)
                               for width, i in widths.values())), None)
        if formula is None:
            stored = {key: width for key, (width, _) in widths.items()}
            draft.review.append(f"the layers share K/V through {argument} ({modes_field}), {stored} values per "
                                "token stored, but no formula over the config's K/V fields gives them: write "
                                "kv_cache.shared.values_per_token by hand")
            formula = stored  # type: ignore[assignment]
        draft.kv_cache = {**draft.kv_cache, "shared": {"argument": argument, "modes_field": modes_field,
                                                       "values_per_token": formula}}
        draft.facts = [fact.replace("right only while no layer reads what another stored",
                                    "what a layer stores for later ones travels on the wire (kv_cache.shared)")
                       if argument in fact else fact for fact in draft.facts]
        reusing = sum(mode == _REUSE for mode in modes)
        draft.facts.append(f"{reusing} of the tiny model's {layers} layers reuse the K/V an earlier layer of their "
                           f"type stored in {argument} ({modes_field}): the wire carries the stored K/V of each "
                           "step's new tokens, each reusing block keeps its own copy (kv_cache.shared)")
        return


def _evaluates_to(formula_class: type, text: str, config: Any, value: int) -> bool:
    """Whether formula ``text`` evaluates on ``config`` to ``value``."""
    try:
        return formula_class(text).evaluate_on(config) == value
    except Exception:  # a field this config does not have
        return False
