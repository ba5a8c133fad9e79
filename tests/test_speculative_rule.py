"""The acceptance rule of speculative decoding keeps the target's tokens (greedy) and its distribution (sampling).

`distconf.client.speculative.accept` is drawn many times with fixed seeds against a target distribution ``p``
and a draft ``q`` far from it; the first token's frequencies must match ``p`` by a chi-square test at
significance 0.001, and the same test must reject a wrong rule (keep every draft token), so it has the power
to catch one.
"""

from __future__ import annotations

import pytest
import torch

from distconf.client.speculative import PromptLookup, Proposal, SpeculationController, accept

VOCAB = 6
DRAWS = 10000
CRITICAL_5_DOF = 20.52  # chi-square, 5 degrees of freedom, p = 0.001


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def target_and_draft() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -2.0], [0.0, 0.5, 1.5, 0.0, -0.5, 1.0]])
    p = torch.softmax(logits, dim=-1)
    q = torch.tensor([0.05, 0.05, 0.1, 0.5, 0.2, 0.1])  # the draft prefers what the target rarely picks
    return logits, p, q


def first_tokens(rule, draft: torch.Tensor | None) -> torch.Tensor:
    logits, _, _ = target_and_draft()
    generator = torch.Generator().manual_seed(1234)
    counts = torch.zeros(VOCAB)
    for _ in range(DRAWS):
        if draft is None:  # a deterministic draft (prompt lookup): always proposes token 3
            proposal = Proposal([3])
        else:
            proposal = Proposal([int(torch.multinomial(draft, 1, generator=generator))], draft[None])
        n, token, _ = rule(proposal, logits, lambda x: torch.softmax(x, -1), generator)
        counts[proposal.tokens[0] if n >= 1 else token] += 1
    return counts


def keep_everything(proposal, logits, distribution, generator):
    """The wrong rule: every draft token is kept."""
    return len(proposal.tokens), 0, logits[-1]


@pytest.mark.parametrize("draft", ["model", "lookup"])
def test_speculative_sampling_keeps_the_targets_distribution(draft):
    _, p, q = target_and_draft()
    counts = first_tokens(accept, q if draft == "model" else None)
    assert chi_square(counts, p[0]) < CRITICAL_5_DOF, counts / DRAWS


@pytest.mark.parametrize("draft", ["model", "lookup"])
def test_the_test_catches_a_rule_that_keeps_every_draft_token(draft):
    _, p, q = target_and_draft()
    counts = first_tokens(keep_everything, q if draft == "model" else None)
    assert chi_square(counts, p[0]) > 10 * CRITICAL_5_DOF


def test_greedy_keeps_proposals_up_to_the_first_that_is_not_the_targets_argmax():
    logits, _, _ = target_and_draft()  # argmax 0 at the first position, 2 at the second
    assert accept(Proposal([0]), logits, None, None)[:2] == (1, 2)  # kept, then the bonus token
    assert accept(Proposal([4]), logits, None, None)[:2] == (0, 0)  # rejected: the target's own token


def test_prompt_lookup_proposes_what_followed_the_longest_earlier_match():
    lookup = PromptLookup(max_ngram=3)
    assert lookup.propose([1, 2, 3, 9, 8, 1, 2, 3], 2).tokens == [9, 8]
    assert lookup.propose([1, 2, 3, 9, 7, 3], 3).tokens == [9, 7, 3]  # one-token match, the latest one
    assert lookup.propose([1, 2, 3, 4], 3).tokens == []


def test_the_controller_stops_speculating_when_it_does_not_pay_and_probes_again():
    controller = SpeculationController(max_tokens=4, probe_every=5)
    controller.record_step(1, 0.010)
    controller.record_round(4, 0, draft_seconds=0.004)  # a cheap draft that is always wrong
    for _ in range(6):
        controller.record_round(1, 0, draft_seconds=0.001)
    picks = [controller.next_k() for _ in range(10)]
    assert picks.count(0) >= 8 and 1 in picks  # off, with a probe now and then
    slow = SpeculationController(max_tokens=4, probe_every=5)
    slow.record_step(1, 0.010)
    slow.record_round(2, 0, draft_seconds=0.030)  # a draft token costs more than a step: it can never pay
    assert [slow.next_k() for _ in range(40)] == [0] * 40  # not even probed
    slow.record_step(1, 0.200)  # the steps got slower (a far network): worth probing again
    assert 1 in [slow.next_k() for _ in range(40)]
    fast = SpeculationController(max_tokens=8)
    fast.record_step(1, 0.100)  # a slow network step, a cheap draft that is usually right
    fast.record_step(9, 0.110)
    for _ in range(5):
        fast.record_round(8, 7, draft_seconds=0.008)
    assert fast.next_k() >= 6
