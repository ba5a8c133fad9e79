"""A hybrid family (Mamba-2 layers keeping a state, attention layers keeping K/V) through real servers.

One module-scoped swarm of a tiny float32 model of the built-in hybrid family (4 blocks of
layer types linear_attention, full_attention, linear_attention, full_attention): server A holds
blocks 0:2, servers B and C hold 2:4, so every server's span has both layer kinds. Greedy and
beam-search generation equal the local transformers model's; the servers' cache budget is back
to full after the sessions end; a server killed mid-generation is replaced (the client replays
the history, the fresh server rebuilds state and K/V) and the tokens stay the same; a rewind to
a position other than 0 or the current one is refused with the precise message.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from client_swarm import close_swarm, prompts
from span_swarm import SpanSwarm, cache_left, generate

pytestmark = pytest.mark.swarm

FAMILY = "granitemoehybrid"
LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "full_attention"]


class Swarm(SpanSwarm):
    """The swarm of this module's family."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, FAMILY, layers=4, layer_types=LAYER_TYPES)


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Any:
    s = Swarm(tmp_path_factory.mktemp("hybrid-swarm"))
    try:
        yield s
    finally:
        close_swarm(s.models, s.servers, s.dht)


def test_every_span_has_both_layer_kinds(swarm: Swarm) -> None:
    from distconf.blocks.layer_types import keeps_kv_at, keeps_state_at
    from distconf.loader.auto import AutoDistributedConfig

    config = AutoDistributedConfig.from_pretrained(str(swarm.model_dir))
    for span in (range(0, 2), range(2, 4)):
        assert any(keeps_kv_at(config, i) for i in span) and any(keeps_state_at(config, i) for i in span)


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
    deadline = time.monotonic() + 30  # sessions end when the client closes them: state and K/V are freed
    while time.monotonic() < deadline and any(cache_left(model, p) != n for p, n in full.items()):
        time.sleep(0.2)
    assert {p: cache_left(model, p) for p in full} == full


def test_rewind_inside_a_hybrid_span_is_refused(swarm: Swarm) -> None:
    from hivemind.p2p import P2PHandlerError

    from distconf.rpc import InferenceStream, chain_uid, inference_step_request
    from distconf.rpc.protocol import KEY_START_FROM_POSITION

    model = swarm.model()
    rpc = model.remote.swarm
    peer = swarm.servers[0].peer_id
    uid = chain_uid(model.config.dht_prefix, 0, 2)
    hidden = torch.randn(1, 4, swarm.local.config.hidden_size)

    async def run() -> str:
        stream = await InferenceStream.open(rpc.p2p, peer, timeout=10)
        try:
            first = {"step_id": str(uuid.uuid4()), "max_length": 16, "session_id": str(uuid.uuid4())}
            await stream.step(inference_step_request(uid, hidden, None, None, first), timeout=20)
            rewind = {"step_id": str(uuid.uuid4()), KEY_START_FROM_POSITION: 2}
            await stream.step(inference_step_request(uid, hidden[:, :1], None, None, rewind), timeout=20)
        except P2PHandlerError as exc:
            return str(exc)
        finally:
            await stream.close(timeout=2)
        return "no error"

    message = rpc.run(run(), timeout=60.0)
    assert ("start_from_position=2 is refused: the blocks keep a recurrent state per sequence, which cannot be "
            "cut back from position 4 (only to 0 or 4); replay the tokens from 0 instead") in message


def test_failover_mid_generation_rebuilds_state_and_kv(swarm: Swarm) -> None:
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
