"""Text generation one token at a time through an inference session: the core of the API, chat and generate.

`stream_text(model, tokenizer, input_ids, sampling)` opens one inference session (a
`distconf.client.cache.RemoteCache` of the model, sized ``len(input_ids) + max_tokens``),
runs the prompt, then one token per step, and yields a `Piece` per new token. The text of
each piece is decoded incrementally: a token that ends inside a UTF-8 character gives no
text until the character is complete, and text that may be the start of a stop string is
held back until it is known not to be, so the joined pieces are exactly the text up to the
first stop string. Greedy decoding (``temperature=0``) picks the argmax of the same logits
the local transformers model computes, so it gives that model's greedy tokens.

The stream is synchronous; `TextStream.close` may be called from another thread (a web
server whose client went away): it never blocks, and the session on the servers ends at
once, or right after the step in flight. With spot checks on (``verify_fraction``), a
token is given out only once a check covered the result it came from (`TextStream._tokens`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from distconf.client.speculative import Proposal, Speculation, accept, refusal_for_family
from distconf.client.text_pieces import IncrementalDecoder, Piece, chat_input_ids, eos_token_ids, held_back
from distconf.client.verifier import VerificationError, VerificationRollback
from distconf.loader.positions import max_positions

__all__ = ["Sampling", "Piece", "TextStream", "IncrementalDecoder", "chat_input_ids", "eos_token_ids",
           "stream_text"]

logger = logging.getLogger(__name__)
_MAX_ROLLBACKS = 8  # servers caught in one generation before it gives up


@dataclass(frozen=True)
class Sampling:
    """How to pick tokens.

    :param max_tokens: most new tokens (the stream ends with ``finish_reason="length"``).
    :param temperature: 0 is greedy; otherwise logits are divided by it before sampling.
    :param top_p: sample within the smallest set of tokens whose probability reaches ``top_p``.
    :param seed: seed of this stream's own random generator (same seed, same tokens).
    :param stop: strings that end the text (not included in it; ``finish_reason="stop"``).
    :param top_logprobs: how many most likely alternatives each `Piece` lists (0: none).
    :param top_k: sample among the ``top_k`` most likely tokens only (None: all).
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    top_logprobs: int = 0
    top_k: int | None = None

    def __post_init__(self) -> None:
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if self.top_logprobs < 0:
            raise ValueError(f"top_logprobs must be >= 0, got {self.top_logprobs}")


class TextStream:
    """The new tokens of one generation, as `Piece` objects (iterate once).

    After the iteration: ``finish_reason`` is ``"stop"`` (end of sequence or a stop string),
    ``"length"`` (``max_tokens`` reached) or None (closed early); ``prompt_tokens`` and
    ``completion_tokens`` count the prompt and the tokens generated. ``text`` is the text
    given out so far.
    """

    def __init__(self, model: Any, tokenizer: Any, input_ids: list[int], sampling: Sampling,
                 speculation: Speculation | None = None, adapter: str | None = None) -> None:
        if not input_ids:
            raise ValueError("the prompt is empty")
        limit = max_positions(model.config)
        if limit is not None and len(input_ids) + sampling.max_tokens > limit:
            raise ValueError(f"{len(input_ids)} prompt tokens + max_tokens {sampling.max_tokens} exceed the "
                             f"model's {limit} positions")
        if speculation is not None:
            refusal = refusal_for_family(model.config)
            if refusal is not None:
                raise ValueError(refusal)
        self.model, self.tokenizer, self.sampling = model, tokenizer, sampling
        self.speculation = speculation
        if speculation is not None:
            speculation.controller.overlap = speculation.source.drafts_ahead
        self._ahead: tuple[list[int], Proposal] | None = None  # proposals drafted ahead, after which context
        self._worker: ThreadPoolExecutor | None = None  # scores while a draft model drafts ahead
        self.input_ids = [int(i) for i in input_ids]
        self.prompt_tokens = len(self.input_ids)
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.text = ""
        self._eos = eos_token_ids(model, tokenizer)
        session_of = {"adapter": adapter} if adapter else {}  # a model without adapters takes no such argument
        self._cache = model.inference_session(max_length=self.prompt_tokens + sampling.max_tokens, **session_of)
        self._lock = threading.Lock()  # held while a step runs
        self._closed = False
        self._generator: torch.Generator | None = None
        if sampling.temperature > 0:
            self._generator = torch.Generator()
            self._generator.manual_seed(sampling.seed if sampling.seed is not None else torch.seed())
        self._iter = self._run()

    def __iter__(self) -> Iterator[Piece]:
        return self._iter

    def __next__(self) -> Piece:
        return next(self._iter)

    def close(self) -> None:
        """End the inference session now (or right after the step in flight); safe from any thread."""
        self._closed = True
        if self._worker is not None:
            self._worker.shutdown(wait=False)
        if self._lock.acquire(blocking=False):
            try:
                self._cache.close()
            finally:
                self._lock.release()

    def __enter__(self) -> TextStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ generation
    def _logits(self, ids: list[int], last: int = 1) -> torch.Tensor | None:
        """Logits (float32, ``[last, vocab]``) at the last ``last`` positions after feeding ``ids``; None once
        closed."""
        with self._lock:
            if self._closed:
                self._cache.close()
                return None
            with torch.no_grad():
                out = self.model(input_ids=torch.tensor([ids]), cache=self._cache, use_cache=True)
            if self._closed:
                self._cache.close()
            return out.logits[0, -last:].float()

    def _crop(self, tokens: int) -> None:
        """Forget the last ``tokens`` positions of the session (rejected proposals)."""
        with self._lock:
            if not self._closed and tokens:
                self._cache.crop(-tokens)

    def _verify(self) -> bool:
        """Check the whole session now (may raise `VerificationRollback`); False once closed."""
        with self._lock:
            if self._closed:
                return False
            self._cache.verify()
            return True

    def _distribution(self, logits: torch.Tensor) -> torch.Tensor:
        """The probabilities tokens are drawn from (``[vocab]``): temperature, then top-k, then top-p."""
        s = self.sampling
        if s.top_k is not None and s.top_k < logits.shape[-1]:
            logits = logits.masked_fill(logits < logits.topk(s.top_k).values[-1], float("-inf"))
        probs = torch.softmax(logits / s.temperature, dim=-1)
        if s.top_p < 1:
            sorted_probs, order = probs.sort(descending=True)
            keep = sorted_probs.cumsum(0) - sorted_probs < s.top_p  # always keeps the most likely token
            probs = torch.zeros_like(probs).scatter(0, order, sorted_probs * keep)
            probs = probs / probs.sum()
        return probs

    def _pick(self, logits: torch.Tensor) -> int:
        if self.sampling.temperature == 0:
            return int(logits.argmax())
        return int(torch.multinomial(self._distribution(logits), 1, generator=self._generator))

    def _advance(self, ids: list[int], fed: int) -> tuple[list[tuple[int, torch.Tensor]], int] | None:
        """One step: the new tokens (with the logits each was chosen from) and the positions the session now
        holds; None once closed. Plain: one token. Speculative: the draft's accepted proposals and one more.

        A draft model drafts ahead while the swarm scores its proposals (`_score`): it guesses the swarm's next
        token (its own) and proposes the tokens after it; when every proposal is kept and the guess is right,
        the next round's proposals are ready and their drafting cost nothing.
        """
        spec = self.speculation
        room = self.sampling.max_tokens - (len(ids) - self.prompt_tokens) - 1  # tokens left after the next one
        k = min(spec.controller.next_k(), room) if spec is not None else 0
        distribution = None if self.sampling.temperature == 0 else self._distribution
        proposal = None
        if k > 0:
            assert spec is not None
            draft_seconds: float | None
            if self._ahead is not None and self._ahead[0] == ids:
                proposal, draft_seconds = self._ahead[1].first(k), None  # drafted during the last step
            else:
                proposal, draft_seconds = spec.timed_proposal(ids, k, distribution, self._generator)
        self._ahead = None
        decode = len(ids) - fed == 1  # a decode step (not a prefill): its time teaches the controller
        start = time.perf_counter()
        if proposal is None or not proposal.tokens:
            logits = self._logits(ids[fed:])
            if logits is None:
                return None
            if spec is not None and decode:
                spec.controller.record_step(1, time.perf_counter() - start)
            return [(self._pick(logits[-1]), logits[-1])], len(ids)
        assert spec is not None
        width = len(proposal.tokens) + 1
        logits, seconds, ahead = self._score(ids, fed, proposal, k, distribution)
        if logits is None:
            return None
        if decode:
            spec.controller.record_step(width, seconds)
        n, token, token_logits = accept(proposal, logits, distribution, self._generator)
        spec.controller.record_round(len(proposal.tokens), n, draft_seconds)
        self._crop(len(proposal.tokens) - n)
        if ahead is not None and n == len(proposal.tokens) and ahead.tokens and ahead.tokens[0] == token:
            self._ahead = ([*ids, *proposal.tokens, token], ahead.rest())
        new = [(proposal.tokens[i], logits[i]) for i in range(n)] + [(token, token_logits)]
        return new, len(ids) + n

    def _score(self, ids: list[int], fed: int, proposal: Proposal, k: int, distribution: Any
               ) -> tuple[torch.Tensor | None, float, Proposal | None]:
        """The swarm's logits of ``proposal``, the seconds that step took and, with a draft model likely to be
        right, what it drafted meanwhile (its guess of the swarm's next token, then ``k`` more)."""
        assert self.speculation is not None
        feed, width = ids[fed:] + proposal.tokens, len(proposal.tokens) + 1

        def scored() -> tuple[torch.Tensor | None, float]:
            start = time.perf_counter()
            return self._logits(feed, last=width), time.perf_counter() - start

        if not self.speculation.controller.worth_drafting_ahead(len(proposal.tokens)):
            return (*scored(), None)
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="distconf-speculation")
        scoring = self._worker.submit(scored)
        ahead, _ = self.speculation.timed_proposal([*ids, *proposal.tokens], k + 1, distribution, self._generator)
        return (*scoring.result(), ahead)

    def _piece(self, text: str, token: int, logits: torch.Tensor) -> Piece:
        logprobs = torch.log_softmax(logits, dim=-1)
        top: tuple[tuple[int, float], ...] = ()
        if self.sampling.top_logprobs:
            values, ids = logprobs.topk(self.sampling.top_logprobs)
            top = tuple((int(i), float(v)) for i, v in zip(ids, values, strict=True))
        self.text += text
        return Piece(text, token, float(logprobs[token]), top)

    def _tokens(self) -> Iterator[tuple[int, torch.Tensor]]:
        """The new tokens with their logits, each given out once a spot check covered it.

        Without spot checks a token is given out at once. With them (``verify_fraction``), the
        tokens after the last check wait, the end of the generation is checked before the last
        ones go, and when a check catches a server the session goes back to the first wrong
        position: the tokens chosen from wrong results are dropped (never given out) and
        generated again without that server.
        """
        ids = list(self.input_ids)
        fed = 0  # tokens the session holds
        ahead: list[tuple[int, torch.Tensor]] = []  # generated, not given out: the last len(ahead) of ids
        finished = False
        rollbacks = 0
        while True:
            try:
                if not finished:
                    step = self._advance(ids, fed)
                    if step is None:
                        return
                    new, fed = step
                    for token, logits in new:
                        ids.append(token)
                        ahead.append((token, logits))
                        finished = token in self._eos or len(ids) - self.prompt_tokens >= self.sampling.max_tokens
                        if finished:
                            break
                    if len(ids) < fed:  # stopped inside the accepted proposals: the session holds no more
                        self._crop(fed - len(ids))
                        fed = len(ids)
                verified = getattr(self._cache, "verified", None)
                if finished and verified is not None and verified < fed:
                    if not self._verify():
                        return
                    verified = fed
            except VerificationRollback as rollback:
                rollbacks += 1
                if rollbacks > _MAX_ROLLBACKS:
                    raise VerificationError(f"servers were caught {rollbacks} times in one generation") from rollback
                keep = max(rollback.position + 1, self.prompt_tokens)
                dropped = len(ids) - keep
                del ids[keep:]
                del ahead[len(ahead) - min(dropped, len(ahead)):]
                fed, finished = rollback.position, False
                continue
            safe = len(ids) if verified is None else verified + 1  # a token is safe once the result it came from is
            while ahead and len(ids) - len(ahead) < safe:
                yield ahead.pop(0)
            if finished and not ahead:
                return

    def _run(self) -> Iterator[Piece]:
        decoder = IncrementalDecoder(self.tokenizer)
        stops = self.sampling.stop
        pending = ""  # decoded text not given out yet (may begin a stop string)
        try:
            for token, logits in self._tokens():
                self.completion_tokens += 1
                if token in self._eos:
                    self.finish_reason = "stop"
                    tail = pending + decoder.flush()
                    if tail:
                        yield self._piece(tail, token, logits)
                    return
                pending += decoder.add(token)
                cut = min((i for i in (pending.find(s) for s in stops) if i >= 0), default=-1)
                if cut >= 0:
                    self.finish_reason = "stop"
                    yield self._piece(pending[:cut], token, logits)
                    return
                last = self.completion_tokens >= self.sampling.max_tokens
                if last:
                    pending += decoder.flush()
                    out, pending = pending, ""
                else:
                    keep = held_back(pending, stops)
                    out, pending = pending[:len(pending) - keep], pending[len(pending) - keep:]
                yield self._piece(out, token, logits)
                if last:
                    self.finish_reason = "length"
                    return
        finally:
            self.close()


def stream_text(model: Any, tokenizer: Any, input_ids: list[int], sampling: Sampling,
                speculation: Speculation | None = None, adapter: str | None = None) -> TextStream:
    """Generate from ``input_ids`` through one new inference session of ``model`` (see `TextStream`).

    :param model: a distributed causal LM (`distconf.client.AutoDistributedModelForCausalLM`); any
        model with ``inference_session(max_length)`` returning a cache its forward accepts.
    :param tokenizer: the model's tokenizer (decodes the pieces); None: pieces have ids and no text.
    :param input_ids: the prompt's token ids (e.g. `chat_input_ids`).
    :param sampling: how tokens are picked and when the stream ends.
    :param speculation: a draft and its controller (`distconf.client.speculative`): several tokens per step,
        the same tokens (greedy) or the same distribution (sampling) as without.
    :param adapter: the LoRA adapter the servers apply (`distconf.blocks.lora`; None: the model's
        ``active_adapter``); only servers serving it are used.
    """
    return TextStream(model, tokenizer, input_ids, sampling, speculation, adapter)
