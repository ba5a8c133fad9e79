"""The drafting rules that read the tiny model's probe runs, each with the rules it depends on declared.

A `Rule` decides one part of the draft from the probe runs of the tiny config (`distconf.tools.drafting.probe`:
each run made once per draft, whichever rule asks first) and what the earlier rules wrote. `TINY_RULES` lists
them in the order `draft_family` applies them; `check_order` proves every rule comes after the rules it needs.
A rule whose probe run failed decides nothing and says why in the draft's ``undecided`` notes.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

from distconf.tools.drafting.call_inputs import draft_call_inputs
from distconf.tools.drafting.carried import draft_carried_arguments, draft_carried_streams
from distconf.tools.drafting.causality import refuse_non_causal
from distconf.tools.drafting.dict_mask import draft_dict_mask
from distconf.tools.drafting.layer_inputs import refuse_layer_inputs
from distconf.tools.drafting.layer_stack import draft_layer_stack
from distconf.tools.drafting.positions import draft_computed_positions
from distconf.tools.drafting.probe import TinyFacts, failed_probes
from distconf.tools.drafting.render import FamilyDraft
from distconf.tools.drafting.shared_kv import draft_fresh_arguments, draft_shared_kv
from distconf.tools.drafting.skipped import draft_skipped_layers
from distconf.tools.drafting.stacks import draft_growing_stacks
from distconf.tools.drafting.state_section import finish_state
from distconf.tools.drafting.streams import draft_hidden_state

__all__ = ["TinyFacts", "Rule", "TINY_RULES", "check_order", "apply_rules"]

FactsT = TypeVar("FactsT")


@dataclass(frozen=True)
class Rule(Generic[FactsT]):
    """One drafting rule: its name, the rules whose writes it reads (``needs``), and the function deciding from
    the facts it is given and the draft so far (its docstring says what it writes)."""

    name: str
    needs: tuple[str, ...]
    apply: Callable[[FactsT, FamilyDraft], None]


TINY_RULES: tuple[Rule[TinyFacts], ...] = (
    Rule("layer_stack", (), draft_layer_stack),
    Rule("causal", (), refuse_non_causal),
    Rule("computed_positions", (), draft_computed_positions),
    Rule("fresh_arguments", (), draft_fresh_arguments),
    Rule("shared_kv", ("fresh_arguments",), draft_shared_kv),
    Rule("call_inputs", ("computed_positions",), draft_call_inputs),
    Rule("dict_mask", ("call_inputs",), draft_dict_mask),  # the mask argument call_inputs may rename
    Rule("growing_stacks", ("computed_positions", "call_inputs"), draft_growing_stacks),
    Rule("layer_inputs", ("computed_positions", "fresh_arguments", "call_inputs", "growing_stacks"),
         refuse_layer_inputs),  # refuses what none of those has the block pass itself
    Rule("skipped_layers", (), draft_skipped_layers),
    Rule("hidden_streams", ("layer_inputs",), draft_hidden_state),
    Rule("carried_streams", ("hidden_streams",), draft_carried_streams),
    Rule("carried_arguments", (), draft_carried_arguments),
    Rule("state", ("shared_kv",), finish_state),  # after the variant runs wrote the state and the kv_cache
)
"""The rules over the tiny model's probe runs, in the order they are applied (the one the golden drafts pin);
``hidden_state.carried`` lists what they carry in that order."""


def check_order(rules: Iterable[Rule[FactsT]]) -> None:
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


def apply_rules(rules: Iterable[Rule[FactsT]], facts: FactsT, draft: FamilyDraft) -> None:
    """Apply ``rules`` in order; a rule whose probe run failed says so in ``draft.undecided``."""
    failed_probes()  # failures before the rules are the variant runs', reported in the review notes
    for rule in rules:
        rule.apply(facts, draft)
        for forward, record in failed_probes():
            stage = "does not run" if record.built else "does not build"
            draft.undecided.append(f"{rule.name}: not decided, the tiny model {stage} for its probe "
                                   f"({forward.describe()}): "
                                   f"{record.error}")
