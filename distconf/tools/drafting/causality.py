"""The drafter refuses a model that is not causal (`distconf.tools.checker.causal`), in one line."""

from __future__ import annotations

from distconf.tools.drafting.common import DraftingError, field_value, quiet_transformers
from distconf.tools.drafting.probe import TinyFacts
from distconf.tools.drafting.render import FamilyDraft

__all__ = ["refuse_non_causal"]


def refuse_non_causal(facts: TinyFacts, draft: FamilyDraft) -> None:
    """Raise `DraftingError` when the tiny model's first tokens' outputs depend on later tokens."""
    config_class, tiny, attn_implementation = facts.config_class, facts.tiny, draft.attn_implementation
    from distconf.tools.checker.causal import non_causal_cause
    from distconf.tools.checker.reference import perturb_weights
    from distconf.tools.drafting.probe_runs import try_tiny_model

    built = try_tiny_model(config_class, tiny, attn_implementation)
    if built is None:  # the tiny run reports why the config does not build
        return
    config, model = built
    perturb_weights(model)  # as the check does: an initializer's equal values would tie in top-k choices
    with quiet_transformers():
        cause = non_causal_cause(model, field_value(config, "vocab_size", 2) or 2)
    if cause is not None:
        raise DraftingError(cause + ": it cannot be served as blocks")
