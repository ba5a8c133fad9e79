"""Petals' --compression: a server announces the compression of its hidden states, clients send with it.

Two tiny llama servers with ``--compression FLOAT16``: ``rpc_info`` says FLOAT16 (Petals 2.x clients read
it there), the client's forward pass differs from the uncompressed local model by float16 rounding only
(not zero: the wire did carry float16), in forward passes and in inference steps. (Greedy tokens of a
random tiny model can flip on such rounding; the real model's answer over compressed links is measured
by ``benchmarks/bench_wan.py``.)
"""

from __future__ import annotations

import pytest
import torch
from client_swarm import prompts, server_info
from swarm_harness import Swarm

from distconf.rpc.protocol import COMPRESSIONS

pytestmark = pytest.mark.swarm


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    with Swarm(tmp_path_factory.mktemp("compression"), "llama", ("0:2", "2:4"), ("--compression", "float16")) as s:
        yield s.model(), s.local, s.servers


def test_servers_announce_their_compression_in_rpc_info(swarm):
    model, _, servers = swarm
    for server in servers:
        block = f"{model.config.dht_prefix}.{server.span[0]}"
        info = model.remote.swarm.run(_info(model, server.peer_id, block), timeout=15)
        assert info["inference_schema"][0][0].compression == COMPRESSIONS["FLOAT16"]
        assert info["outputs_schema"][0].compression == COMPRESSIONS["FLOAT16"]
    assert "inference_schema" not in server_info(model, servers[0].peer_id)  # no block asked: no schema


async def _info(model, peer, uid):
    from distconf.rpc.calls import call_info

    return await call_info(model.remote.swarm.p2p, peer, uid, timeout=10.0)


def test_forward_through_float16_wire_is_the_local_model_within_float16_rounding(swarm):
    model, local, _ = swarm
    ids = prompts(2, 6, vocab=local.config.vocab_size, seed=3)
    with torch.no_grad():
        ours, theirs = model(ids).logits, local(ids).logits
    difference = (ours - theirs).abs().max().item()
    assert 0 < difference < 0.05, difference  # not 0: float16 crossed the wire


def test_inference_steps_through_float16_wire_match_the_local_model_within_rounding(swarm):
    model, local, _ = swarm
    ids = prompts(2, 5, vocab=local.config.vocab_size, seed=0)
    kwargs = {"max_new_tokens": 3, "do_sample": False, "pad_token_id": 0, "output_scores": True,
              "return_dict_in_generate": True}
    with torch.no_grad():
        ours = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        theirs = local.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    first = (ours.scores[0] - theirs.scores[0]).abs().max().item()  # the prefill step: same inputs on both sides
    assert 0 < first < 0.05, first
