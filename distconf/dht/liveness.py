"""Does a server answer? The client's liveness policy: ping a few candidates, route around silence.

hivemind 1.1.12's P2P layer has no ping of its own. What works (checked on real nodes
here):

* the DHT protocol's ``rpc_ping`` (``node.protocol.get_stub(peer).rpc_ping``), which
  Petals 2.x clients and servers use. Opening the stream dials the peer and runs the
  libp2p handshake, which proves the remote holds the private key of that peer id; a
  server-mode node then answers the ping. A client-mode node (Petals servers behind a
  relay run their DHT in client mode) has no DHT handlers and refuses the stream ("failed
  to negotiate protocol: protocols not supported"): protocol negotiation runs over the
  authenticated connection, so it counts as answering.
* a peer whose address the pinging node does not know (no connection, not in its
  routing table) cannot be dialed and counts as not answering, as in Petals 2.x.
* ``P2P.list_peers()`` only lists current connections (no round trip, proves nothing
  about a peer that is not connected), so it is not used.

A made-up peer id has no addresses and no key: dialing it fails at once, so a ping
rules it out. `ping_peers` returns round-trip times (``inf`` for no answer, as Petals
2.x records failed pings).

The policy (the client's `SequenceManager` applies it on every swarm refresh): ping at
most ``max_pinged`` random usable servers of each of the first, middle and last blocks
(`ping_candidates`, as Petals 2.x clients do), and route around the peers that did not
answer (`unreachable_peers`, passed to `distconf.dht.routing.make_route` as
``avoid_if_possible``) unless no route exists without them.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Iterable, Mapping
from functools import partial
from typing import TYPE_CHECKING

from distconf.dht.discovery import RemoteSpan
from distconf.dht.peerids import is_peer_id

if TYPE_CHECKING:  # pragma: no cover
    from hivemind import DHT
    from hivemind.dht import DHTNode

__all__ = ["PING_BATCH", "ping_candidates", "ping_peers", "unreachable_peers"]

PING_BATCH = 32
"""Peers pinged per request to the DHT process (keeps each pipe message small)."""


async def _ping_many(_dht: DHT, node: DHTNode, peers: list[str], timeout: float) -> dict[str, float]:
    """Runs in the DHT process: round-trip time of a DHT ping to each peer (``inf`` if none)."""
    from hivemind.p2p import PeerID
    from hivemind.proto import dht_pb2

    async def one(peer: str) -> float:
        start = time.perf_counter()
        try:
            request = dht_pb2.PingRequest(peer=node.protocol.node_info)
            await asyncio.wait_for(
                node.protocol.get_stub(PeerID.from_base58(peer)).rpc_ping(request, timeout=timeout), timeout)
        except Exception as exc:
            if "not supported" in str(exc):  # handshake done: a client-mode DHT node answered
                return time.perf_counter() - start
            return math.inf
        return time.perf_counter() - start

    results = await asyncio.gather(*(one(p) for p in peers))
    return dict(zip(peers, results, strict=True))


def ping_peers(dht: DHT, peers: Iterable[str], timeout: float = 2.0) -> dict[str, float]:
    """Round-trip seconds to each peer through ``dht``'s node; ``inf`` for no answer.

    Peers that are not well-formed peer ids get ``inf`` without a network call. Waits at
    most about ``timeout`` seconds per batch of `PING_BATCH` peers.
    """
    peers = list(dict.fromkeys(peers))
    out = {p: math.inf for p in peers if not is_peer_id(p)}
    valid = [p for p in peers if p not in out]
    for i in range(0, len(valid), PING_BATCH):
        batch = valid[i:i + PING_BATCH]
        future = dht.run_coroutine(partial(_ping_many, peers=batch, timeout=timeout), return_future=True)
        try:
            out.update(future.result(timeout=timeout + 5.0))
        except TimeoutError:
            future.cancel()
            out.update({p: math.inf for p in batch})
    return out


def ping_candidates(spans: Iterable[RemoteSpan], num_blocks: int, limit: int,
                    rng: random.Random | None = None) -> list[str]:
    """Peers to ping: up to ``limit`` random ones serving the first block, the middle, the last block.

    ``spans`` are the usable ones (the caller has applied states and allow/block lists);
    "the middle" is any span that does not start at block 0 or does not reach the end.
    """
    if limit <= 0:
        return []
    rng = rng or random.Random()
    spans = list(spans)
    groups = [
        [s.peer_id for s in spans if s.start == 0],
        [s.peer_id for s in spans if 0 < s.start or s.end < num_blocks],
        [s.peer_id for s in spans if s.end == num_blocks],
    ]
    chosen: set[str] = set()
    for group in groups:
        unique = sorted(set(group))
        chosen.update(rng.sample(unique, min(limit, len(unique))))
    return sorted(chosen)


def unreachable_peers(pings: Mapping[str, float]) -> set[str]:
    """The pinged peers that did not answer (round-trip time ``inf``)."""
    return {peer for peer, rtt in pings.items() if math.isinf(rtt)}
