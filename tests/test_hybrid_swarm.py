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

import uuid

import pytest
import torch
from span_swarm import SPANS, assert_failover_keeps_the_tokens, assert_generation_equals_local
from swarm_harness import Swarm, swarm_fixture

pytestmark = pytest.mark.swarm

FAMILY = "granitemoehybrid"
LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "full_attention"]


swarm = swarm_fixture("hybrid-swarm", FAMILY, SPANS, layers=4, layer_types=LAYER_TYPES)


def test_every_span_has_both_layer_kinds(swarm: Swarm) -> None:
    from distconf.blocks.layer_types import keeps_kv_at, keeps_state_at
    from distconf.loader.auto import AutoDistributedConfig

    config = AutoDistributedConfig.from_pretrained(str(swarm.model_dir))
    for span in (range(0, 2), range(2, 4)):
        assert any(keeps_kv_at(config, i) for i in span) and any(keeps_state_at(config, i) for i in span)


def test_greedy_and_beam_search_equal_the_local_model(swarm: Swarm) -> None:
    assert_generation_equals_local(swarm.model(), swarm.local, swarm.servers)


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
    assert_failover_keeps_the_tokens(swarm)
