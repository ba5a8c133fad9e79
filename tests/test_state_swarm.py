"""A state-space family (per-sequence recurrent state, no K/V) through real ``distconf serve`` processes.

One module-scoped swarm of a tiny float32 model of the built-in state-space family (4
blocks): server A holds blocks 0:2, servers B and C hold 2:4. Greedy and beam-search
generation equal the local transformers model's; the servers' cache budget is back to full
after the sessions end; a server killed mid-generation is replaced (the client replays the
history to a fresh server, which rebuilds the state) and the tokens stay the same.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from client_swarm import close_swarm, prompts
from span_swarm import SpanSwarm, cache_left, generate

pytestmark = pytest.mark.swarm

FAMILY = "mamba2"


class Swarm(SpanSwarm):
    """The swarm of this module's family."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, FAMILY)


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Any:
    s = Swarm(tmp_path_factory.mktemp("state-swarm"))
    try:
        yield s
    finally:
        close_swarm(s.models, s.servers, s.dht)


def test_greedy_and_beam_search_equal_the_local_model(swarm: Swarm) -> None:
    model = swarm.model()
    vocab = swarm.local.config.vocab_size
    full = {s.peer_id: cache_left(model, s.peer_id) for s in swarm.servers}
    for seed in range(2):
        ids = prompts(2, 5, vocab=vocab, seed=seed)
        assert generate(model, ids, max_new_tokens=8, do_sample=False) == \
            swarm.expected(ids, max_new_tokens=8, do_sample=False)
    ids = prompts(1, 4, vocab=vocab, seed=7)
    beams = {"max_new_tokens": 6, "do_sample": False, "num_beams": 3}
    assert generate(model, ids, **beams) == swarm.expected(ids, **beams)
    deadline = time.monotonic() + 30  # sessions end when the client closes them: the state is freed
    while time.monotonic() < deadline and any(cache_left(model, p) != n for p, n in full.items()):
        time.sleep(0.2)
    assert {p: cache_left(model, p) for p in full} == full


def test_failover_mid_generation_rebuilds_the_state(swarm: Swarm) -> None:
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
