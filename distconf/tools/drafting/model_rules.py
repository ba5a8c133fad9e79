"""The drafting rules that read the model built on the meta device, each with the rules it depends on declared.

Before any tiny model runs, `draft_family` scans the causal LM built from the config on the meta device
(`distconf.tools.drafting.scan`). A rule here decides one part of the draft from that scan (`ModelFacts`) and
what the earlier rules wrote; `MODEL_RULES` lists them in the order they are applied (the one the golden drafts
pin: it orders the draft's findings and its sections' keys), and `check_order` proves every rule comes after the
rules it needs. The rules over the tiny model's probe runs come after (`distconf.tools.drafting.rules`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from distconf.loader.per_layer import layer_config
from distconf.tools.drafting.common import field_value
from distconf.tools.drafting.fields import FieldNames
from distconf.tools.drafting.hybrid_tiny import draft_layer_type_argument
from distconf.tools.drafting.kv import kv_groups_formula
from distconf.tools.drafting.layer_classes import draft_layer_classes, merge_call_parameters
from distconf.tools.drafting.model_buffers import draft_model_buffers
from distconf.tools.drafting.render import FamilyDraft
from distconf.tools.drafting.rules import Rule, check_order
from distconf.tools.drafting.scan import ModelScan
from distconf.tools.drafting.sections import (
    draft_call,
    draft_constructor,
    draft_mask,
    draft_mask_skip,
    draft_model_inputs,
    draft_position,
)
from distconf.tools.drafting.streams import note_carried_streams, refuse_stacked_streams
from distconf.tools.drafting.sublayers import draft_modules_field

__all__ = ["ModelFacts", "MODEL_RULES"]


@dataclass(frozen=True)
class ModelFacts:
    """What the model rules read: the meta-device scan of the causal LM, its configs and the config.json."""

    scan: ModelScan
    full: Any
    """The whole config object the model was built from."""
    text: Any
    """The config sizing the served stack (the text config of a multimodal model)."""
    config: Mapping[str, Any]
    """The config.json's values (its text part for a nested config)."""
    config_class: type
    """The config class the family reads (a sectioned one when a sub-config sizes the stack)."""
    run_tiny: bool = True
    """Whether tiny models run after these rules (a growing stack is only confirmed there)."""

    @property
    def layers_attribute(self) -> str:
        """The attribute of the layer list's owner holding the layers (``layers`` for ``model.layers``)."""
        return self.scan.prefix.rpartition(".")[2]


def _modules_field(facts: ModelFacts, draft: FamilyDraft) -> None:
    """``block.modules_field`` (`sublayers.draft_modules_field`)."""
    draft_modules_field(draft, facts.scan, facts.text)


def _constructor(facts: ModelFacts, draft: FamilyDraft) -> None:
    """``block.constructor``: the layer's ``__init__`` argument names."""
    draft_constructor(draft, facts.scan.layer_class, facts.scan.base_model)


def _call(facts: ModelFacts, draft: FamilyDraft) -> None:
    """``block.call`` from the layer's ``forward`` (every layer class's); ``draft.layer_parameters``."""
    draft.layer_parameters = merge_call_parameters(draft, facts.scan, draft_call(draft, facts.scan.layer_class))


def _position(facts: ModelFacts, draft: FamilyDraft) -> None:
    """``block.position``: the rotary module and / or the ALiBi argument."""
    draft_position(draft, facts.scan, draft.layer_parameters, facts.full)


def _mask(facts: ModelFacts, draft: FamilyDraft) -> None:
    """``block.mask``: per-layer types, a window, or causal."""
    draft_mask(draft, facts.text, facts.scan.base_model)


def _layer_type_argument(facts: ModelFacts, draft: FamilyDraft) -> None:
    """``block.constructor.layer_type_argument`` for layers built per type."""
    draft_layer_type_argument(draft, facts.scan.layer_class)


def _mask_skip(facts: ModelFacts, draft: FamilyDraft) -> None:
    """``block.mask.allow_skip: false`` when the layer reads the mask's values."""
    draft_mask_skip(draft, facts.scan.attention_class, facts.scan.layer_class)


def _layer_classes(facts: ModelFacts, draft: FamilyDraft) -> None:
    """``block.layer_classes`` / ``attention_classes`` of a model with several kinds of layer."""
    draft_layer_classes(draft, facts.scan, facts.text)


def _model_buffers(facts: ModelFacts, draft: FamilyDraft) -> None:
    """``block.model_buffers``: buffers the layers read from the model."""
    draft_model_buffers(draft, facts.scan, facts.text)


def _model_inputs(facts: ModelFacts, draft: FamilyDraft) -> None:
    """Inputs the model prepares for its layers (a position bias, a boolean mask), or a review note."""
    draft_model_inputs(draft, facts.scan, draft.layer_parameters)


def _carried_notes(facts: ModelFacts, draft: FamilyDraft) -> None:
    """A review note for values carried between layers; without tiny runs, a refusal of a growing stack."""
    if not facts.run_tiny:  # a growing stack is confirmed on tiny runs only
        refuse_stacked_streams(facts.scan.base_model, facts.layers_attribute)
    note_carried_streams(draft.review, facts.scan.base_model, facts.layers_attribute)


def _kv_groups(facts: ModelFacts, draft: FamilyDraft) -> None:
    """``kv_groups`` from the first layer's head counts (the tiny runs confirm or replace it)."""
    first_layer = layer_config(facts.text, 0)  # a heterogeneous config holds the head counts per layer
    draft.kv_groups = kv_groups_formula(first_layer, facts.config, FieldNames.of(facts.config_class))
    if draft.kv_groups == 1 and field_value(first_layer, "num_attention_heads") is None:
        draft.review.append("no num_attention_heads field: set kv_groups by hand")


MODEL_RULES: tuple[Rule[ModelFacts], ...] = (
    Rule("modules_field", (), _modules_field),
    Rule("constructor", (), _constructor),
    Rule("call", (), _call),
    Rule("position", ("call",), _position),
    Rule("mask", ("position",), _mask),  # reads position.rotary_layer_type_argument
    Rule("layer_type_argument", ("mask",), _layer_type_argument),
    Rule("mask_skip", ("mask",), _mask_skip),
    Rule("layer_classes", ("mask",), _layer_classes),
    Rule("model_buffers", (), _model_buffers),
    Rule("model_inputs", ("call", "mask"), _model_inputs),
    Rule("carried_notes", (), _carried_notes),
    Rule("kv_groups", (), _kv_groups),
)
"""The rules over the meta-device model, in the order they are applied."""

check_order(MODEL_RULES)
