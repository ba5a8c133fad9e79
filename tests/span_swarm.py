"""A three-server swarm of one tiny family (server A holds blocks 0:2, servers B and C hold 2:4), for the
swarm tests of families whose blocks keep a per-sequence state (pure state-space and hybrid)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from client_swarm import server_info
from dhthelpers import wait_for
from swarm_harness import Swarm, generate

SPANS = ("0:2", "2:4", "2:4")


class SpanSwarm(Swarm):
    """The harness's swarm of ``family`` (tiny, ``overrides`` to its config) with servers of 0:2, 2:4 and 2:4."""

    def __init__(self, root: Path, family: str, **overrides: Any) -> None:
        super().__init__(root, family, SPANS, **overrides)


def cache_left(model: Any, peer: str) -> int:
    """The cache tokens a server says it has left."""
    from distconf.rpc.protocol import CACHE_TOKENS_AVAILABLE

    return int(server_info(model, peer)[CACHE_TOKENS_AVAILABLE])


def assert_generation_equals_local(model: Any, local: Any, servers: list[Any], seeds: tuple[int, ...] = (0, 1)) -> None:
    """Greedy (2 rows of 5 tokens, per seed) and beam search (3 beams) through the swarm equal ``local``'s,
    and every server's cache budget is back to full once the sessions end."""
    from client_swarm import prompts

    vocab = local.config.vocab_size
    full = {s.peer_id: cache_left(model, s.peer_id) for s in servers}
    greedy = {"max_new_tokens": 8, "do_sample": False}
    for seed in seeds:
        ids = prompts(2, 5, vocab=vocab, seed=seed)
        assert generate(model, ids, **greedy) == generate(local, ids, **greedy)
    ids = prompts(1, 4, vocab=vocab, seed=7)
    beams = {"max_new_tokens": 6, "do_sample": False, "num_beams": 3}
    assert generate(model, ids, **beams) == generate(local, ids, **beams)
    # sessions end when the client closes them: state and K/V are freed
    wait_for(lambda: all(cache_left(model, p) == n for p, n in full.items()), timeout=30, interval=0.1)
    assert {p: cache_left(model, p) for p in full} == full


def assert_failover_keeps_the_tokens(swarm: SpanSwarm) -> None:
    """The server of the last span is killed 5 tokens into a generation: the client replays the history
    to a replacement (rebuilding its state and K/V) and the tokens equal the local model's."""
    from client_swarm import prompts
    from transformers import LogitsProcessor, LogitsProcessorList

    ids = prompts(2, 5, vocab=swarm.local.config.vocab_size, seed=11)
    expected = swarm.expected(ids, max_new_tokens=12, do_sample=False)
    model = swarm.model(ban_timeout=600.0, min_backoff=0.05)
    by_peer = {s.peer_id: s for s in swarm.servers}
    killed: list[str] = []

    class KillAfterFiveTokens(LogitsProcessor):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            if input_ids.shape[1] == ids.shape[1] + 5 and not killed:
                victim = cache.session.sessions[-1].peer_id
                by_peer[victim].kill()
                killed.append(victim)
            return scores

    with model.inference_session(32) as cache:
        out = generate(model, ids, max_new_tokens=12, do_sample=False, cache=cache,
                       logits_processor=LogitsProcessorList([KillAfterFiveTokens()]))
        assert killed and cache.session.failovers == 1
    assert out == expected
