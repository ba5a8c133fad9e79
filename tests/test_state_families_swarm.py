"""falcon_mamba, qwen3_next and lfm2 through real ``distconf serve`` processes: generation equals the local model.

Per family, a tiny float32 model of 4 blocks served by two servers (0:2 and 2:4; in the hybrids
each span has both layer kinds). Greedy and beam-search generation through the swarm equal the
local transformers model's, and the servers' cache budget is back to full after the sessions.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from span_swarm import assert_generation_equals_local
from swarm_harness import Swarm

pytestmark = pytest.mark.swarm

LAYER_TYPES = {
    "falcon_mamba": {},
    "qwen3_next": {"layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"]},
    "lfm2": {"layer_types": ["conv", "full_attention", "conv", "full_attention"]},
}


@pytest.mark.parametrize("family", sorted(LAYER_TYPES))
def test_greedy_and_beam_search_equal_the_local_model(family: str, tmp_path: Path) -> None:
    with Swarm(tmp_path, family, ("0:2", "2:4"), layers=4, **LAYER_TYPES[family]) as swarm:
        assert_generation_equals_local(swarm.model(), swarm.local, swarm.servers, seeds=(1,))
