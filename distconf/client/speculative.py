"""Speculative decoding: a draft proposes tokens, the swarm scores them all in one step, the right ones are kept.

A token through the swarm costs a round trip through every server of the route, while the blocks' compute of a
few more tokens in the same step costs little. A *draft* (`DraftSource`) proposes ``k`` tokens; the target model
(the swarm) scores ``[last token] + proposals`` in one inference step, which gives its distribution at every
proposed position; the proposals are kept up to the first one the target rejects, plus one token of the
target's own (the correction, or after ``k`` accepted ones a bonus); the rejected positions are cropped from
the session (the servers rewind). Exactness (`accept`):

- **greedy**: a proposal is kept when it is the target's argmax there: the tokens are plain greedy's;
- **sampling**: speculative sampling (Leviathan et al. 2023; Chen et al. 2023): proposal ``x`` drawn from the
  draft's ``q`` is kept with probability ``min(1, p(x) / q(x))``, where ``p`` is the target's sampling
  distribution (temperature, top-k, top-p applied); at the first rejection the token is drawn from
  ``normalize(max(p - q, 0))``. The output is distributed exactly as sampling from ``p``, whatever the draft.
  A deterministic draft (prompt lookup) has ``q`` = a point mass.

Draft sources: `PromptLookup` (the longest suffix n-gram found earlier in the context proposes what followed
it; no model) and `DraftModel` (a local causal LM sharing the target's tokenizer, with its own KV cache kept
across rounds and cropped to what was accepted). `SpeculationController` picks ``k`` from the acceptance rate
measured so far and the measured cost of drafting and of a step of each width, and turns speculation off while
it does not pay (checking again now and then).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

__all__ = ["DraftModel", "DraftSource", "Proposal", "PromptLookup", "SpeculationController", "Speculation",
           "accept", "refusal_for_family"]

logger = logging.getLogger(__name__)

Distribution = Callable[[torch.Tensor], torch.Tensor]
"""Logits ``[..., vocab]`` -> the sampling probabilities (temperature, top-k, top-p applied); None: greedy."""


@dataclass
class Proposal:
    """Draft tokens and, for a sampled draft, its probabilities ``q`` at each (``[k, vocab]``; None: point masses).

    ``seconds_per_token``: what one more proposed token cost the draft (a draft model's catching up with the
    context, e.g. a prompt it has not seen, is left out); None: the caller times the whole proposal.
    """

    tokens: list[int]
    probs: torch.Tensor | None = None
    seconds_per_token: float | None = None

    def first(self, k: int) -> Proposal:
        """The first ``k`` proposals."""
        return Proposal(self.tokens[:k], None if self.probs is None else self.probs[:k], self.seconds_per_token)

    def rest(self) -> Proposal:
        """All but the first proposal."""
        return Proposal(self.tokens[1:], None if self.probs is None else self.probs[1:], self.seconds_per_token)


class DraftSource(Protocol):
    """Proposes up to ``k`` tokens to follow ``ids`` (fewer, or none, when it has nothing to say).

    ``drafts_ahead``: whether drafting costs enough that it pays to draft the next round while the swarm
    scores this one (a draft model: yes; prompt lookup: no).
    """

    drafts_ahead: bool

    def propose(self, ids: Sequence[int], k: int, distribution: Distribution | None,
                generator: torch.Generator | None) -> Proposal:
        """Up to ``k`` tokens; with ``distribution`` (sampling) drawn from the draft's own, its ``probs`` too."""
        ...  # pragma: no cover

    def close(self) -> None:
        """Free what the source holds (a draft model's cache)."""
        ...  # pragma: no cover


class PromptLookup:
    """Proposes what followed the latest earlier occurrence of the context's last n-gram (n from ``max_ngram``
    down to ``min_ngram``): repeated names, code and quotes come back for free. transformers'
    ``prompt_lookup_num_tokens`` proposes the same way."""

    drafts_ahead = False

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, ids: Sequence[int], k: int, distribution: Distribution | None = None,
                generator: torch.Generator | None = None) -> Proposal:
        """The tokens after the latest earlier match of the longest suffix n-gram (empty if none)."""
        ids = list(ids)
        for n in range(min(self.max_ngram, len(ids) - 1), self.min_ngram - 1, -1):
            tail = ids[-n:]
            for start in range(len(ids) - n - 1, -1, -1):
                if ids[start:start + n] == tail:
                    follow = ids[start + n:start + n + k]
                    if follow:
                        return Proposal(follow)
        return Proposal([])

    def close(self) -> None:
        """Nothing to free."""


class DraftModel:
    """A local causal LM as the draft, with its own KV cache kept across rounds (cropped to what was accepted).

    ``model`` shares the target's tokenizer (e.g. the same weights quantized: ``distconf.tools.real_model``).
    """

    drafts_ahead = True

    def __init__(self, model: Any) -> None:
        from transformers import DynamicCache

        self.model = model
        self._cache_class = DynamicCache
        self.cache = DynamicCache()
        self.known: list[int] = []  # the tokens the cache holds, in order

    def propose(self, ids: Sequence[int], k: int, distribution: Distribution | None = None,
                generator: torch.Generator | None = None) -> Proposal:
        """``k`` tokens: the draft's argmax (greedy), or drawn from its own ``distribution`` (sampling)."""
        ids = list(ids)
        same = 0
        for a, b in zip(self.known, ids):
            if a != b:
                break
            same += 1
        same = min(same, len(ids) - 1)  # the last token is always fed: its logits propose the first token
        if same < len(self.known):
            self.cache.crop(same - len(self.known))
            del self.known[same:]
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        feed = ids[same:]
        started = None
        with torch.no_grad():
            for i in range(k):
                if i == 1:
                    started = time.perf_counter()  # after the catch-up feed: one token per step from here
                out = self.model(input_ids=torch.tensor([feed]), cache=self.cache, use_cache=True)
                self.known.extend(feed)
                logits = out.logits[0, -1].float()
                if distribution is None:
                    token = int(logits.argmax())
                else:
                    q = distribution(logits)
                    token = int(torch.multinomial(q, 1, generator=generator))
                    probs.append(q)
                tokens.append(token)
                feed = [token]
        per_token = (time.perf_counter() - started) / (k - 1) if started is not None else None
        return Proposal(tokens, torch.stack(probs) if probs else None, per_token)

    def close(self) -> None:
        """Drop the draft's cache."""
        self.cache = self._cache_class()
        self.known = []


def accept(proposal: Proposal, logits: torch.Tensor, distribution: Distribution | None,
           generator: torch.Generator | None) -> tuple[int, int, torch.Tensor]:
    """``(n_accepted, next_token, its logits)`` for proposals scored by the target's ``logits`` (``[k + 1, vocab]``:
    the target's logits after the last accepted token and after each proposal). See the module docstring."""
    tokens = proposal.tokens
    for i, token in enumerate(tokens):
        if distribution is None:
            choice = int(logits[i].argmax())
            if choice != token:
                return i, choice, logits[i]
            continue
        p = distribution(logits[i])
        q_token = 1.0 if proposal.probs is None else float(proposal.probs[i, token])
        if q_token > 0 and float(torch.rand((), generator=generator)) * q_token < float(p[token]):
            continue  # kept with probability min(1, p/q)
        if proposal.probs is None:
            residual = p.clone()
            residual[token] = 0
        else:
            residual = (p - proposal.probs[i]).clamp_min(0)
        if float(residual.sum()) <= 0:  # p == q: no mass left to correct with (cannot happen after a rejection)
            residual = p
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=generator)), logits[i]
    last = logits[len(tokens)]
    if distribution is None:
        return len(tokens), int(last.argmax()), last
    return len(tokens), int(torch.multinomial(distribution(last), 1, generator=generator)), last


@dataclass
class SpeculationController:
    """Picks how many tokens to propose, from what it measured; proposes none while speculation does not pay.

    Expected tokens of a round of ``k`` proposals at acceptance rate ``a``: ``(1 - a**(k+1)) / (1 - a)``; its
    cost: ``k`` drafted tokens plus a step of ``k + 1`` positions. The best ``k`` (up to ``max_tokens``) is taken
    when its tokens per second beat a plain step's by `margin`; otherwise rounds are plain, and after
    `probe_every` plain steps one speculative round measures again (a probe that keeps nothing doubles the
    wait, up to 16 times). A draft too slow to pay even if it were always right is not probed again (until
    the steps it has to beat get slower).
    """

    max_tokens: int = 8
    overlap: bool = False  # the draft drafts the next round while a step is scored: a round costs the longer one
    margin: float = 1.05
    probe_every: int = 16
    acceptance: float = 0.6  # a prior, moved by every round (exponential average)
    smoothing: float = 0.3
    draft_seconds: float | None = None  # per drafted token
    step_seconds: dict[int, float] = field(default_factory=dict)  # by width (positions in the step)
    _plain_since_probe: int = 0
    _probe_interval: int = 16
    _probing: bool = False
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0

    def worth_drafting_ahead(self, k: int) -> bool:
        """Whether drafting the next round during this one's step is likely to be used (all ``k`` kept)."""
        return self.overlap and min(self.acceptance, 0.99) ** k >= 0.25

    def next_k(self) -> int:
        """How many tokens to propose now (0: a plain step)."""
        if self.max_tokens <= 0:
            return 0
        plain = self.step_seconds.get(1)
        if plain is None:
            return 0  # measure a plain step first: what speculation has to beat
        if self.draft_seconds is None:
            return min(self.max_tokens, 2)  # then the draft, cheaply (it may be a bad one)
        best_k = self._best(min(self.acceptance, 0.99), plain)
        if best_k == 0:
            if self._best(0.99, plain) == 0:
                return 0  # this draft is too slow to pay even if every proposal were kept: no probes
            self._plain_since_probe += 1
            if self._plain_since_probe >= self._probe_interval:
                self._plain_since_probe = 0
                self._probing = True
                return 1
        return best_k

    def _best(self, a: float, plain: float) -> int:
        """The ``k`` whose rounds give the most tokens per second at acceptance ``a`` (0: plain steps are faster)."""
        assert self.draft_seconds is not None
        best_k, best_rate = 0, 1.0 / plain
        for k in range(1, self.max_tokens + 1):
            tokens = (1 - a ** (k + 1)) / (1 - a)
            drafting, step = k * self.draft_seconds, self._step(k + 1, plain)
            # drafting ahead hides the next round's drafting behind this step when every proposal is kept
            seconds = drafting + step - (a ** k) * min(drafting, step) if self.overlap else drafting + step
            if tokens / seconds > best_rate * (self.margin if best_k == 0 else 1.0):
                best_k, best_rate = k, tokens / seconds
        return best_k

    def _step(self, width: int, plain: float) -> float:
        if width in self.step_seconds:
            return self.step_seconds[width]
        known = sorted(w for w in self.step_seconds if w > 1)
        if known:  # linear between a plain step and the widest one measured
            w = known[-1]
            return plain + (self.step_seconds[w] - plain) * (width - 1) / (w - 1)
        return plain * (1 + 0.05 * (width - 1))

    def record_step(self, width: int, seconds: float) -> None:
        """A step of ``width`` positions took ``seconds``."""
        old = self.step_seconds.get(width)
        self.step_seconds[width] = seconds if old is None else old + self.smoothing * (seconds - old)

    def record_round(self, proposed: int, accepted: int, draft_seconds: float | None) -> None:
        """A round proposed ``proposed`` tokens in ``draft_seconds`` (None: drafted ahead, during the step before)
        and ``accepted`` of them were kept. A probe that keeps nothing doubles the wait before the next one."""
        if proposed <= 0:
            return
        self.rounds += 1
        self.proposed += proposed
        self.accepted += accepted
        if self._probing:
            self._probing = False
            longer = min(2 * self._probe_interval, 16 * self.probe_every)
            self._probe_interval = self.probe_every if accepted else longer
        if draft_seconds is not None:
            per_token = draft_seconds / proposed
            self.draft_seconds = per_token if self.draft_seconds is None else (
                self.draft_seconds + self.smoothing * (per_token - self.draft_seconds))
        # acceptance per proposal, from the accepted prefix: a run of n then a reject is n / (n + 1) successes
        rate = accepted / (accepted + (1 if accepted < proposed else 0)) if proposed else 0.0
        self.acceptance += self.smoothing * (rate - self.acceptance)

    def __post_init__(self) -> None:
        self._probe_interval = self.probe_every

    @property
    def mean_accepted(self) -> float:
        """Mean proposals kept per speculative round so far."""
        return self.accepted / self.rounds if self.rounds else 0.0


@dataclass
class Speculation:
    """What a generation speculates with: a draft source and its controller (see the module docstring)."""

    source: Any
    controller: SpeculationController = field(default_factory=SpeculationController)

    def timed_proposal(self, ids: Sequence[int], k: int, distribution: Distribution | None,
                       generator: torch.Generator | None) -> tuple[Proposal, float]:
        """The source's proposal and the seconds it took."""
        start = time.perf_counter()
        proposal = self.source.propose(ids, k, distribution, generator)
        seconds = time.perf_counter() - start
        if len(proposal.tokens) > k:
            proposal = Proposal(proposal.tokens[:k], None if proposal.probs is None else proposal.probs[:k],
                                proposal.seconds_per_token)
        if proposal.seconds_per_token is not None:
            seconds = proposal.seconds_per_token * len(proposal.tokens)
        return proposal, seconds


def refusal_for_family(config: Any) -> str | None:
    """Why speculative decoding cannot run on ``config``'s model (None: it can).

    Rejected proposals are cropped from the servers' caches; a recurrent state holds every earlier token folded
    together and cannot be cut back.
    """
    from distconf.blocks.layer_types import keeps_state_at
    from distconf.loader.naming import config_num_blocks

    if any(keeps_state_at(config, i) for i in range(config_num_blocks(config))):
        return (f"speculative decoding rolls rejected tokens back on the servers, but {type(config).__name__}'s "
                "blocks keep a recurrent state, which cannot be cut back to an earlier position")
    return None
