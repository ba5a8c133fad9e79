"""A server that says it no longer serves the blocks asked for is re-read once before it is banned."""

from __future__ import annotations

import math
from types import SimpleNamespace

import distconf
from distconf.client.sequence_manager import SequenceManager
from distconf.rpc.protocol import NOT_SERVED


def _manager() -> SequenceManager:
    config = distconf.load_family("llama")(num_hidden_layers=4, dht_prefix="tiny-hf", ban_timeout=30)
    return SequenceManager(config, SimpleNamespace(num_blocks=4, dht_prefix="tiny-hf"))


def test_first_not_served_refreshes_the_swarm_instead_of_banning() -> None:
    manager = _manager()
    manager.last_update = 123.0
    manager.on_failure("peerA", RuntimeError(f"{NOT_SERVED} tiny-hf.2"))
    assert "peerA" not in manager.banned()
    assert manager.last_update == -math.inf  # the next route re-reads the swarm


def test_a_second_not_served_within_the_ban_timeout_bans() -> None:
    manager = _manager()
    manager.on_failure("peerA", RuntimeError(f"{NOT_SERVED} tiny-hf.2"))
    manager.on_failure("peerA", RuntimeError(f"{NOT_SERVED} tiny-hf.2"))
    assert manager.banned() == {"peerA"}


def test_other_failures_ban_at_once() -> None:
    manager = _manager()
    manager.on_failure("peerB", TimeoutError("no reply"))
    assert manager.banned() == {"peerB"}
