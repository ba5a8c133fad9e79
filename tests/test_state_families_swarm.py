"""falcon_mamba, qwen3_next and lfm2 through real ``distconf serve`` processes: generation equals the local model.

Per family, a tiny float32 model of 4 blocks served by two servers (0:2 and 2:4; in the hybrids
each span has both layer kinds). Greedy and beam-search generation through the swarm equal the
local transformers model's, and the servers' cache budget is back to full after the sessions.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from client_swarm import close_swarm, make_model_dir, prompts, server_info, start_servers

pytestmark = pytest.mark.swarm

LAYER_TYPES = {
    "falcon_mamba": {},
    "qwen3_next": {"layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"]},
    "lfm2": {"layer_types": ["conv", "full_attention", "conv", "full_attention"]},
}


def _generate(model: Any, ids: torch.Tensor, **kwargs: Any) -> list[list[int]]:
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=0, **kwargs).tolist()


def _cache_left(model: Any, peer: str) -> int:
    from distconf.rpc.protocol import CACHE_TOKENS_AVAILABLE

    return int(server_info(model, peer)[CACHE_TOKENS_AVAILABLE])


@pytest.mark.parametrize("family", sorted(LAYER_TYPES))
def test_greedy_and_beam_search_equal_the_local_model(family: str, tmp_path: Path) -> None:
    from distconf.client import AutoDistributedModelForCausalLM
    from distconf.dht import start_local_dht, visible_maddrs

    dht = start_local_dht()
    models: list[Any] = []
    servers: list[Any] = []
    try:
        model_dir, local = make_model_dir(tmp_path / family, family, layers=4, **LAYER_TYPES[family])
        servers = start_servers([(model_dir, "0:2"), (model_dir, "2:4")], visible_maddrs(dht), tmp_path)
        model = AutoDistributedModelForCausalLM.from_pretrained(model_dir, dht=dht, max_retries=3)
        models.append(model)
        full = {s.peer_id: _cache_left(model, s.peer_id) for s in servers}
        ids = prompts(2, 5, vocab=local.config.vocab_size, seed=1)
        greedy = {"max_new_tokens": 8, "do_sample": False}
        assert _generate(model, ids, **greedy) == _generate(local, ids, **greedy)
        ids = prompts(1, 4, vocab=local.config.vocab_size, seed=7)
        beams = {"max_new_tokens": 6, "do_sample": False, "num_beams": 3}
        assert _generate(model, ids, **beams) == _generate(local, ids, **beams)
        deadline = time.monotonic() + 30  # sessions end when the client closes them: state and K/V are freed
        while time.monotonic() < deadline and any(_cache_left(model, p) != n for p, n in full.items()):
            time.sleep(0.2)
        assert {p: _cache_left(model, p) for p in full} == full
    finally:
        close_swarm(models, servers, dht)
