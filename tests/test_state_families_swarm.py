"""falcon_mamba, qwen3_next and lfm2 through real ``distconf serve`` processes: generation equals the local model.

Per family, a tiny float32 model of 4 blocks served by two servers (0:2 and 2:4; in the hybrids
each span has both layer kinds). Greedy and beam-search generation through the swarm equal the
local transformers model's, and the servers' cache budget is back to full after the sessions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from client_swarm import close_swarm, make_model_dir, start_servers
from span_swarm import assert_generation_equals_local

pytestmark = pytest.mark.swarm

LAYER_TYPES = {
    "falcon_mamba": {},
    "qwen3_next": {"layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"]},
    "lfm2": {"layer_types": ["conv", "full_attention", "conv", "full_attention"]},
}


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
        assert_generation_equals_local(model, local, servers, seeds=(1,))
    finally:
        close_swarm(models, servers, dht)
