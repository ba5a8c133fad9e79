"""The client's liveness policy (distconf.dht.liveness) and the route's ``avoid_if_possible`` (no network)."""

from __future__ import annotations

import math
import random

import pytest
from test_dht_hostile import made_up_peer_id

from distconf.dht import NoRouteError, RemoteSpan, ServerInfo, ServerState, make_route
from distconf.dht.liveness import ping_candidates, unreachable_peers

NAMES: dict[str, str] = {}


def span(peer: str, start: int, end: int, throughput: float = 1.0) -> RemoteSpan:
    peer_id = made_up_peer_id(peer)
    NAMES[peer_id] = peer
    return RemoteSpan(peer_id, start, end, ServerInfo(state=ServerState.ONLINE, throughput=throughput))


def names(peers) -> set[str]:
    return {NAMES[p] for p in peers}


def test_ping_candidates_cover_first_middle_and_last_blocks() -> None:
    spans = [span("first", 0, 3), span("mid", 3, 6), span("last", 6, 10), span("whole", 0, 10)]
    assert names(ping_candidates(spans, 10, limit=3)) == {"first", "mid", "last", "whole"}
    picked = ping_candidates(spans, 10, limit=1, rng=random.Random(0))
    assert len(picked) <= 3 and picked == sorted(picked)
    firsts = {made_up_peer_id("first"), made_up_peer_id("whole")}
    lasts = {made_up_peer_id("last"), made_up_peer_id("whole")}
    assert set(picked) & firsts and set(picked) & lasts
    assert ping_candidates(spans, 10, limit=0) == []


def test_unreachable_peers_are_the_infinite_pings() -> None:
    assert unreachable_peers({"a": 0.01, "b": math.inf, "c": 2.0}) == {"b"}


def test_route_avoids_groups_while_others_cover_then_drops_the_last_group_first() -> None:
    fast_dead = span("fast-dead", 0, 10, 100.0)
    short = span("short", 0, 10, 50.0)
    slow = span("slow", 0, 10, 1.0)
    dead, low = {fast_dead.peer_id}, {short.peer_id}
    route = make_route([fast_dead, short, slow], 10, avoid_if_possible=[dead, low])
    assert names(h.peer_id for h in route) == {"slow"}
    route = make_route([fast_dead, short], 10, avoid_if_possible=[dead, low])  # the last group goes first
    assert names(h.peer_id for h in route) == {"short"}
    route = make_route([fast_dead], 10, avoid_if_possible=[dead, low])  # nothing else covers: use it
    assert names(h.peer_id for h in route) == {"fast-dead"}
    with pytest.raises(NoRouteError):
        make_route([fast_dead], 10, blocked_peers=dead, avoid_if_possible=[low])
