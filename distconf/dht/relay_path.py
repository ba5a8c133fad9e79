"""Relays that carry sessions: a server behind NAT lets its relays confirm themselves, then checks the relayed
path end to end.

hivemind's p2p daemon serves circuit relays with go-libp2p's default
limits (128 KiB and 2 minutes per relayed connection: a session's prompt does not fit) until its own
AutoNAT finds it publicly reachable, and only then with p2pd's own limits (4 GiB, 30 minutes); a
reservation taken before that is lost at the switch. AutoNAT asks only peers that announce a public
address, which a relay in a small swarm (one public server, the rest behind NAT) never meets. So a
server behind NAT first lets its relays confirm themselves (`confirm_relays`: a short-lived *beacon*
daemon announcing the public address the relay sees it at, whose AutoNAT service dials the relay
back), then reserves a slot, and checks the relayed path end to end (`check_relayed_path`: a probe
of its own pulls `RELAY_TEST_BYTES` through the relay). See ``docs/networking.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from distconf.dht.reachability import PROBE_OPTIONS, one_line, ping_types

__all__ = ["RELAY_TEST_BYTES", "RelayPath", "check_relayed_path", "confirm_relays"]

RELAY_FILL = "DistconfReachability.rpc_fill"
"""The handler a server offers while checking its relayed path: streams the bytes asked for."""
RELAY_TEST_BYTES = 256 << 10
"""Bytes pulled through a relay to accept it: twice what a limited hivemind relay lets through."""
RESERVATION_WAIT = 10.0
"""Seconds the relayed-path check waits for the reservation (a circuit address of its own)."""
BEACON_SECONDS = 3.0
"""Seconds a beacon stays up for the relays' AutoNAT to ask it to dial them back."""
_CHUNK = 32 << 10


@dataclass
class RelayPath:
    """What the relayed-path check found: the relay that carried the test, or why none did."""

    relay: str | None = None
    problems: dict[str, str] = field(default_factory=dict)
    """The last problem seen with each relay tried."""
    limited: bool = False
    """Whether a relay cut the test short (a relay still on go-libp2p's default limits)."""


async def confirm_relays(relays: Sequence[str], observed: str, *, seconds: float = BEACON_SECONDS) -> None:
    """Let ``relays`` confirm their public reachability with AutoNAT (see the module docstring).

    A beacon daemon announcing ``observed`` (this machine's public address as a relay saw it; it is
    not dialled, AutoNAT only needs a peer that has one) connects to the relays and runs AutoNAT's
    service for ``seconds``: a relay whose reachability is unknown asks it to dial the relay back, and
    it does, through this machine's NAT, so the relay switches to its full relay service.
    """
    from hivemind.p2p import P2P

    parts = observed.strip("/").split("/")
    if len(parts) < 4 or parts[0] not in ("ip4", "ip6") or parts[2] != "tcp":
        return
    wildcard = "0.0.0.0" if parts[0] == "ip4" else "::"
    beacon = await P2P.create(list(relays), host_maddrs=[f"/{parts[0]}/{wildcard}/tcp/0"],
                              announce_maddrs=[f"/{parts[0]}/{parts[1]}/tcp/{parts[3]}"], dht_mode="client",
                              use_relay=False, auto_nat=True, nat_port_map=False, startup_timeout=30)
    try:
        await asyncio.sleep(seconds)
    finally:
        await beacon.shutdown()


@contextlib.asynccontextmanager
async def _fill_handler(p2p: Any) -> AsyncIterator[None]:
    """While open, ``p2p`` streams up to `RELAY_TEST_BYTES` to whoever asks `RELAY_FILL`."""
    request_type, response_type, node_info = ping_types()

    async def fill(request: Any, _context: Any) -> AsyncIterator[Any]:
        left = min(int.from_bytes(request.peer.node_id[:4] or b"\0", "big"), RELAY_TEST_BYTES)
        while left > 0:
            chunk = min(left, _CHUNK)
            left -= chunk
            yield response_type(peer=node_info(node_id=b"\0" * chunk))

    await p2p.add_protobuf_handler(RELAY_FILL, fill, request_type, stream_output=True)
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            await p2p.remove_protobuf_handler(RELAY_FILL, stream_output=True)


async def _pull_through(server: Any, relay: str, size: int, timeout: float) -> tuple[int, str | None]:
    """Dial ``server`` through ``relay`` from a new probe and pull ``size`` bytes: ``(bytes, error or None)``."""
    from hivemind.p2p import P2P

    from distconf.dht.hivemind_p2p_compat import connect_peer

    request_type, response_type, node_info = ping_types()
    received = 0
    probe = await P2P.create(**{**PROBE_OPTIONS, "use_relay": True})
    try:
        await asyncio.wait_for(connect_peer(probe, server, [f"{relay}/p2p-circuit/p2p/{server}"]), timeout)
        request = request_type(peer=node_info(node_id=size.to_bytes(4, "big")))

        async def pull() -> None:
            nonlocal received
            async for message in await probe.iterate_protobuf_handler(server, RELAY_FILL, request, response_type):
                received += len(message.peer.node_id)

        await asyncio.wait_for(pull(), timeout)
        return received, None
    except Exception as exc:
        return received, one_line(str(exc)) or type(exc).__name__
    finally:
        await probe.shutdown()


async def check_relayed_path(p2p: Any, relays: Sequence[str], *, size: int = RELAY_TEST_BYTES,
                             timeout: float = 20.0) -> RelayPath:
    """Pull ``size`` bytes from ``p2p`` through each of ``relays`` until one carries them all (see the module).

    Waits first (up to `RESERVATION_WAIT`) for a circuit address of ``p2p`` (the sign of a reservation
    with a relay whose address is public), then tries every relay, again every 2 s until ``timeout``
    unless a relay cut the test short (``limited``: its reservation will not carry a session). Each
    attempt dials from a new probe daemon: one daemon's failed dial would hold back its next ones.
    """
    from distconf.dht.hivemind_p2p_compat import daemon_peer_ids_as_multihash

    daemon_peer_ids_as_multihash()
    result = RelayPath()
    deadline = time.monotonic() + timeout
    async with _fill_handler(p2p):
        await _wait_for_circuit(p2p, min(RESERVATION_WAIT, timeout))
        while time.monotonic() < deadline and not result.limited:
            for relay in relays:
                got, error = await _pull_through(p2p.peer_id, relay, size,
                                                 max(1.0, min(15.0, deadline - time.monotonic())))
                if got >= size:
                    result.relay = relay
                    return result
                if got:
                    result.limited = True
                    result.problems[relay] = (f"it cut the relayed connection after {got // 1024} KiB (go-libp2p's "
                                              "default relay limits: the relay has not confirmed that it is "
                                              "publicly reachable)")
                else:
                    result.problems[relay] = error or "no bytes came through"
            await asyncio.sleep(min(2.0, max(0.0, deadline - time.monotonic())))
    return result


async def _wait_for_circuit(p2p: Any, timeout: float) -> bool:
    """Wait until ``p2p`` announces a ``/p2p-circuit`` address (a relay reserved a slot for it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any("/p2p-circuit" in str(m) for m in await p2p.get_visible_maddrs(latest=True)):
            return True
        await asyncio.sleep(0.25)
    return False
