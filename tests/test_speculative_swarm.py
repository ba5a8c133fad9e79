"""Speculative decoding through the swarm: transformers' assisted generation gives plain greedy generation's tokens.

Two tiny llama servers (0:2, 2:4). transformers checks several proposed tokens in one step and crops the rejected
ones from the cache (`RemoteCache.crop`: the servers rewind); with ``prompt_lookup_num_tokens`` (n-gram matches
in the context) and with ``assistant_model`` (a local draft model keeping its own cache), the tokens equal plain
greedy generation's, through the swarm and locally.
"""

from __future__ import annotations

import pytest
import torch
from client_swarm import close_swarm, make_model_dir, start_servers

pytestmark = pytest.mark.swarm

REPEATING = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]])  # n-gram matches for prompt lookup to propose


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    from distconf.client import AutoDistributedModelForCausalLM
    from distconf.dht import start_local_dht, visible_maddrs

    root = tmp_path_factory.mktemp("speculative")
    dht = start_local_dht()
    model_dir, local = make_model_dir(root / "llama", "llama", noise=0.05)
    servers = start_servers([(model_dir, "0:2"), (model_dir, "2:4")], visible_maddrs(dht), root)
    model = AutoDistributedModelForCausalLM.from_pretrained(model_dir, dht=dht, max_retries=3)
    try:
        yield model, local
    finally:
        close_swarm([model], servers, dht)


def generate(model, ids, **kwargs) -> list[int]:
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                             pad_token_id=0, **kwargs)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("ids", [REPEATING, torch.tensor([[3, 17, 41, 2, 99, 23, 7, 64]])], ids=["repeating", "plain"])
def test_prompt_lookup_through_the_swarm_gives_plain_greedy_tokens(swarm, ids):
    model, local = swarm
    plain = generate(local, ids)
    assert generate(model, ids) == plain
    assert generate(model, ids, prompt_lookup_num_tokens=4) == plain


def test_a_local_draft_model_through_the_swarm_gives_plain_greedy_tokens(swarm):
    model, local = swarm
    assert generate(model, REPEATING, assistant_model=local) == generate(local, REPEATING)
