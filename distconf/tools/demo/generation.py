"""The demo's last step: greedy generation through the swarm, one server stopped mid-way, against the local model.

`swarm_generation` runs Hugging Face ``generate`` on the client model
(`distconf.client.AutoDistributedModelForCausalLM`) inside an inference session; after
`STOP_AFTER` tokens a logits processor stops one server of the session's route (one
whose blocks another server also holds) and waits until it is gone, so the next step
fails there and the client replaces it. `local_generation` runs the same prompt through
the local Hugging Face model loaded from the same checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["CLIENT_SETTINGS", "NEW_TOKENS", "PROMPT", "STOP_AFTER", "SwarmGeneration", "demo_prompt",
           "local_generation", "open_client", "replaceable_server", "swarm_generation"]

PROMPT = (1, 17, 42, 7, 99, 3)
"""Token ids of the demo prompt (taken modulo the vocabulary size)."""
NEW_TOKENS = 16
"""Tokens generated."""
STOP_AFTER = 4
"""A server of the route is stopped once this many tokens are generated."""
CLIENT_SETTINGS: dict[str, Any] = {
    "max_retries": 3, "min_backoff": 0.1, "max_backoff": 1.0,  # a few quick retries, every wait bounded
    "ban_timeout": 600.0,  # the stopped server stays banned for the rest of the demo
    "connect_timeout": 15.0, "request_timeout": 60.0,  # generous: the demo may run on a busy machine
}
"""ClientConfig fields the demo's client uses."""

Hop = tuple[str, int, int]
"""One hop of a route: (peer id, start block, end block exclusive)."""


@dataclass
class SwarmGeneration:
    """What happened in `swarm_generation`."""

    tokens: list[int] = field(default_factory=list)
    route_before: list[Hop] = field(default_factory=list)
    route_after: list[Hop] = field(default_factory=list)
    stopped: str | None = None
    failovers: int = 0


def demo_prompt(vocab_size: int) -> list[int]:
    """`PROMPT` for a vocabulary of ``vocab_size`` tokens."""
    return [t % vocab_size for t in PROMPT]


def open_client(model_dir: str | Path, initial_peers: Sequence[str]) -> Any:
    """The client model: the family's HF class with its blocks on the swarm reached via ``initial_peers``."""
    from distconf.client import AutoDistributedModelForCausalLM

    return AutoDistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=list(initial_peers),
                                                           dtype="float32", **CLIENT_SETTINGS)


def _greedy(model: Any, prompt: Sequence[int], new_tokens: int, **kwargs: Any) -> list[int]:
    import torch

    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0, eos_token_id=None, **kwargs)
    return out[0, len(prompt):].tolist()


def local_generation(model_dir: str | Path, prompt: Sequence[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    """Greedy new tokens of the local Hugging Face model of ``model_dir`` (float32, one process)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    finally:
        hf_logging.enable_progress_bar()
    model.eval()
    return _greedy(model, prompt, new_tokens)


def replaceable_server(route: Sequence[Hop], spans: Mapping[str, tuple[int, int]]) -> str | None:
    """The last server of ``route`` whose blocks the other servers of ``spans`` (peer -> span) all hold."""
    for peer, start, end in reversed(route):
        others = [span for other, span in spans.items() if other != peer]
        if all(any(s <= block < e for s, e in others) for block in range(start, end)):
            return peer
    return None


@contextlib.contextmanager
def _quiet(logger_name: str) -> Iterator[None]:
    """Keep a logger's retry warnings off the demo's output (the demo reports the failover itself)."""
    log = logging.getLogger(logger_name)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def swarm_generation(model: Any, prompt: Sequence[int], new_tokens: int = NEW_TOKENS, *,
                     stop_after: int = STOP_AFTER, choose: Callable[[list[Hop]], str | None] | None = None,
                     stop: Callable[[str], None] | None = None) -> SwarmGeneration:
    """Greedy generation through the swarm; after ``stop_after`` tokens, ``stop(choose(route))`` if both are given.

    ``stop`` must return only once the server is gone, so that the next step fails there.
    """
    from transformers import LogitsProcessor, LogitsProcessorList

    result = SwarmGeneration()

    def hops(cache: Any) -> list[Hop]:
        return [(s.peer_id, s.start, s.end) for s in cache.session.route]

    class StopOneServer(LogitsProcessor):
        """Called with the scores of each next token; stops a server once ``stop_after`` tokens exist."""

        def __call__(self, input_ids: Any, scores: Any) -> Any:
            if input_ids.shape[1] == len(prompt) + stop_after - 1 and not result.route_before:
                result.route_before = hops(cache)  # these scores choose token ``stop_after``
                victim = choose(result.route_before) if choose is not None and stop is not None else None
                if victim is not None and stop is not None:
                    stop(victim)
                    result.stopped = victim
            return scores

    with model.inference_session(len(prompt) + new_tokens) as cache, _quiet("distconf.client"):
        result.tokens = _greedy(model, prompt, new_tokens, cache=cache,
                                logits_processor=LogitsProcessorList([StopOneServer()]))
        result.route_after = hops(cache)
        result.failovers = cache.session.failovers
    return result
