"""The client against real ``distconf serve`` processes: every ClientConfig field, push, failover.

One module-scoped swarm of a tiny llama model (4 blocks): server A holds blocks 0:2,
servers B and C both hold 2:4. Some tests add DHT records of peers that cannot serve
(a DHT node without block handlers, or a peer that is gone) to see the client route
around them. The failover test kills a server and runs last.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

import forkserver
import pytest
import swarm_harness
import torch
from client_swarm import prompts, server_info
from dhthelpers import wait_for
from hivemind.p2p import P2PHandlerError
from swarm_harness import dht_node, generate, swarm_fixture

from distconf.client.sequence_manager import RetriesExhausted
from distconf.dht import NoRouteError

FAST = {"max_retries": 0, "min_backoff": 0.01, "max_backoff": 0.02}


class Swarm(swarm_harness.Swarm):
    """The harness's swarm of a tiny llama (A: 0:2, B and C: 2:4), its config, a gone peer and DHT records."""

    def __init__(self, root: Path, *args: Any, **kwargs: Any) -> None:
        super().__init__(root, *args, **kwargs)
        self.a, self.b, self.c = (s.peer_id for s in self.servers)
        self.dead_peer = self._gone_peer()
        self.last_expiration = 0.0

    def _gone_peer(self) -> str:
        with dht_node(self.peers) as node:
            return node.peer_id.to_base58()

    def store(self, peer: str, start: int, end: int, state: int = 2, throughput: float = 1e6) -> None:
        """Store a server record for ``peer`` on blocks ``start..end-1`` (newer records win)."""
        from hivemind.utils import get_dht_time

        from distconf.dht import ServerInfo

        info = ServerInfo(state=state, throughput=throughput, start_block=start, end_block=end)
        expiration = self.last_expiration = max(get_dht_time() + 600, self.last_expiration + 1)  # newest wins
        for i in range(start, end):
            assert self.dht.store(f"{self.config.dht_prefix}.{i}", info.to_wire(), expiration, subkey=peer)


swarm = swarm_fixture("client-swarm", cls=Swarm)


def session_peers(model: Any, ids: torch.Tensor, **kwargs: Any) -> list[str]:
    """Peers of the route an inference session takes (after a one-token generation)."""
    with model.inference_session(16) as cache:
        generate(model, ids, max_new_tokens=1, cache=cache, **kwargs)
        return [s.peer_id for s in cache.session.sessions]


# ------------------------------------------------------------------ connection fields


def test_initial_peers_and_startup_timeout(swarm: Swarm) -> None:
    ids = prompts()
    model = swarm.model(initial_peers=swarm.peers, daemon_startup_timeout=60.0)
    assert model.remote.swarm.dht is not swarm.dht  # its own client-mode node, joined through initial_peers
    assert generate(model, ids, max_new_tokens=4, do_sample=False) == swarm.expected(ids, max_new_tokens=4)
    with pytest.raises(ValueError, match="initial_peers is empty"):
        swarm.model(initial_peers=[])
    with pytest.raises(TimeoutError):
        swarm.model(initial_peers=swarm.peers, daemon_startup_timeout=0.001)


def test_dht_prefix_names_the_blocks(swarm: Swarm) -> None:
    model = swarm.model(dht_prefix="no-such-model", **FAST)
    with pytest.raises(RetriesExhausted, match="no-such-model") as failure:
        model(prompts())
    assert isinstance(failure.value.__cause__, NoRouteError)


def test_connect_and_request_timeouts(swarm: Swarm) -> None:
    ids = prompts()
    with pytest.raises(RetriesExhausted) as failure:
        generate(swarm.model(connect_timeout=1e-6, **FAST), ids, max_new_tokens=1)
    assert isinstance(failure.value.__cause__, TimeoutError)
    with pytest.raises(RetriesExhausted, match=r"TimeoutError|timed out"):
        swarm.model(request_timeout=1e-6, **FAST)(ids)
    ok = swarm.model(connect_timeout=5.0, request_timeout=30.0, **FAST)
    assert generate(ok, ids, max_new_tokens=2) == swarm.expected(ids, max_new_tokens=2)


def test_allowed_and_blocked_servers(swarm: Swarm) -> None:
    ids = prompts()
    assert session_peers(swarm.model(allowed_servers=[swarm.a, swarm.b]), ids) == [swarm.a, swarm.b]
    assert session_peers(swarm.model(allowed_servers=[swarm.a, swarm.c]), ids) == [swarm.a, swarm.c]
    assert session_peers(swarm.model(blocked_servers=[swarm.b]), ids) == [swarm.a, swarm.c]
    assert session_peers(swarm.model(blocked_servers=[swarm.c]), ids) == [swarm.a, swarm.b]


def test_show_route(swarm: Swarm, caplog: pytest.LogCaptureFixture) -> None:
    ids = prompts()
    caplog.set_level(logging.INFO, logger="distconf.client.sequence_manager")
    for show, forward_logged, inference_logged in ((True, True, True), (False, False, False),
                                                   ("inference", False, True)):
        model = swarm.model(show_route=show)
        caplog.clear()
        with torch.no_grad():
            model(ids)
        assert ("Route found" in caplog.text) == forward_logged, show
        caplog.clear()
        generate(model, ids, max_new_tokens=1)
        assert ("Route found" in caplog.text) == inference_logged, show


def test_an_active_adapter_no_server_serves_is_no_route_naming_it(swarm: Swarm) -> None:
    """Routes use only servers announcing the adapter (a server asked for one it lacks refuses the request:
    test_server_swarm's "unknown adapter" cases); the base model is served as before."""
    from distconf.dht import NoRouteError

    ids = prompts()
    with pytest.raises(RetriesExhausted, match="do not serve adapter 'some-adapter'") as failure:
        swarm.model(active_adapter="some-adapter", **FAST)(ids)
    assert isinstance(failure.value.__cause__, NoRouteError)
    assert swarm.model(active_adapter=None, **FAST)(ids).logits.shape == (2, 5, swarm.local.config.vocab_size)


def test_forward_and_backward_match_local(swarm: Swarm) -> None:
    ids = prompts(seed=9)
    model = swarm.model()
    embeddings = swarm.local.get_input_embeddings()(ids).detach()
    remote_in = embeddings.clone().requires_grad_()
    local_in = embeddings.clone().requires_grad_()
    remote_out = model(inputs_embeds=remote_in, use_cache=False).logits
    local_out = swarm.local(inputs_embeds=local_in, use_cache=False).logits
    assert torch.allclose(remote_out, local_out, atol=1e-4, rtol=1e-4)
    weights = torch.randn(local_out.shape, generator=torch.Generator().manual_seed(0))
    (remote_out * weights).sum().backward()  # rpc_backward on B (or C), then A
    (local_out * weights).sum().backward()
    assert remote_in.grad is not None and torch.allclose(remote_in.grad, local_in.grad, atol=1e-4, rtol=1e-3)


def test_a_batch_over_the_servers_token_cap_goes_in_pieces(swarm: Swarm, tmp_path: Path) -> None:
    """A server taking 8 tokens per forward/backward gets a 2 x 5-token batch as two calls of one row."""
    from client_swarm import start_server

    from distconf.tools.serving import stop_all, wait_all_ready

    prefix = swarm.config.dht_prefix + "-capped"
    capped = start_server(swarm.model_dir, swarm.peers, "0:4", tmp_path / "capped.log", "--dht-prefix", prefix,
                          "--max-forward-tokens", "8")
    try:
        wait_all_ready([capped], time.monotonic() + 120)
        model = swarm.model(dht_prefix=prefix)
        ids = prompts(seed=9)
        embeddings = swarm.local.get_input_embeddings()(ids).detach()
        remote_in, local_in = embeddings.clone().requires_grad_(), embeddings.clone().requires_grad_()
        before = int(server_info(model, capped.peer_id)["stats"].get("forward", 0))
        remote_out = model(inputs_embeds=remote_in, use_cache=False).logits
        local_out = swarm.local(inputs_embeds=local_in, use_cache=False).logits
        assert torch.allclose(remote_out, local_out, atol=1e-4, rtol=1e-4)
        assert int(server_info(model, capped.peer_id)["stats"].get("forward", 0)) - before == 2
        weights = torch.randn(local_out.shape, generator=torch.Generator().manual_seed(0))
        (remote_out * weights).sum().backward()
        (local_out * weights).sum().backward()
        assert remote_in.grad is not None and torch.allclose(remote_in.grad, local_in.grad, atol=1e-4, rtol=1e-3)
        with pytest.raises(RetriesExhausted, match="longer than server"):
            swarm.model(dht_prefix=prefix, max_retries=0)(prompts(batch=1, length=9, seed=1))
    finally:
        stop_all([capped])


# ------------------------------------------------------------------ routing fields (records of peers that cannot serve)


@pytest.fixture
def decoy(swarm: Swarm) -> Any:
    """A live DHT node without block handlers, announced ONLINE for blocks 2:4 with a huge throughput."""
    with dht_node(swarm.peers) as node:
        peer = node.peer_id.to_base58()
        swarm.store(peer, 2, 4)
        try:
            yield peer
        finally:
            swarm.store(peer, 2, 4, state=0)


def test_max_retries_and_ban_timeout(swarm: Swarm, decoy: str) -> None:
    ids = prompts()
    with pytest.raises(RetriesExhausted, match="after 1 attempt"):
        swarm.model(max_retries=0, max_pinged=0)(ids)
    model = swarm.model(max_retries=3, min_backoff=0.01, max_pinged=0, ban_timeout=600.0)
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, swarm.local(ids).logits, atol=1e-4)
    assert decoy in model.remote.manager.banned()
    short = swarm.model(max_retries=3, min_backoff=0.01, max_pinged=0, ban_timeout=0.05)
    with torch.no_grad():
        short(ids)
    assert wait_for(lambda: decoy not in short.remote.manager.banned(), timeout=5.0, interval=0.02)


def test_backoff_delays(swarm: Swarm, decoy: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="distconf.client.sequence_manager")
    swarm.store(swarm.dead_peer, 2, 4, throughput=2e6)  # a second bad server: two failures in a row
    try:
        model = swarm.model(max_retries=4, min_backoff=0.125, max_backoff=0.2, max_pinged=0)
        with torch.no_grad():
            model(prompts())
    finally:
        swarm.store(swarm.dead_peer, 2, 4, state=0)
    assert "retry 1 in 0.125 s" in caplog.text
    assert "retry 2 in 0.2 s" in caplog.text  # 0.25 capped by max_backoff


def test_pings_avoid_unreachable_servers(swarm: Swarm) -> None:
    swarm.store(swarm.dead_peer, 2, 4)
    try:
        pinged = swarm.model(max_pinged=3, ping_timeout=2.0)
        route = pinged.remote.manager.plan_route()
        assert swarm.dead_peer not in [s.peer_id for s in route]
        assert math.isinf(pinged.remote.manager.pings[swarm.dead_peer])
        assert math.isfinite(pinged.remote.manager.pings[swarm.b])

        unpinged = swarm.model(max_pinged=0)
        assert swarm.dead_peer in [s.peer_id for s in unpinged.remote.manager.plan_route()]
        assert unpinged.remote.manager.pings == {}

        impatient = swarm.model(max_pinged=3, ping_timeout=1e-6)
        impatient.remote.manager.update(force=True)
        assert impatient.remote.manager.pings and all(math.isinf(v) for v in impatient.remote.manager.pings.values())
    finally:
        swarm.store(swarm.dead_peer, 2, 4, state=0)


def test_update_period(swarm: Swarm) -> None:
    slow, fast = swarm.model(update_period=600.0), swarm.model(update_period=0.001)
    slow.remote.manager.plan_route()
    fast.remote.manager.plan_route()
    with dht_node(swarm.peers) as node:
        newcomer = node.peer_id.to_base58()
        swarm.store(newcomer, 0, 2, throughput=1.0)
        try:
            slow.remote.manager.plan_route()
            fast.remote.manager.plan_route()
            assert newcomer not in slow.remote.manager.state.peers
            assert newcomer in fast.remote.manager.state.peers
        finally:
            swarm.store(newcomer, 0, 2, state=0)


def test_generate_command_prints_token_ids(swarm: Swarm) -> None:
    import os
    import sys

    from client_swarm import REPO

    result = forkserver.run(
        [sys.executable, "-m", "distconf.cli.cmd_generate", str(swarm.model_dir), "--initial-peers", *swarm.peers,
         "--ids", "5,17,42", "--max-new-tokens", "6"],
        timeout=180, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr[-2000:]
    ids = torch.tensor([[5, 17, 42]])
    assert [int(t) for t in result.stdout.split()] == swarm.expected(ids, max_new_tokens=6)[0][3:]


# ------------------------------------------------------------------ server-to-server and failover (last: kills B or C)


def test_server_to_server_push(swarm: Swarm) -> None:
    ids = prompts(seed=3)
    expected = swarm.expected(ids, max_new_tokens=12)

    model = swarm.model(use_server_to_server=True, blocked_servers=[swarm.c])

    def pushes(peer: str, kind: str = "pushes_received") -> int:
        return int(server_info(model, peer)["stats"].get(kind, 0))

    before, streamed = pushes(swarm.b), pushes(swarm.a, "pushes_streamed")
    assert generate(model, ids, max_new_tokens=12) == expected
    after = pushes(swarm.b)
    assert after - before >= 11  # every step after the first reached B from A ...
    assert pushes(swarm.a, "pushes_streamed") - streamed >= 11  # ... on A's push stream to B

    off = swarm.model(use_server_to_server=False, blocked_servers=[swarm.c])
    assert generate(off, ids, max_new_tokens=12) == expected
    assert pushes(swarm.b) == after


def test_a_third_peer_cannot_push_into_a_clients_session(swarm: Swarm) -> None:
    """A peer that learns a session id (upstream servers see them in next_servers) pushes a step into it:
    refused, because the client named the previous span's server as the only pusher, and the tokens stay right."""
    from distconf.rpc.calls import PushStream, RpcLoop, call_push
    from distconf.rpc.protocol import KEY_PUSHED, KEY_SESSION_ID, KEY_STEP_ID, make_request, serialize_tensors

    ids = prompts(seed=4)
    expected = swarm.expected(ids, max_new_tokens=6)
    model = swarm.model(use_server_to_server=True, blocked_servers=[swarm.c])
    with dht_node(swarm.peers) as thief_node:
        thief = RpcLoop(thief_node)
        try:
            with model.inference_session(max_length=ids.shape[1] + 6) as cache:
                first = generate(model, ids, max_new_tokens=2, cache=cache)
                target = cache.session.sessions[1]
                assert target.push_from == swarm.a
                evil = make_request(target.uid, serialize_tensors([torch.randn(2, 1, swarm.local.config.hidden_size)]),
                                    {KEY_SESSION_ID: target.session_id, KEY_PUSHED: True, KEY_STEP_ID: "evil"})
                with pytest.raises(P2PHandlerError, match="takes pushes from another peer only"):
                    thief.run(call_push(thief.p2p, target.peer_id, evil, timeout=10), timeout=15)
                refused = int(server_info(model, swarm.b)["stats"].get("refused_pushes", 0))
                stream = thief.run(PushStream.open(thief.p2p, target.peer_id, timeout=10), timeout=15)
                thief.run(stream.send(evil, timeout=10), timeout=15)  # the same push on a push stream
                assert wait_for(lambda: int(server_info(model, swarm.b)["stats"].get("refused_pushes", 0)) != refused,
                                timeout=10, interval=0.05), "the pushed step was not refused"
                stream.close()
                assert generate(model, torch.tensor(first), max_new_tokens=4, cache=cache) == expected
        finally:
            thief.shutdown()


def test_failover_mid_generation(swarm: Swarm) -> None:
    from transformers import LogitsProcessor, LogitsProcessorList

    ids = prompts(seed=5)
    expected = swarm.expected(ids, max_new_tokens=16)
    model = swarm.model(ban_timeout=600.0, min_backoff=0.05)
    by_peer = {s.peer_id: s for s in swarm.servers}
    killed: list[str] = []

    class KillAfterSixTokens(LogitsProcessor):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            if input_ids.shape[1] == ids.shape[1] + 6 and not killed:
                victim = cache.session.sessions[-1].peer_id
                by_peer[victim].kill()
                killed.append(victim)
            return scores

    with model.inference_session(32) as cache:
        out = generate(model, ids, max_new_tokens=16, cache=cache,
                       logits_processor=LogitsProcessorList([KillAfterSixTokens()]))
        assert killed and cache.session.failovers == 1
        replacement = cache.session.sessions[-1].peer_id
    assert out == expected
    assert replacement != killed[0] and replacement in (swarm.b, swarm.c)
    assert killed[0] in model.remote.manager.banned()
