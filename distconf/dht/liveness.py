"""Does a server answer? Confirming peers before trusting their records.

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
2.x records failed pings); `answering_peers` and `pinger` turn that into the set of
confirmed peers that `distconf.dht.routing.make_route` takes (``alive_peers=`` or
``confirm=``); `apply_liveness` makes the OFFLINE rule concrete on a `SwarmState`.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING

from distconf.dht.discovery import SwarmState, merge_spans
from distconf.dht.peerids import is_peer_id
from distconf.dht.records import ServerInfo, ServerState

if TYPE_CHECKING:  # pragma: no cover
    from hivemind import DHT
    from hivemind.dht import DHTNode

__all__ = ["PING_BATCH", "answering_peers", "apply_liveness", "ping_peers", "pinger"]

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


def answering_peers(dht: DHT, peers: Iterable[str], timeout: float = 2.0) -> set[str]:
    """The subset of ``peers`` that answered a ping within ``timeout``."""
    return {p for p, rtt in ping_peers(dht, peers, timeout).items() if math.isfinite(rtt)}


def pinger(dht: DHT, timeout: float = 2.0) -> Callable[[Sequence[str]], set[str]]:
    """A ``confirm=`` callback for `make_route` that pings through ``dht``."""
    return partial(answering_peers, dht, timeout=timeout)


def apply_liveness(state: SwarmState, alive_peers: Iterable[str]) -> SwarmState:
    """A copy of ``state`` in which an OFFLINE record of a peer confirmed to be answering reads as ONLINE.

    In Petals-compatible mode any peer can write an OFFLINE record under another peer's
    subkey, with a later expiration, which also blocks the real server's re-announce. A
    client that has just confirmed the peer answers trusts that over the record. The
    OFFLINE record is replaced by the peer's own non-OFFLINE record of another block
    when there is one (with its state and throughput), else read as ONLINE.
    """
    alive = set(alive_peers)
    if not alive:
        return state
    servers = []
    for block in state.servers:
        new = dict(block)
        for peer, info in block.items():
            if info.state == ServerState.OFFLINE and peer in alive:
                new[peer] = _revived(state, peer, info)
        servers.append(new)
    return replace(state, servers=servers, spans=merge_spans(servers))


def _revived(state: SwarmState, peer: str, info: ServerInfo) -> ServerInfo:
    for block in state.servers:
        other = block.get(peer)
        if other is not None and other.state != ServerState.OFFLINE:
            return other  # the peer's own current record (ONLINE or JOINING)
    return info.model_copy(update={"state": ServerState.ONLINE})
