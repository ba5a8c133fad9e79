"""Announce, discover and route on a real hivemind DHT (127.0.0.1 only, no mocks).

One module-scoped swarm: a bootstrap node, three honest servers, a hostile peer (a plain
hivemind node, without distconf's validator) that stores garbage under the model's keys,
and a client. Every wait is bounded.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
from dhthelpers import run_in_node, stand_in_config, wait_for
from hivemind.utils import get_dht_time
from hypothesis import given, settings
from hypothesis import strategies as st
from swarm_harness import Swarm, dht_node
from test_dht_hostile import made_up_peer_id

from distconf.dht import (
    BlockAnnouncer,
    NoRouteError,
    ServerInfo,
    ServerState,
    announce_blocks,
    find_block_servers,
    find_models,
    find_servers_by_prefix,
    make_route,
    visible_maddrs,
)
from distconf.dht.discovery import RemoteSpan

PREFIX = "tiny-swarm-hf"
NUM_BLOCKS = 8


def model(prefix: str = PREFIX, n: int = NUM_BLOCKS):
    """A stand-in config of ``n`` blocks under ``prefix``."""
    return stand_in_config(prefix, n)


@pytest.fixture(scope="module")
def swarm():
    with Swarm() as s:
        boot = s.dht
        assert all(p.startswith("/ip4/127.0.0.1/") for p in s.peers)
        a, b, c = (s.node() for _ in range(3))
        hostile = s.plain_node()
        client = s.node(client_mode=True)
        cfg = model()
        # records that outlive the module (the default, 120 s, ran out once on a starved CI machine)
        lasting = 3600.0
        announce_blocks(a, cfg, 0, 5, ServerInfo(state=ServerState.ONLINE, throughput=10.0, public_name="a"), lasting)
        announce_blocks(b, cfg, 3, 8, ServerInfo(state=ServerState.ONLINE, throughput=5.0, public_name="b"), lasting)
        announce_blocks(c, cfg, 5, 8, ServerInfo(state=ServerState.JOINING, throughput=50.0, public_name="c"),
                        lasting)
        yield SimpleNamespace(boot=boot, a=a, b=b, c=c, hostile=hostile, client=client, cfg=cfg,
                              ids={n: d.peer_id.to_base58() for n, d in zip("abc", (a, b, c), strict=True)})


def test_round_trip_with_overlapping_spans(swarm):
    state = find_block_servers(swarm.client, swarm.cfg)
    ids = swarm.ids
    assert state.num_blocks == NUM_BLOCKS and state.dht_prefix == PREFIX
    assert [sorted(block) for block in state.servers] == [
        sorted(x) for x in ([ids["a"]],) * 3 + ([ids["a"], ids["b"]],) * 2 + ([ids["b"], ids["c"]],) * 3
    ]
    spans = {(s.peer_id, s.start, s.end, s.state) for s in state.spans}
    assert spans == {(ids["a"], 0, 5, ServerState.ONLINE), (ids["b"], 3, 8, ServerState.ONLINE),
                     (ids["c"], 5, 8, ServerState.JOINING)}
    a_span = next(s for s in state.spans if s.peer_id == ids["a"])
    assert (a_span.info.start_block, a_span.info.end_block, a_span.info.public_name) == (0, 5, "a")
    assert state.throughputs() == [10.0] * 3 + [15.0] * 2 + [55.0] * 3
    assert state.throughputs(ServerState.ONLINE) == [10.0] * 3 + [15.0] * 2 + [5.0] * 3
    # the same swarm, known only by prefix and block count
    by_prefix = find_servers_by_prefix(swarm.client, PREFIX, NUM_BLOCKS)
    assert by_prefix.servers == state.servers
    assert find_models(swarm.client)[PREFIX].num_blocks == NUM_BLOCKS


def test_discovery_is_one_batched_request(swarm, monkeypatch):
    calls = []
    unpatched = swarm.client.run_coroutine

    def counting(coro, return_future=False):
        calls.append(coro)
        return unpatched(coro, return_future=return_future)

    monkeypatch.setattr(swarm.client, "run_coroutine", counting)
    find_block_servers(swarm.client, swarm.cfg)
    assert len(calls) == 1
    assert isinstance(calls[0], partial)
    assert (calls[0].keywords["prefix"], calls[0].keywords["num_blocks"]) == (PREFIX, NUM_BLOCKS)


async def _store_raw(dht, node, items):
    for key, subkey, value, ttl in items:
        await node.store(key, value, get_dht_time() + ttl, subkey=subkey)


def test_hostile_garbage_is_skipped_and_honest_peers_still_found(swarm, caplog):
    hostile_id = swarm.hostile.peer_id.to_base58()
    garbage = ["garbage", (7, 1.0, {}), (2, -5.0, {}), (2, float("nan"), {}), (2**64 - 1, 1.0, {}),
               (2, 1.0, {"public_name": "x" * 5000}), (2, 1.0, {"cache_tokens_left": -3}), (2, 1.0, [1] * 500)]
    items = [(f"{PREFIX}.{i}", hostile_id, value, 60) for i, value in enumerate(garbage)]
    items += [(f"{PREFIX}.0", "not-a-peer-id", (2, 100.0, {}), 60), (f"{PREFIX}.1", 12345, (2, 100.0, {}), 60)]
    items += [(f"{PREFIX}-plain.0", None, (2, 1.0, {}), 60)]  # a plain value where a dict of servers belongs
    # (payloads through run_coroutine stay small: hivemind reads its command pipe non-blocking)
    run_in_node(swarm.hostile, partial(_store_raw, items=items), timeout=30)

    with caplog.at_level(logging.WARNING, logger="distconf.dht.discovery"):
        state = wait_for(lambda: len((s := find_block_servers(swarm.client, swarm.cfg)).skipped) >= 10 and s)
    assert state is not None, "the hostile records never became visible"
    assert hostile_id not in state.peers
    assert {s.peer_id for s in state.spans} == set(swarm.ids.values())
    assert len(state.skipped) == 10
    reasons = " | ".join(s.reason for s in state.skipped)
    for fragment in ("tuple", "state", "throughput", "public_name", "cache_tokens_left", "extra", "peer id"):
        assert fragment in reasons
    assert "skipped 10 unparsable DHT record" in caplog.text
    route = make_route(state)
    assert hostile_id not in {hop.peer_id for hop in route}

    plain = find_block_servers(swarm.client, model(f"{PREFIX}-plain", 1))
    assert plain.servers == [{}] and "a plain value where a dictionary" in plain.skipped[0].reason


def test_expiry_removes_a_silent_peer(swarm):
    cfg = model("expiry-test", 2)
    with dht_node(visible_maddrs(swarm.boot)) as silent:
        silent_id = silent.peer_id.to_base58()
        # 5 s: seen before it expires even on a starved machine (2 s expired before the first read once in CI)
        announce_blocks(silent, cfg, 0, 2, ServerInfo(state=ServerState.ONLINE, throughput=1.0), expiration=5.0)
        seen = wait_for(lambda: silent_id in find_block_servers(swarm.client, cfg).peers, timeout=10)
        assert seen
        # the peer is alive but stops refreshing: its records must vanish after expiration
        gone = wait_for(lambda: silent_id not in find_block_servers(swarm.client, cfg).peers, timeout=30)
        assert gone
        with pytest.raises(NoRouteError, match="block 0"):
            make_route(find_block_servers(swarm.client, cfg))


def test_offline_supersedes_a_long_lived_online_record(swarm):
    # hivemind keeps the value that expires last: the OFFLINE record must outlive the ONLINE one.
    cfg = model("offline-test", 2)
    with dht_node(visible_maddrs(swarm.boot)) as node:
        announcer = BlockAnnouncer(node, cfg, 0, 2, ServerInfo(state=ServerState.ONLINE, throughput=1.0),
                                   update_period=30.0, expiration=60.0)
        announcer.start()
        assert wait_for(lambda: find_block_servers(swarm.client, cfg).peers)
        announcer.stop(offline=True)
        state = find_block_servers(swarm.client, cfg)  # one read, no polling: the store has completed
        assert [span.state for span in state.spans] == [ServerState.OFFLINE]


async def _stall(_dht, _node, release: Path, seconds: float) -> bool:
    """Block the node's event loop (every DHT call waits, as on an overloaded node) until ``release`` exists or
    ``seconds`` pass."""
    deadline = time.monotonic() + seconds
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    return True


def test_stop_is_bounded_while_a_refresh_is_stuck(swarm, caplog, tmp_path):
    """A refresh waiting on a stalled DHT once held the announcer's lock, so `stop` waited it out (30 s)."""
    cfg = model("stuck-refresh-test", 2)
    with dht_node(visible_maddrs(swarm.boot)) as node:
        announcer = BlockAnnouncer(node, cfg, 0, 2, ServerInfo(state=ServerState.ONLINE, throughput=1.0),
                                   update_period=0.2, expiration=60.0)
        announcer.start()
        refreshing = threading.Event()
        announce = announcer.announce
        announcer.announce = lambda *a, **k: refreshing.set() or announce(*a, **k)  # the refresh thread's call
        release = tmp_path / "release"
        stall = node.run_coroutine(partial(_stall, release=release, seconds=30.0), return_future=True)
        assert wait_for(refreshing.is_set, timeout=10, interval=0.02)  # a refresh has started: it waits on the node
        with caplog.at_level(logging.WARNING, logger="distconf.dht.announce"):
            announcer.stop(offline=True, timeout=2.0)
        assert not stall.done(), "stop waited for the stalled node"
        assert "announcing OFFLINE failed" in caplog.text  # said, not hidden
        release.touch()
        assert stall.result(timeout=30)


def test_announcer_refreshes_and_goes_offline(swarm):
    cfg = model("announcer-test", 3)
    with dht_node(visible_maddrs(swarm.boot)) as node:
        peer = node.peer_id.to_base58()
        announcer = BlockAnnouncer(node, cfg, 0, 3, ServerInfo(state=ServerState.JOINING, throughput=2.0),
                                   update_period=0.5, expiration=3.0)
        announcer.start()
        try:
            assert wait_for(lambda: find_block_servers(swarm.client, cfg).peers == [peer])
            announcer.announce(announcer.info.model_copy(update={"state": ServerState.ONLINE}))
            state = wait_for(lambda: (s := find_block_servers(swarm.client, cfg)).spans
                             and s.spans[0].state == ServerState.ONLINE and s)
            assert state and [(s.start, s.end) for s in state.spans] == [(0, 3)]
            time.sleep(3.5)  # longer than the expiration: only refreshing keeps it alive
            assert find_block_servers(swarm.client, cfg).peers == [peer]
        finally:
            announcer.stop(offline=True)
        state = wait_for(lambda: (s := find_block_servers(swarm.client, cfg)).spans
                         and s.spans[0].state == ServerState.OFFLINE and s)
        assert state, "the OFFLINE announcement never arrived"
        with pytest.raises(NoRouteError, match="no online or joining server covers block 0"):
            make_route(state)


def test_route_over_the_live_swarm(swarm):
    state = find_block_servers(swarm.client, swarm.cfg)
    route = make_route(state)
    ids = swarm.ids
    # online a (0..4) then online b (5..7): joining c is faster but only online servers are needed
    assert [(h.peer_id, h.start, h.end) for h in route] == [(ids["a"], 0, 5), (ids["b"], 5, 8)]
    online_only = make_route(state, min_state=ServerState.ONLINE)
    assert online_only == route
    with pytest.raises(NoRouteError, match="block 5"):
        make_route(state, blocked_peers=[ids["b"], ids["c"]])


# --------------------------------------------------------------------------- pure routing


NAMES: dict[str, str] = {}  # well-formed peer id -> readable name (routing ignores ids that do not parse)


def span(peer: str, start: int, end: int, throughput: float = 1.0, state: ServerState = ServerState.ONLINE):
    peer_id = made_up_peer_id(peer)
    NAMES[peer_id] = peer
    return RemoteSpan(peer_id, start, end, ServerInfo(state=state, throughput=throughput))


def hops(route):
    assert all(x.end == y.start for x, y in itertools.pairwise(route))
    return [(NAMES[h.peer_id], h.start, h.end) for h in route]


def test_route_prefers_online_over_joining():
    spans = [span("join", 0, 10, 100.0, ServerState.JOINING), span("on1", 0, 6, 1.0), span("on2", 4, 10, 1.0)]
    route = make_route(spans, 10, min_state=ServerState.JOINING)
    assert [NAMES[h.peer_id] for h in route] == ["on1", "on2"] and route[0].end == route[1].start
    # where only a joining server covers a block, it is used for those blocks only
    spans = [span("join", 0, 10, 1.0, ServerState.JOINING), span("on", 0, 7, 1.0)]
    assert hops(make_route(spans, 10, min_state=ServerState.JOINING)) == [("on", 0, 7), ("join", 7, 10)]


def test_route_uses_online_servers_only_by_default():
    """As Petals 2.x clients do: a JOINING server is still loading its blocks."""
    spans = [span("join", 0, 10, 1.0, ServerState.JOINING), span("on", 0, 7, 1.0)]
    with pytest.raises(NoRouteError, match=r"no online server covers block 7 \(only joining servers"):
        make_route(spans, 10)
    with pytest.raises(NoRouteError, match="no online or joining server covers block 3"):
        make_route([span("on", 0, 3)], 10)


def test_route_ignores_spans_whose_peer_id_does_not_parse():
    good = span("good", 0, 4, 1.0)
    for bad in ("junk1", "12D3KooWabc", "", "Qm" + "1" * 44):
        liar = RemoteSpan(bad, 0, 4, ServerInfo(state=ServerState.ONLINE, throughput=1e9))
        assert hops(make_route([liar, good], 4)) == [("good", 0, 4)]


def test_route_prefers_throughput_then_fewer_hops():
    slow_whole = span("slow", 0, 10, 1.0)
    fast = [span("f1", 0, 5, 10.0), span("f2", 5, 10, 10.0)]
    assert hops(make_route([slow_whole, *fast], 10)) == [("f1", 0, 5), ("f2", 5, 10)]
    many = [span(f"p{i}", i, i + 1, 10.0) for i in range(10)]
    assert hops(make_route([*many, span("one", 0, 10, 10.0)], 10)) == [("one", 0, 10)]
    assert len(make_route([*many, span("two", 0, 5, 10.0), span("two2", 5, 10, 10.0)], 10)) == 2


def test_route_errors_clearly_on_a_gap():
    spans = [span("a", 0, 4), span("b", 5, 10), span("off", 4, 5, 5.0, ServerState.OFFLINE)]
    with pytest.raises(NoRouteError, match=r"covers block 4 .*blocks 0\.\.3 are served") as info:
        make_route(spans, 10)
    assert info.value.block == 4
    with pytest.raises(NoRouteError, match="block 0"):
        make_route([], 3)
    assert hops(make_route(spans, 10, start=5)) == [("b", 5, 10)]


def test_announce_rejects_bad_spans_and_oversized_records(swarm):
    info = ServerInfo(state=ServerState.ONLINE, throughput=1.0)
    for start, end in ((0, 0), (5, 3), (0, NUM_BLOCKS + 1), (-1, 2)):
        with pytest.raises(ValueError, match="span"):
            announce_blocks(swarm.a, swarm.cfg, start, end, info)
    with pytest.raises(ValueError, match="not an absolute time"):
        announce_blocks(swarm.a, swarm.cfg, 0, 1, info, expiration=get_dht_time() + 60)
    pings = {f"12D3KooW{i:044d}": 0.5 for i in range(100)}
    with pytest.raises(ValueError, match="bytes serialized"):
        announce_blocks(swarm.a, swarm.cfg, 0, 1, info.model_copy(update={"next_pings": pings}))
    with pytest.raises(ValueError, match="no dht_prefix"):
        announce_blocks(swarm.a, SimpleNamespace(dht_prefix=None, num_hidden_layers=2), 0, 1, info)


def _route_key(route):
    joining = sum(h.end - h.start for h in route if h.state != ServerState.ONLINE)
    seconds = sum((h.end - h.start) / h.throughput for h in route)
    return joining, -min(h.throughput for h in route), len(route), round(seconds, 9)


def _brute_force_best(spans, n):
    best = None

    def walk(p, chain):
        nonlocal best
        if p == n:
            key = _route_key(chain)
            best = key if best is None or key < best else best
            return
        for s in spans:
            if s.state != ServerState.OFFLINE and s.start <= p < s.end:
                for q in range(p + 1, s.end + 1):
                    walk(q, [*chain, RemoteSpan(s.peer_id, p, q, s.info)])

    walk(0, [])
    return best


_states = st.sampled_from([ServerState.ONLINE, ServerState.JOINING, ServerState.OFFLINE])


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 6).flatmap(lambda n: st.tuples(st.just(n), st.lists(
    st.tuples(st.integers(0, n - 1), st.integers(1, n), st.sampled_from([1.0, 2.0, 5.0]), _states),
    min_size=1, max_size=4))))
def test_route_is_optimal_against_brute_force(case):
    n, raw = case
    spans = [span(f"p{i}", a, min(n, a + length), t, state) for i, (a, length, t, state) in enumerate(raw)]
    expected = _brute_force_best(spans, n)
    if expected is None:
        with pytest.raises(NoRouteError):
            make_route(spans, n, min_state=ServerState.JOINING)
        return
    route = make_route(spans, n, min_state=ServerState.JOINING)
    assert route[0].start == 0 and route[-1].end == n
    assert _route_key(hops(route) and route) == expected


def test_listing_sets_the_hub_repository_and_skips_private_prefixes(swarm, tmp_path):
    """As Petals 2.x servers do: ``repository`` is the hub URL of a hub model; ``_`` prefixes are not listed."""
    info = ServerInfo(state=ServerState.ONLINE, throughput=1.0)
    configs = {
        "listing-hub-hf": "org/Listing-Model-v1.5",
        "_listing-private": "org/private-model",
        "listing-local": str(tmp_path),  # a local directory: no repository
    }
    for prefix, name in configs.items():
        cfg = SimpleNamespace(dht_prefix=prefix, num_hidden_layers=2, update_period=30.0, name_or_path=name)
        announce_blocks(swarm.a, cfg, 0, 2, info)
    models = find_models(swarm.client)
    assert models["listing-hub-hf"].repository == "https://huggingface.co/org/Listing-Model-v1.5"
    assert models["listing-local"].repository is None
    assert "_listing-private" not in models
    explicit = SimpleNamespace(dht_prefix="listing-explicit", num_hidden_layers=2, update_period=30.0)
    announce_blocks(swarm.a, explicit, 0, 2, info, repository="https://example.org/m")
    assert find_models(swarm.client)["listing-explicit"].repository == "https://example.org/m"
