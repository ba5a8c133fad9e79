"""A state-space family (per-sequence recurrent state, no K/V) through real ``distconf serve`` processes.

One module-scoped swarm of a tiny float32 model of the built-in state-space family (4
blocks): server A holds blocks 0:2, servers B and C hold 2:4. Greedy and beam-search
generation equal the local transformers model's; the servers' cache budget is back to full
after the sessions end; a server killed mid-generation is replaced (the client replays the
history to a fresh server, which rebuilds the state) and the tokens stay the same.
"""

from __future__ import annotations

import pytest
from span_swarm import SPANS, assert_failover_keeps_the_tokens, assert_generation_equals_local
from swarm_harness import Swarm, swarm_fixture

pytestmark = pytest.mark.swarm

FAMILY = "mamba2"


swarm = swarm_fixture("state-swarm", FAMILY, SPANS)


def test_greedy_and_beam_search_equal_the_local_model(swarm: Swarm) -> None:
    assert_generation_equals_local(swarm.model(), swarm.local, swarm.servers)


def test_failover_mid_generation_rebuilds_the_state(swarm: Swarm) -> None:
    assert_failover_keeps_the_tokens(swarm)
