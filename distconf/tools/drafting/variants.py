"""Tiny-config variants for the other real models of the same ``model_type`` (shipped presets).

One ``config.json`` shows one setting of an architecture; distconf ships real configs
(presets) of some model types, and ``distconf check`` requires the tiny variants to run
every kind of layer they have. A preset whose layers are of kinds the draft's tiny
config does not build gets a variant: its own tiny config, written as the fields that
differ from the base one.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Hashable, Mapping
from typing import Any

from distconf.tools.drafting.common import field_value, is_int
from distconf.tools.drafting.fields import FieldNames
from distconf.tools.drafting.probe import layer_kinds, meta_layer_kinds
from distconf.tools.drafting.profile import TINY
from distconf.tools.drafting.scan import meta_model, scan_model
from distconf.tools.drafting.shrink import CHECKPOINT_KEYS
from distconf.tools.drafting.tiny import TinyPlan, derived_lists, fit_tiny_config

__all__ = ["sibling_presets", "tiny_plan", "variant_values", "sibling_variants"]


def sibling_presets(config: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Shipped presets of ``config``'s model_type, except ``config`` itself."""
    from distconf.loader.presets import list_presets, preset_model_type, preset_path

    mine = {k: v for k, v in config.items() if k not in CHECKPOINT_KEYS}
    found = []
    for hub_id in list_presets():
        if preset_model_type(hub_id) != config.get("model_type"):
            continue
        data = json.loads(preset_path(hub_id).read_text(encoding="utf-8"))
        if {k: v for k, v in data.items() if k not in CHECKPOINT_KEYS} != mine:
            found.append((hub_id, data))
    return found


def tiny_plan(config: Mapping[str, Any], config_class: type, attn_implementation: str, full: Any,
              scan: Any) -> TinyPlan:
    """What shrinking ``config`` needs to know of its model (``full`` config, ``scan`` of its meta model)."""
    text = full.get_text_config() if hasattr(full, "get_text_config") else full
    derived = field_value(text, "layer_types")
    return TinyPlan(raw=config, config_class=config_class, attn_implementation=attn_implementation,
                    derived_layer_types=list(derived) if isinstance(derived, (list, tuple)) else None,
                    layer_kinds=scan.layer_kinds(), real_kinds=layer_kinds(scan.layers, text),
                    derived_lists=derived_lists(text, config, config_class, len(scan.layers)),
                    model_reads=scan.config_reads())


def variant_values(base: Mapping[str, Any], other: Mapping[str, Any], config_class: type) -> dict[str, Any]:
    """The fields that turn ``base`` into ``other`` (fields only ``base`` sets go back to the class default)."""
    defaults: dict[str, Any] = {}
    if dataclasses.is_dataclass(config_class):
        for f in dataclasses.fields(config_class):
            if f.default is not dataclasses.MISSING:
                defaults[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                defaults[f.name] = f.default_factory()
    values = {k: v for k, v in other.items() if base.get(k, _ABSENT) != v}
    for key in base:
        if key not in other and key != "variants" and key in defaults and defaults[key] != base[key]:
            values[key] = defaults[key]
    return values


_ABSENT = object()


def sibling_variants(config: Mapping[str, Any], base_tiny: Mapping[str, Any], covered: set[Hashable],
                     config_class: type, attn_implementation: str) -> list[tuple[str, dict[str, Any], TinyPlan]]:
    """``(hub id, variant, plan)`` for each sibling preset with layer kinds ``covered`` lacks.

    ``covered`` (the kinds the tiny models build so far) is updated in place.
    """
    variants = []
    windows = _windows(base_tiny, config_class)
    for hub_id, data in sibling_presets(config):
        full, model = meta_model(config_class, data)
        text = full.get_text_config() if hasattr(full, "get_text_config") else full
        scan = scan_model(model, field_value(text, "num_hidden_layers"))
        plan = tiny_plan(data, config_class, attn_implementation, full, scan)
        del model, scan
        if plan.real_kinds <= covered and _windows(data, config_class) <= windows:
            continue
        tiny = fit_tiny_config(plan, TINY, [], [])
        variants.append((hub_id, variant_values(base_tiny, tiny, config_class), plan))
        covered |= meta_layer_kinds(config_class, tiny, attn_implementation) or plan.real_kinds
        windows |= _windows(tiny, config_class)
    return variants


_WINDOW_FIELDS = ("sliding_window", "attention_chunk_size")  # transformers' standard names of mask windows


def _windows(config: Mapping[str, Any], config_class: type) -> set[str]:
    """The mask windows ``config`` sets (a sliding window, attention chunks): other mask kinds than causal."""
    names = FieldNames.of(config_class)
    return {names.standard(k) for k, v in config.items()
            if names.standard(k) in _WINDOW_FIELDS and is_int(v) and v > 0}
