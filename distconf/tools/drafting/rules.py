"""The drafting rules that read the tiny model's probe runs, each with the rules it depends on declared.

A `Rule` decides one part of the draft from the probe runs of the tiny config (`distconf.tools.drafting.probe`:
each run made once per draft, whichever rule asks first) and what the earlier rules wrote. `TINY_RULES` lists
them in the order `draft_family` applies them; `check_order` proves every rule comes after the rules it needs.
A rule whose probe run failed decides nothing and says why in the draft's ``undecided`` notes.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from distconf.tools.drafting.call_inputs import draft_call_inputs
from distconf.tools.drafting.carried import draft_carried_arguments
from distconf.tools.drafting.carried_streams import draft_carried_streams
from distconf.tools.drafting.causality import refuse_non_causal
from distconf.tools.drafting.dict_mask import draft_dict_mask
from distconf.tools.drafting.fresh_arguments import draft_fresh_arguments
from distconf.tools.drafting.hidden_streams import draft_hidden_state
from distconf.tools.drafting.layer_inputs import refuse_layer_inputs
from distconf.tools.drafting.layer_stack import draft_layer_stack
from distconf.tools.drafting.positions import draft_computed_positions
from distconf.tools.drafting.probe import failed_probes
from distconf.tools.drafting.render import FamilyDraft
from distconf.tools.drafting.shared_kv import draft_shared_kv
from distconf.tools.drafting.skipped import draft_skipped_layers
from distconf.tools.drafting.stacks import draft_growing_stacks
from distconf.tools.drafting.state_section import finish_state

__all__ = ["TinyFacts", "Rule", "TINY_RULES", "check_order", "apply_rules"]


@dataclass(frozen=True)
class TinyFacts:
    """What the rules get besides the draft: the tiny config (without its variants) and its config class, and
    what the static scan of the model found that a rule confirms on the probe runs."""

    config_class: type
    tiny: Mapping[str, Any]
    layer_class: type
    vocab_size: Any = None
    stacks: Mapping[str, Any] = field(default_factory=dict)
    """Growing stacks the model's forward passes its layers (`stacks.stack_places`)."""
    owner: str = ""
    """The class name of the module holding the layer list."""
    carried_places: Mapping[str, tuple[str, int]] = field(default_factory=dict)
    """Values carried from layer to layer, not handed by keyword (`carried_streams.carried_places`)."""
    carried_keywords: Mapping[str, Any] = field(default_factory=dict)
    """Values carried from layer to layer by keyword (`streams.carried_keywords`)."""
    attention_by_type: Mapping[str, type] = field(default_factory=dict)
    mixer: type | None = None
    """The layers' cache-taking module when no attention module was found (`state_section.cache_module_class`)."""


@dataclass(frozen=True)
class Rule:
    """One drafting rule: its name, the rules whose writes it reads (``needs``), and how it decides."""

    name: str
    needs: tuple[str, ...]
    apply: Callable[[TinyFacts, FamilyDraft], None]
    doc: str = ""


def _rule(name: str, needs: Iterable[str], doc: str) -> Callable[[Callable[[TinyFacts, FamilyDraft], None]], Rule]:
    def make(apply: Callable[[TinyFacts, FamilyDraft], None]) -> Rule:
        return Rule(name, tuple(needs), apply, doc)
    return make


@_rule("layer_stack", (), "block.layer_stack.loop: a range of layers run several times per forward pass")
def _layer_stack(facts: TinyFacts, draft: FamilyDraft) -> None:
    draft_layer_stack(draft, facts.config_class, facts.tiny)


@_rule("causal", (), "refuse a model whose first tokens' outputs depend on later tokens")
def _causal(facts: TinyFacts, draft: FamilyDraft) -> None:
    refuse_non_causal(facts.config_class, facts.tiny, draft.attn_implementation)


@_rule("computed_positions", (), "position arguments the block computes itself (position.computed_arguments)")
def _computed_positions(facts: TinyFacts, draft: FamilyDraft) -> None:
    draft_computed_positions(draft, facts.config_class, facts.tiny, facts.layer_class, facts.vocab_size)


@_rule("fresh_arguments", (), "empty containers handed to every layer (block.call.fresh_arguments)")
def _fresh_arguments(facts: TinyFacts, draft: FamilyDraft) -> None:
    draft_fresh_arguments(draft, facts.config_class, facts.tiny)


@_rule("shared_kv", ("fresh_arguments",), "K/V stored for later layers in a fresh container (kv_cache.shared)")
def _shared_kv(facts: TinyFacts, draft: FamilyDraft) -> None:
    draft_shared_kv(draft, facts.config_class, facts.tiny)


@_rule("call_inputs", ("computed_positions",),
       "the layer index, the embeddings and the 4D mask argument each layer gets (block.call, hidden_state.carried)")
def _call_inputs(facts: TinyFacts, draft: FamilyDraft) -> None:
    draft_call_inputs(draft, facts.config_class, facts.tiny)


@_rule("dict_mask", ("call_inputs",), "a mask handed as a dict (block.mask.as_dict), read on the mask argument")
def _dict_mask(facts: TinyFacts, draft: FamilyDraft) -> None:
    draft_dict_mask(draft, facts.config_class, facts.tiny)


@_rule("growing_stacks", ("computed_positions", "call_inputs"),
       "stacks of earlier layers' outputs every layer gets (hidden_state.carried, grows)")
def _growing_stacks(facts: TinyFacts, draft: FamilyDraft) -> None:
    draft_growing_stacks(draft, facts.config_class, facts.tiny, facts.stacks, facts.owner)


@_rule("layer_inputs", ("computed_positions", "fresh_arguments", "call_inputs", "growing_stacks"),
       "refuse (or carry, when computed by a method) a tensor every layer gets that no block can pass itself")
def _layer_inputs(facts: TinyFacts, draft: FamilyDraft) -> None:
    refuse_layer_inputs(draft, facts.config_class, facts.tiny, facts.layer_class)


@_rule("skipped_layers", (), "layer types the model does not run for token ids alone (block.skipped_layer_kinds)")
def _skipped_layers(facts: TinyFacts, draft: FamilyDraft) -> None:
    draft_skipped_layers(draft, facts.config_class, facts.tiny)


@_rule("hidden_streams", ("layer_inputs",), "several hidden streams between layers (hidden_state.streams)")
def _hidden_streams(facts: TinyFacts, draft: FamilyDraft) -> None:
    draft_hidden_state(draft, facts.config_class, facts.tiny)


@_rule("carried_streams", ("hidden_streams",), "values each layer returns for the next (hidden_state.carried)")
def _carried_streams(facts: TinyFacts, draft: FamilyDraft) -> None:
    places = {k: v for k, v in facts.carried_places.items() if k not in facts.carried_keywords}
    draft_carried_streams(draft, facts.config_class, facts.tiny, places)


@_rule("carried_arguments", (), "values carried by keyword from layer to layer (block.call.carried_arguments)")
def _carried_arguments(facts: TinyFacts, draft: FamilyDraft) -> None:
    draft_carried_arguments(draft, facts.config_class, facts.tiny, dict(facts.carried_keywords))


@_rule("state", ("shared_kv",), "the state section's kinds and masks, per layer type (after the variant runs)")
def _state(facts: TinyFacts, draft: FamilyDraft) -> None:
    finish_state(draft, dict(facts.attention_by_type), facts.mixer, facts.layer_class)


TINY_RULES: tuple[Rule, ...] = (_layer_stack, _causal, _computed_positions, _fresh_arguments, _shared_kv,
                                _call_inputs, _dict_mask, _growing_stacks, _layer_inputs, _skipped_layers,
                                _hidden_streams, _carried_streams, _carried_arguments, _state)
"""The rules over the tiny model's probe runs, in the order they are applied (the one the golden drafts pin)."""


def check_order(rules: Iterable[Rule]) -> None:
    """Raise `ValueError` unless every rule's names are unique and its ``needs`` are rules listed before it."""
    seen: set[Hashable] = set()
    for rule in rules:
        if rule.name in seen:
            raise ValueError(f"rule {rule.name!r} is listed twice")
        missing = [need for need in rule.needs if need not in seen]
        if missing:
            raise ValueError(f"rule {rule.name!r} needs {', '.join(missing)}, not applied before it")
        seen.add(rule.name)


check_order(TINY_RULES)


def apply_rules(rules: Iterable[Rule], facts: TinyFacts, draft: FamilyDraft) -> None:
    """Apply ``rules`` in order; a rule whose probe run failed says so in ``draft.undecided``."""
    failed_probes()  # failures before the rules are the variant runs', reported in the review notes
    for rule in rules:
        rule.apply(facts, draft)
        for forward, record in failed_probes():
            stage = "does not run" if record.built else "does not build"
            draft.undecided.append(f"{rule.name}: not decided, the tiny model {stage} for its probe ({forward}): "
                                   f"{record.error}")
