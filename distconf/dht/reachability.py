"""Can other peers dial this server? Petals' reachability protocol, the check at start, relays that carry sessions.

**Petals' protocol** (src/petals/server/reachability.py): a peer asks others to dial it back through
``ReachabilityProtocol.rpc_check`` (a hivemind protobuf handler taking ``dht_pb2.PingRequest``, answering
``dht_pb2.PingResponse.available``). `ReachabilityService` answers it on every directly reachable
server: a short-lived *probe* daemon (no listen address, no relays: only a direct dial can succeed)
asks the asking peer's own ``rpc_check`` whether it is itself, and the asker says yes. It checks only
the peer that asks (Petals' peers always ask about themselves), one at a time, so nobody can make a
server dial third parties. It also answers ``DistconfReachability.rpc_observed``: the address the
asker's connection comes from (its NAT's public address), in ``PingResponse.peer.node_id``.

**The check at start** (`check_direct_reachability`): a temporary daemon listening where the server
will, announcing what it will, joins through the initial peers and asks up to 5 of them; reachable
when at least half of those that answered could dial it (Petals' rule; ``None`` when none answered,
which a server takes as reachable, as Petals does).

**Relays that carry sessions** are `distconf.dht.relay_path`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["MAX_PEERS", "PROBE_OPTIONS", "RPC_CHECK", "RPC_OBSERVED", "Reachability", "ReachabilityService",
           "check_direct_reachability", "one_line", "ping_types"]

logger = logging.getLogger(__name__)

RPC_CHECK = "ReachabilityProtocol.rpc_check"
"""The handler name of Petals' reachability check (hivemind's ``ServicerBase`` naming: class.method)."""
RPC_CHECK_AT = "DistconfReachability.rpc_check_at"
"""distconf's form of the check: the asker names the addresses it announces (``ExpertUID.uid``: a JSON list)."""
MAX_ADDRESSES = 8
RPC_OBSERVED = "DistconfReachability.rpc_observed"
"""distconf's addition: the address the asking peer is seen at (its NAT's public address)."""
MAX_PEERS = 5
DIAL_BACK_ATTEMPTS = 2
"""Probes a server sends to dial an asker back: a second, a second later, when the first found no address."""
RETRY_WITHIN = 2.0
"""Seconds within which a failed dial-back counts as "no address yet" and is tried again."""
MAX_WAITING = 8
"""Checks a server queues while it dials another asker back; more get an error (counted as no answer)."""
THRESHOLD = 0.5
WAIT_TIMEOUT = 5.0
"""Seconds a probe may take to dial a peer (Petals' ``wait_timeout``); Petals' peers wait twice that for an answer."""
ASK_TIMEOUT = 30.0
"""Seconds a server at start waits for each peer's answer: helpers check one asker at a time, and when servers
start together some wait their turn (an answer that does not come counts as no answer, not as unreachable)."""
PROBE_OPTIONS: dict[str, Any] = {"dht_mode": "client", "use_relay": False, "auto_nat": False, "nat_port_map": False,
                                 "no_listen": True, "startup_timeout": 30}
"""A probe daemon: dials out only, directly (Petals' ``STRIPPED_PROBE_ARGS``)."""


@dataclass(frozen=True)
class Reachability:
    """What the check at start found.

    ``reachable`` (None: nobody answered); ``relays``: the initial peers that answered (they accepted a
    connection from here, so they can relay); ``observed``: the address a relay sees this machine at
    (a distconf relay says; None otherwise).
    """

    reachable: bool | None
    answered: int = 0
    dialled: int = 0
    relays: tuple[str, ...] = ()
    observed: str | None = None


def ping_types() -> tuple[Any, Any, Any]:
    """hivemind's ``(PingRequest, PingResponse, NodeInfo)``: the messages the reachability handlers exchange."""
    from hivemind.proto import dht_pb2

    return dht_pb2.PingRequest, dht_pb2.PingResponse, dht_pb2.NodeInfo


async def _ask_at(p2p: Any, remote: Any, addresses: Sequence[str], timeout: float) -> bool | None:
    """Ask ``remote`` (a distconf peer) to dial this daemon at ``addresses``; else Petals' check (`_ask`)."""
    from hivemind.proto import runtime_pb2

    _, response_type, _ = ping_types()
    request = runtime_pb2.ExpertUID(uid=json.dumps(list(addresses)[:MAX_ADDRESSES]))
    try:
        response = await asyncio.wait_for(p2p.call_protobuf_handler(remote, RPC_CHECK_AT, request, response_type),
                                          timeout)
        return bool(response.available)
    except Exception as exc:
        if "handler" not in str(exc).lower() and "protocol" not in str(exc).lower():
            logger.debug("reachability: %s did not check us at %s: %r", remote, addresses, exc)
            return None
    return await _ask(p2p, remote, p2p.peer_id, timeout)  # a Petals peer


async def _ask(p2p: Any, remote: Any, check_peer: Any, timeout: float) -> bool | None:
    """Ask ``remote`` whether it can dial ``check_peer``: True, False, or None (no answer)."""
    request_type, response_type, node_info = ping_types()
    request = request_type(peer=node_info(node_id=check_peer.to_bytes()))
    try:
        response = await asyncio.wait_for(p2p.call_protobuf_handler(remote, RPC_CHECK, request, response_type),
                                          timeout)
        return bool(response.available)
    except Exception as exc:  # any failure is "no answer", as Petals counts it
        logger.debug("reachability: %s did not check %s: %r", remote, check_peer, exc)
        return None


async def _observed(p2p: Any, remote: Any, timeout: float) -> str | None:
    """The address ``remote`` sees this daemon's connection come from (None if it does not say)."""
    request_type, response_type, _ = ping_types()
    try:
        response = await asyncio.wait_for(
            p2p.call_protobuf_handler(remote, RPC_OBSERVED, request_type(), response_type), timeout)
        text = response.peer.node_id.decode("ascii")
        return text if text.startswith("/ip") and len(text) < 200 else None
    except Exception:  # a Petals peer has no such handler
        return None


class ReachabilityService:
    """Answers ``rpc_check`` and ``rpc_observed`` on a directly reachable server (see the module docstring)."""

    def __init__(self, p2p: Any, *, wait_timeout: float = WAIT_TIMEOUT) -> None:
        self.p2p, self.wait_timeout = p2p, wait_timeout
        self._busy = asyncio.Lock()  # one probe at a time; others wait their turn (at most MAX_WAITING)
        self._waiting = 0
        self._recent: dict[Any, tuple[float, bool]] = {}

    async def start(self) -> None:
        """Register the handlers on ``p2p``."""
        from hivemind.proto import runtime_pb2

        request_type, _, _ = ping_types()
        await self.p2p.add_protobuf_handler(RPC_CHECK, self.rpc_check, request_type)
        await self.p2p.add_protobuf_handler(RPC_CHECK_AT, self.rpc_check_at, runtime_pb2.ExpertUID)
        await self.p2p.add_protobuf_handler(RPC_OBSERVED, self.rpc_observed, request_type)

    async def stop(self) -> None:
        """Remove the handlers."""
        for name in (RPC_CHECK, RPC_CHECK_AT, RPC_OBSERVED):
            with contextlib.suppress(Exception):
                await self.p2p.remove_protobuf_handler(name)

    async def rpc_check(self, request: Any, context: Any) -> Any:
        """Dial the asking peer back with a probe: ``available`` is whether that worked."""
        from hivemind.p2p import PeerID

        _, response_type, _ = ping_types()
        try:
            check_peer = PeerID(request.peer.node_id)
        except Exception:
            return response_type(available=False)
        if check_peer == context.local_id:
            return response_type(available=True)
        if check_peer != context.remote_id:
            return response_type(available=False)  # a peer may only ask about itself
        return response_type(available=await self._dial_back(check_peer))

    async def rpc_observed(self, _request: Any, context: Any) -> Any:
        """The address the asking peer's connection comes from, as a multiaddr (empty if unknown)."""
        _, response_type, node_info = ping_types()
        seen = ""
        for info in await self.p2p.list_peers():
            if info.peer_id == context.remote_id:
                seen = next((str(a) for a in info.addrs if "/p2p-circuit" not in str(a)), "")
                break
        return response_type(peer=node_info(node_id=seen.encode()), available=bool(seen))

    async def _dial_back(self, peer: Any, addresses: list[str] | None = None) -> bool:
        now = time.monotonic()
        cached = self._recent.get(peer)
        if cached is not None and now - cached[0] < 30:
            return cached[1]
        if self._waiting >= MAX_WAITING:
            raise RuntimeError("busy: too many reachability checks at once")  # the asker counts no answer
        self._waiting += 1
        try:
            await self._busy.acquire()
        finally:
            self._waiting -= 1
        try:
            available = await self._probe(peer, addresses)
        finally:
            self._busy.release()
        self._recent[peer] = (time.monotonic(), available)
        logger.info("reachability: dialled peer %s back: %s", peer, "reachable" if available else "not reachable")
        return available

    async def rpc_check_at(self, request: Any, context: Any) -> Any:
        """distconf's check: dial the asking peer back at the addresses it announces (``request.uid``: JSON)."""
        _, response_type, _ = ping_types()
        try:
            addresses = json.loads(request.uid)
            if not (isinstance(addresses, list) and 0 < len(addresses) <= MAX_ADDRESSES
                    and all(isinstance(a, str) and a.startswith(("/ip4/", "/ip6/", "/dns")) and len(a) < 200
                            for a in addresses)):
                raise ValueError("a list of up to 8 multiaddrs")
        except ValueError:
            return response_type(available=False)
        return response_type(available=await self._dial_back(context.remote_id, addresses))

    async def _probe(self, peer: Any, addresses: list[str] | None) -> bool:
        """Dial ``peer`` from a new probe daemon and ask whether it is itself.

        With ``addresses`` (what the peer says it announces) the probe dials exactly those, so the check
        is of what other peers will dial. Without (Petals' check) the probe looks the peer up in the
        swarm's routing, as Petals' probe does; a peer not found there at once (its addresses arrive with
        its identify) is looked up again a second later.
        """
        from hivemind.p2p import P2P

        from distconf.dht.hivemind_p2p_compat import connect_peer

        maddrs = [str(m) for m in await self.p2p.get_visible_maddrs()]
        probe = await P2P.create(maddrs if addresses is None else [], **PROBE_OPTIONS)
        try:
            if addresses is not None:
                try:
                    dialled = [_transport_part(a) for a in addresses]
                    await asyncio.wait_for(connect_peer(probe, peer, dialled), self.wait_timeout)
                except Exception as exc:
                    logger.debug("reachability: cannot dial %s at %s: %r", peer, addresses, exc)
                    return False
            for attempt in range(DIAL_BACK_ATTEMPTS):
                if attempt:
                    await asyncio.sleep(1.0)
                started = time.monotonic()
                answer = await _ask(probe, peer, peer, self.wait_timeout)
                # None at once: no address yet; a dial that timed out is not tried again (the asker waits)
                if answer is not None or time.monotonic() - started > RETRY_WITHIN or addresses is not None:
                    return bool(answer)
            return False
        finally:
            await probe.shutdown()


async def check_direct_reachability(initial_peers: Sequence[str], listen: Sequence[str],
                                    announce: Sequence[str] | None, *, startup_timeout: float = 60.0,
                                    max_peers: int = MAX_PEERS) -> Reachability:
    """Ask up to ``max_peers`` initial peers to dial back a temporary daemon listening on ``listen``.

    The temporary daemon runs AutoNAT's service: relays that have not confirmed their own reachability
    yet may ask it to dial them back.
    """
    from hivemind.p2p import P2P, PeerID

    request_type, response_type, _ = ping_types()
    target = await P2P.create(list(initial_peers), host_maddrs=list(listen), announce_maddrs=announce,
                              dht_mode="client", use_relay=False, auto_nat=True, nat_port_map=False,
                              startup_timeout=startup_timeout)

    async def itself(request: Any, context: Any) -> Any:
        return response_type(available=PeerID(request.peer.node_id) == context.local_id)

    try:
        await target.add_protobuf_handler(RPC_CHECK, itself, request_type)
        by_id = {_peer_id(m): m for m in initial_peers if _peer_id(m)}
        asked = [PeerID.from_base58(p) for p in by_id][:max_peers]
        announced = list(announce) if announce else [str(m) for m in await target.get_visible_maddrs()]
        answers = await asyncio.gather(*(_ask_at(target, peer, announced, ASK_TIMEOUT) for peer in asked))
        observed = None
        if any(a is False for a in answers):
            seen = await asyncio.gather(*(_observed(target, p, WAIT_TIMEOUT) for p, a in zip(asked, answers)
                                          if a is not None))
            observed = next((s for s in seen if s), None)
    finally:
        await target.shutdown()
    answered = [a for a in answers if a is not None]
    relays = tuple(by_id[str(peer)] for peer, a in zip(asked, answers) if a is not None)
    dialled = sum(answered)
    reachable = dialled / len(answered) >= THRESHOLD if answered else None
    logger.debug("reachability: %d of %d peers answered, %d dialled back; seen at %s", len(answered), len(asked),
                 dialled, observed)
    return Reachability(reachable, len(answered), dialled, relays, observed)


def _transport_part(maddr: str) -> str:
    """A multiaddr without its trailing ``/p2p/ID`` (the peer id goes beside it in a CONNECT request)."""
    head, sep, tail = maddr.rpartition("/p2p/")
    return head if sep and "/" not in tail else maddr


def one_line(text: str) -> str:
    """The text on one line (the daemon lists each failed address on a line of its own)."""
    return " ".join(line.strip() for line in text.strip().splitlines())


def _peer_id(maddr: str) -> str:
    """The ``/p2p/ID`` at the end of a multiaddr ('' if none)."""
    parts = maddr.rstrip("/").split("/")
    return parts[-1] if len(parts) >= 2 and parts[-2] in ("p2p", "ipfs") else ""
