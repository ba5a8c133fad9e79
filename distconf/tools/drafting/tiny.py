"""The tiny config of a draft (`fit_tiny_config`): shrunk, limited to what the class reads, every layer kind kept."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

from distconf.tools.drafting.common import MISSING, field_value, try_config
from distconf.tools.drafting.fields import FieldNames
from distconf.tools.drafting.layers import LayerPlan
from distconf.tools.drafting.layout import held_layout
from distconf.tools.drafting.probe import meta_layer_kinds
from distconf.tools.drafting.profile import TinyProfile
from distconf.tools.drafting.readable import architecture_fields
from distconf.tools.drafting.shrink import shrink_with_plan

__all__ = ["TinyPlan", "fit_tiny_config", "derived_lists"]


@dataclass
class TinyPlan:
    """What the tiny config is made from: the real config, its class, and the real model's layers."""

    raw: Mapping[str, Any]
    config_class: type
    attn_implementation: str
    derived_layer_types: list[Any] | None = None
    layer_kinds: list[Hashable] | None = None  # signature of each real layer
    real_kinds: set[Hashable] = field(default_factory=set)  # kinds of layers the real model has
    derived_lists: dict[str, list[Any]] = field(default_factory=dict)  # per-layer lists the class computes
    model_reads: frozenset[str] = frozenset()  # config attributes the modeling code reads


def fit_tiny_config(plan: TinyPlan, profile: TinyProfile, review: list[str], facts: list[str]) -> dict[str, Any]:
    """The shrunk config, made to have every kind of layer the real model has.

    When the class derives per-layer lists (e.g. layer types from a period) and the
    tiny model lacks a kind of layer, the lists are written out, cut to the tiny
    layers; when that is not enough (fields such as "the first k layers are dense"),
    one more layer is tried (up to ``profile.max_layers``), built on the meta device.
    """
    tiny, notes = _deepen(plan, profile)
    review.extend(notes)
    return architecture_fields(tiny, plan.config_class, facts, plan.model_reads, review)


def _deepen(plan: TinyPlan, profile: TinyProfile) -> tuple[dict[str, Any], list[str]]:
    """The shrunk config, one layer deeper at a time until it builds every kind of layer of the real model."""
    depth = None
    raw = held_layout(plan.raw, plan.config_class)
    while True:
        notes: list[str] = []
        tiny, layer_plan = shrink_with_plan(raw, notes, derived_layer_types=plan.derived_layer_types,
                                            layer_kinds=plan.layer_kinds, config_class=plan.config_class,
                                            profile=profile, min_layers=depth)
        chosen = _typed_layers(plan, tiny, layer_plan)
        if chosen is not None:
            notes = []
            tiny, layer_plan = shrink_with_plan(raw, notes, derived_layer_types=plan.derived_layer_types,
                                                layer_kinds=plan.layer_kinds, config_class=plan.config_class,
                                                profile=profile, min_layers=depth, chosen=chosen)
        if not plan.real_kinds:
            return tiny, notes
        kinds = meta_layer_kinds(plan.config_class, tiny, plan.attn_implementation)
        if kinds is not None and not plan.real_kinds <= kinds and plan.derived_lists:
            written = {**tiny, **{key: layer_plan.cut(value) for key, value in plan.derived_lists.items()}}
            written_kinds = meta_layer_kinds(plan.config_class, written, plan.attn_implementation)
            if written_kinds is not None and plan.real_kinds <= written_kinds:
                tiny, kinds = written, written_kinds
        if kinds is None or plan.real_kinds <= kinds or layer_plan.tiny_layers >= profile.max_layers:
            return tiny, notes
        depth = layer_plan.tiny_layers + 1


def _typed_layers(plan: TinyPlan, tiny: Mapping[str, Any], layer_plan: LayerPlan) -> list[int] | None:
    """The real layers the tiny layers should stand for when the config class gives some tiny layers another type
    than their real layer's (a class forcing its last layer to full attention) and the config keys settings by
    layer index (``per_layer_config``): each such tiny layer then stands for the first real layer of the type the
    class gives it, so its settings are those of its type. None when nothing changes."""
    real = plan.derived_layer_types
    if not layer_plan.keyed or not real or len(real) <= max(layer_plan.chosen):
        return None
    held = try_config(plan.config_class, tiny)
    if held is MISSING:  # the tiny run reports a config the class refuses
        return None
    resolved = field_value(held, "layer_types")
    if not isinstance(resolved, (list, tuple)) or len(resolved) != layer_plan.tiny_layers:
        return None
    chosen = list(layer_plan.chosen)
    for position, kind in enumerate(resolved):
        if real[chosen[position]] != kind:
            of_kind = [i for i, k in enumerate(real) if k == kind]
            if not of_kind:
                return None
            chosen[position] = of_kind[0]
    return chosen if chosen != list(layer_plan.chosen) else None


def derived_lists(config: Any, raw: Mapping[str, Any], config_class: type, layers: int | None) -> dict[str, list[Any]]:
    """Per-layer lists the config class computed itself (fields of the class absent from the config.json)."""
    if not layers or not dataclasses.is_dataclass(config_class):
        return {}
    names = FieldNames.of(config_class)
    given = {names.standard(k) for k in raw} | set(raw)
    fields = {f.name for f in dataclasses.fields(config_class)}
    return {name: list(value) for name, value in vars(config).items()
            if name in fields and name not in given and isinstance(value, (list, tuple)) and len(value) == layers}
