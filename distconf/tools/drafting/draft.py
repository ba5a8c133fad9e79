"""`draft_family`: a first family file for a model, from its ``config.json`` and the installed transformers."""

from __future__ import annotations

import copy
from collections.abc import Hashable, Mapping
from typing import Any

from distconf.blocks.hf_compat import supports_sdpa
from distconf.loader.layer_section import sectioned_config_class
from distconf.tools.drafting.carried import carried_places
from distconf.tools.drafting.common import (
    DraftingError,
    check_family_name,
    class_path,
    field_value,
    module_path,
    quiet_transformers,
)
from distconf.tools.drafting.fields import FieldNames
from distconf.tools.drafting.hybrid_tiny import with_attention_layer
from distconf.tools.drafting.kv import KVLayout, kv_groups_formula, kv_layout
from distconf.tools.drafting.kv_overrides import kv_layer_overrides
from distconf.tools.drafting.kvmerge import VariantKV, merge_kv
from distconf.tools.drafting.layer_classes import settle_attention_classes
from distconf.tools.drafting.model_rules import MODEL_RULES, ModelFacts
from distconf.tools.drafting.named_variants import named_type_variants
from distconf.tools.drafting.nested import text_section
from distconf.tools.drafting.per_layer import at_layer, explained_by_layer_configs
from distconf.tools.drafting.probe import meta_layer_kinds, probe_session
from distconf.tools.drafting.probe_runs import TinyRun, run_tiny, state_dtypes
from distconf.tools.drafting.profile import PROBE, TINY
from distconf.tools.drafting.render import FamilyDraft
from distconf.tools.drafting.rules import TINY_RULES, TinyFacts, apply_rules
from distconf.tools.drafting.scan import ModelScan, layer_section, meta_model, scan_model
from distconf.tools.drafting.sections import (
    map_layer_kinds,
)
from distconf.tools.drafting.shrink import CHECKPOINT_KEYS, shrink_config
from distconf.tools.drafting.stacks import stack_places
from distconf.tools.drafting.state_layer_list import apply_state_list
from distconf.tools.drafting.state_layout import state_layout
from distconf.tools.drafting.state_module_attributes import apply_module_states
from distconf.tools.drafting.state_returned_tuple import apply_returned_state
from distconf.tools.drafting.state_section import (
    apply_state,
    attention_by_type,
    cache_module_class,
    refuse_foreign_state,
)
from distconf.tools.drafting.streams import carried_keywords
from distconf.tools.drafting.sublayers import finish_sublayers
from distconf.tools.drafting.tiny import TinyPlan, fit_tiny_config
from distconf.tools.drafting.variants import sibling_variants, tiny_plan

__all__ = ["draft_family"]

_ANCHOR_CHECKS = (("hidden_size", TINY.hidden), ("num_attention_heads", TINY.heads),
                  ("num_hidden_layers", TINY.max_layers), ("vocab_size", TINY.vocab))
_Variant = tuple[str, TinyPlan, dict[str, Any]]  # name, what it was shrunk from, fields over the base


def _config_class(config: Mapping[str, Any]) -> type:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise DraftingError("the config has no model_type; it is the field that picks the Hugging Face classes")
    if model_type not in CONFIG_MAPPING:
        raise DraftingError(
            f"model_type {model_type!r} is not known to the installed transformers; upgrade transformers, or "
            "write the family by hand with classes from a trusted package (DISTCONF_TRUSTED_MODULES)")
    return CONFIG_MAPPING[model_type]


def _new_draft(family: str, model_type: str, config_class: type, scan: ModelScan) -> FamilyDraft:
    layer_class, attention = scan.layer_class, scan.attention_class
    draft = FamilyDraft(family=family, model_type=model_type, config_class=class_path(config_class),
                        layer_class=module_path(layer_class),
                        attention_class=module_path(attention) if attention else None,
                        prefix=scan.prefix, base_model_prefix=scan.base_prefix)
    model_name = type(scan.model).__name__
    draft.facts.append(f"{model_name} keeps its {len(scan.layers)} layers ({layer_class.__name__}) in "
                       f"'{scan.prefix}'")
    if attention is None:
        draft.review.append(f"no *Attention module inside {layer_class.__name__}; set attention_class by hand")
    else:
        draft.facts.append(f"attention module '{scan.attention_name}' is {attention.__name__}")
    if not supports_sdpa(type(scan.model)):
        draft.attn_implementation = "eager"
        draft.facts.append(f"{model_name} does not support sdpa: eager attention")
    return draft


def draft_family(family: str, config: Mapping[str, Any], *, run_tiny: bool = True) -> FamilyDraft:
    """Draft the family file of a model from its ``config.json`` contents.

    Raises `DraftingError` when the config cannot be used (no or unknown
    ``model_type``, no causal-LM class, no layer list). Everything else that needs a
    human is listed in the draft's ``review`` notes.
    """
    with quiet_transformers(), probe_session():  # each tiny config is built, and each of its probe runs made, once
        return _draft_family(family, config, run_tiny=run_tiny)


def _draft_family(family: str, config: Mapping[str, Any], *, run_tiny: bool) -> FamilyDraft:
    check_family_name(family)
    config_class = _config_class(config)
    config = copy.deepcopy(dict(config))
    nested = text_section(config, config_class)
    if nested is not None:
        config, config_class, nested_fact = nested
    if "text_config" in config:
        shrink_config(config, config_class=config_class)  # raises the explanation before any model is built
    full, model = meta_model(config_class, config)
    text = full.get_text_config() if hasattr(full, "get_text_config") else full
    section = layer_section(full, model) if field_value(text, "num_hidden_layers") is None else None
    hf_config_class = config_class
    if section is not None:  # the served stack is sized by a sub-config: the config reads it from there
        config_class = sectioned_config_class(config_class, section)
        full, model = meta_model(config_class, config)
        text = full
    scan = scan_model(model, field_value(text, "num_hidden_layers"))
    draft = _new_draft(family, str(config["model_type"]), hf_config_class, scan)
    if nested is not None:
        draft.facts.insert(0, nested_fact)
    if section is not None:
        draft.config_section = section
        draft.facts.append(f"{hf_config_class.__name__} counts no layers at its top level; the served stack "
                           f"'{scan.prefix}' is sized by its sub-config {section!r} (block.config_section)")
        draft.review.extend(_shadowed_section_fields(full, section))
    apply_rules(MODEL_RULES, ModelFacts(scan, full, text, config, config_class, run_tiny), draft)
    sublayers = scan.sublayers
    stacks = stack_places(scan.base_model, scan.prefix.rpartition(".")[2], scan.layer_class)
    owner = type(scan.base_model).__name__
    carried = carried_keywords(scan.base_model, scan.prefix.rpartition(".")[2])
    places = carried_places(scan.base_model, scan.prefix.rpartition(".")[2], scan.layer_class)
    plan = tiny_plan(config, config_class, draft.attn_implementation, full, scan)
    layer_class = scan.layer_class
    mixer = cache_module_class(scan.layers[0]) if scan.attention_class is None and scan.layers else None
    by_type = attention_by_type(scan, field_value(text, "layer_types"))
    del model, scan
    draft.tiny_config = fit_tiny_config(plan, TINY, draft.review, draft.facts)
    if run_tiny:
        draft.tiny_config = with_attention_layer(plan.config_class, layer_class, draft.tiny_config,
                                                 draft.attn_implementation, draft.facts)
    variants = [("tiny", plan, {}), *_sibling_variants(draft, plan)]
    variants += _named_type_variants(draft, plan, layer_class)
    if run_tiny:
        _verify_tiny(draft, variants)
        base_tiny = {k: v for k, v in draft.tiny_config.items() if k != "variants"}
        facts = TinyFacts(plan.config_class, base_tiny, layer_class, field_value(text, "vocab_size"), stacks, owner,
                          places, carried, by_type, mixer)
        apply_rules(TINY_RULES, facts, draft)
    settle_attention_classes(draft)
    finish_sublayers(draft, sublayers)
    return draft


def _shadowed_section_fields(full: Any, section: str) -> list[str]:
    """Review notes for the fields the top level and the sub-config ``section`` both set to different values: the
    family's config reads the top level's, the model builds the served layers with the sub-config's."""
    top, sub = vars(full), vars(getattr(full, section))
    return [f"{name} is {top[name]!r} at the top level but {sub[name]!r} in {section}: the family's config reads "
            "the top level's, the model builds its layers with the sub-config's"
            for name in sorted(sub) if name in top and not name.startswith("_") and name not in CHECKPOINT_KEYS
            and top[name] != sub[name]]


def _sibling_variants(draft: FamilyDraft, plan: TinyPlan) -> list[_Variant]:
    """Variants for shipped presets of the model_type with other kinds of layers (written into tiny_config)."""
    covered: set[Hashable] = meta_layer_kinds(plan.config_class, draft.tiny_config, draft.attn_implementation) \
        or set(plan.real_kinds)
    found = sibling_variants(plan.raw, draft.tiny_config, covered, plan.config_class, draft.attn_implementation)
    if not found:
        return []
    draft.tiny_config["variants"] = [{}, *(values for _, values, _ in found)]
    draft.facts.append(f"tiny_config has a variant per shipped preset of model_type {draft.model_type!r} whose "
                       f"layers are of other kinds ({', '.join(hub_id for hub_id, _, _ in found)}); the first, "
                       "empty one is this config")
    return [(hub_id, sibling_plan, values) for hub_id, values, sibling_plan in found]


def _named_type_variants(draft: FamilyDraft, plan: TinyPlan, layer_class: type) -> list[_Variant]:
    """Variants for the layer types the modeling code names that no variant builds (written into tiny_config)."""
    base = {k: v for k, v in draft.tiny_config.items() if k != "variants"}
    where, found = named_type_variants(plan.config_class, layer_class, base,
                                       list(draft.tiny_config.get("variants", [])))
    # a type the config class takes but the modeling code cannot build is not one of the architecture's layers
    found = [(t, v) for t, v in found
             if meta_layer_kinds(plan.config_class, {**base, **v}, draft.attn_implementation) is not None]
    if not found:
        return []
    draft.tiny_config["variants"] = [*draft.tiny_config.get("variants", [{}]), *(values for _, values in found)]
    map_layer_kinds(draft, [layer_type for layer_type, _ in found])
    draft.facts.append(f"tiny_config has a variant per layer type named by {where} that the config.json does not "
                       f"build ({', '.join(layer_type for layer_type, _ in found)}): `distconf check` runs every "
                       "layer type of the architecture")
    return [(f"layer type {layer_type}", plan, values) for layer_type, values in found]


def _drop_variant(draft: FamilyDraft, values: dict[str, Any]) -> bool:
    """Remove the tiny variant ``values`` (the very dict) from the draft's tiny_config; whether it was there."""
    listed = draft.tiny_config.get("variants", [])
    kept = [v for v in listed if v is not values]
    if len(kept) == len(listed):
        return False
    draft.tiny_config["variants"] = kept
    if kept == [{}]:
        del draft.tiny_config["variants"]
    return True


def _verify_tiny(draft: FamilyDraft, variants: list[_Variant]) -> None:
    """Run every tiny variant; check sizes and kinds of layers; decide kv_groups / kv_cache from the caches."""
    base = {k: v for k, v in draft.tiny_config.items() if k != "variants"}
    layouts, real_kinds, tiny_kinds = [], set(), set()
    state_run: tuple[TinyPlan, TinyRun, dict[str, Any]] | None = None
    geometry_notes: list[str] = []
    first: tuple[TinyPlan, TinyRun] | None = None
    for name, plan, values in variants:
        prefix = "" if name == "tiny" else f"variant {name}: "
        tiny = run_tiny(plan.config_class, {**base, **values}, draft.attn_implementation)
        if isinstance(tiny, str):
            if name.startswith("layer type ") and _drop_variant(draft, values):  # a type its layers refuse
                draft.facts.append(f"{name} is named by the modeling code, but the model does not run it "
                                   f"({tiny.splitlines()[0]}): no tiny variant for it")
                continue
            draft.review.append(f"{prefix}the tiny config does not run: {tiny}; fix tiny_config")
            continue
        refuse_foreign_state(tiny.foreign_state)
        for field_name, limit in _ANCHOR_CHECKS:
            value = field_value(tiny.config, field_name)
            if isinstance(value, int) and value > limit:
                draft.review.append(f"{prefix}{field_name} is {value} on the tiny config: the field holding it was "
                                    "not recognised; shrink it in tiny_config")
        real_kinds |= plan.real_kinds
        tiny_kinds |= tiny.kinds
        if state_run is None and any(s.keeps_state for s in tiny.states):
            state_run = (plan, tiny, {**base, **values})
            draft.keeps_kv = any(s.kv for s in tiny.states)
        geometry_notes += _per_layer_geometry(prefix, tiny)
        if name == "tiny":
            first = (plan, tiny)
        if not any(s.kv for s in tiny.states) and tiny.states:
            continue
        own = at_layer(tiny)  # a heterogeneous config: the config of the layer the cache was read from
        groups = kv_groups_formula(own.config, plan.raw, FieldNames.of(plan.config_class))
        probe = _probe(plan, draft.attn_implementation, values)
        layouts.append(VariantKV(name, own.config, KVLayout(groups) if draft.call.get("cache_argument", "") is None
                                 else kv_layout(groups, own, plan.raw, lambda probe=probe: at_layer(probe()))))
    if real_kinds - tiny_kinds:
        draft.review.append(f"the real model has {len(real_kinds)} kinds of layers, the tiny config builds "
                            f"{len(tiny_kinds & real_kinds)} of them: change the tiny_config fields that decide "
                            "which layers are which so that every kind appears")
    if layouts and (draft.keeps_kv or not draft.state):
        layout = merge_kv(layouts)
        draft.kv_groups, draft.kv_cache = layout.kv_groups, layout.kv_cache
        draft.facts.extend(layout.facts)
        draft.review.extend(layout.review)
    if geometry_notes and not _explained_per_layer(draft, first) and not _layer_overrides(draft, first):
        draft.review.extend(geometry_notes)
    if state_run is not None:
        _draft_state(draft, *state_run)


def _draft_state(draft: FamilyDraft, plan: TinyPlan, tiny: TinyRun, values: dict[str, Any]) -> None:
    """The state section from the tiny model's cache, confirmed on the probe model."""
    probe_run = _probe(plan, draft.attn_implementation)

    def probe() -> tuple[Any, list[Any]] | None:
        second = probe_run()
        return (second.config, second.states) if second is not None else None

    runs: dict[tuple[str, int], tuple[Any, list[Any]] | None] = {}

    def perturb(name: str, value: int) -> tuple[Any, list[Any]] | None:
        if (name, value) not in runs:
            run = run_tiny(plan.config_class, {**base_values, name: value}, draft.attn_implementation)
            runs[name, value] = (run.config, run.states) if isinstance(run, TinyRun) else None
        return runs[name, value]

    base_values = values
    layout = state_layout(tiny.config, plan.raw, tiny.states, probe, perturb)
    if layout is None:
        return
    if tiny.module_states is not None and layout.problem is None:
        apply_module_states(draft, layout, tiny.module_states)
    if tiny.state_methods is not None and layout.problem is None:
        layout.state["recurrent_methods"] = {"get": tiny.state_methods.get, "set": tiny.state_methods.set}
    if tiny.state_list is not None and layout.problem is None:
        apply_state(draft, layout, apply_state_list(draft, layout, tiny.state_list, plan.config_class, values))
        return
    if tiny.returned_state is not None and layout.problem is None:
        apply_state(draft, layout, apply_returned_state(draft, layout, tiny.returned_state,
                                                        plan.config_class, values))
        return
    dtypes = state_dtypes(plan.config_class, values, draft.attn_implementation)
    if dtypes is None:  # most scans accumulate in float32; sizing then errs on the large side
        draft.facts.append("the tiny model does not run in bfloat16 here: recurrent_dtype float32 is assumed")
    float32 = dtypes is None or "float32" in dtypes["recurrent"]
    apply_state(draft, layout, float32, conv_float32=dtypes is not None and "float32" in dtypes["conv"])


def _per_layer_geometry(prefix: str, tiny: TinyRun) -> list[str]:
    """A review note when the layers of one tiny model cache K/V of different shapes (unless
    `_layer_overrides` declares them)."""
    shapes = [s for s in tiny.layer_shapes if s is not None]
    if len(set(shapes)) <= 1:
        return []
    per_layer = ", ".join(f"layer {i}: {s[0]} x {s[1]} / {s[2]} x {s[3]}"
                          for i, s in enumerate(tiny.layer_shapes) if s is not None)
    return [f"{prefix}the layers cache keys / values of different shapes (KV heads x head size; {per_layer}): "
            "the KV geometry differs per layer kind; declare it in kv_cache.layer_overrides (the kv_cache "
            "written is the last layer's)"]


def _explained_per_layer(draft: FamilyDraft, first: tuple[TinyPlan, TinyRun] | None) -> bool:
    """The layers' different K/V shapes are what the kv_cache section gives on each layer's own config (a
    heterogeneous config), on the tiny and the probe model: no layer_overrides needed."""
    if first is None or not explained_by_layer_configs(draft.kv_cache, draft.kv_groups, first[1]):
        return False
    probe = _probe(first[0], draft.attn_implementation)()
    if probe is None or not explained_by_layer_configs(draft.kv_cache, draft.kv_groups, probe):
        return False
    draft.facts.append("the layers cache K/V of the sizes their own per_layer_config gives (a heterogeneous "
                       "config): the kv_cache formulas are read on each layer's config")
    return True


def _layer_overrides(draft: FamilyDraft, first: tuple[TinyPlan, TinyRun] | None) -> bool:
    """Write ``kv_cache.layer_overrides`` found on the tiny and probe models; whether it was written."""
    field = draft.mask.get("layer_types_field")
    if first is None or not field or not draft.keeps_kv:
        return False
    plan, tiny = first
    probe = _probe(plan, draft.attn_implementation)()
    overrides = kv_layer_overrides(draft.kv_cache, draft.kv_groups, field, [tiny] + ([probe] if probe else []))
    if overrides is None or probe is None:
        return False
    draft.kv_cache["layer_overrides"] = overrides
    draft.facts.append("layers of type " + ", ".join(overrides) + " cache K/V of another geometry "
                       "(kv_cache.layer_overrides, confirmed on a second tiny model)")
    return True


def _probe(plan: TinyPlan, attn_implementation: str, variant: Mapping[str, Any] | None = None) -> Any:
    """A function running, once, the second (differently shaped) tiny model of ``plan`` (with the per-layer type
    lists of tiny ``variant`` when they fit its layers, so it builds the variant's kinds of layers)."""
    cache: list[TinyRun | None] = []

    def probe() -> TinyRun | None:
        if not cache:
            values = with_attention_layer(plan.config_class, None, fit_tiny_config(plan, PROBE, [], []),
                                          attn_implementation, [])
            values.update(_type_lists(variant or {}, values))
            result = run_tiny(plan.config_class, values, attn_implementation)
            cache.append(result if isinstance(result, TinyRun) else None)
        return cache[0]

    return probe


def _type_lists(variant: Mapping[str, Any], values: Mapping[str, Any]) -> dict[str, Any]:
    """The per-layer lists of layer types in ``variant`` that have as many entries as ``values`` has layers."""
    layers = values.get("num_hidden_layers")
    return {key: value for key, value in variant.items()
            if isinstance(value, list) and value and all(isinstance(v, str) for v in value) and len(value) == layers}
