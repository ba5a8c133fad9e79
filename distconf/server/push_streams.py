"""`PushStreams`: how a server sends a step's outputs on to the next server of its caller's chain.

A unary ``rpc_push`` opens a libp2p stream per step (a request to the p2p daemon, a new stream to the
peer, a protocol negotiation): on loopback that took longer than the client's own copy of the step,
so pushes arrived after it and saved nothing. A server keeps one long-lived ``rpc_push_stream`` per next
peer instead, shared by all its sessions' pushes to that peer. A peer without the handler (a Petals
server) gets unary pushes; it is asked again after `UNARY_RETRY` seconds. Pushes only save time: the
caller sends every step itself too, so a lost push costs nothing but the gain.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict

from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

from distconf.rpc.calls import PushStream, call_push

__all__ = ["MAX_PUSH_STREAMS", "UNARY_RETRY", "PushStreams"]

logger = logging.getLogger(__name__)

MAX_PUSH_STREAMS = 32
"""Open push streams at most (clients name the next peers; the least recently used stream is closed first)."""
UNARY_RETRY = 300.0
"""Seconds a peer that refused a push stream gets unary pushes before a stream is tried again."""


class PushStreams:
    """The push streams of one server (used from its event loop)."""

    def __init__(self, p2p: P2P, timeout: float) -> None:
        self.p2p, self.timeout = p2p, timeout
        self._streams: OrderedDict[str, PushStream] = OrderedDict()
        self._opening: dict[str, asyncio.Future[PushStream | None]] = {}
        self._unary_until: dict[str, float] = {}

    async def push(self, peer: str, request: runtime_pb2.ExpertRequest) -> bool:
        """Send ``request`` to ``peer``'s ``rpc_push_stream`` (True), or as a unary ``rpc_push`` if it has none
        (False); errors raise."""
        stream = await self._stream(peer)
        if stream is not None:
            try:
                await stream.send(request, timeout=self.timeout)
                return True
            except (ConnectionError, OSError, RuntimeError, TimeoutError) as exc:
                logger.debug("push stream to %s broke (%r): a unary push instead", peer[-6:], exc)
                self._drop(peer)
        await call_push(self.p2p, peer, request, timeout=self.timeout)
        return False

    async def _stream(self, peer: str) -> PushStream | None:
        stream = self._streams.get(peer)
        if stream is not None and not stream.broken:
            self._streams.move_to_end(peer)
            return stream
        if stream is not None:
            self._drop(peer)
        if self._unary_until.get(peer, 0.0) > time.monotonic():
            return None
        opening = self._opening.get(peer)
        if opening is None:  # one open per peer at a time; concurrent pushes wait for it
            opening = self._opening[peer] = asyncio.ensure_future(self._open(peer))
            opening.add_done_callback(lambda _: self._opening.pop(peer, None))
        return await asyncio.shield(opening)

    async def _open(self, peer: str) -> PushStream | None:
        try:
            stream = await PushStream.open(self.p2p, peer, timeout=self.timeout)
        except Exception as exc:  # no such handler (a Petals server), or unreachable: unary pushes for a while
            logger.debug("no push stream to %s (%r): unary pushes for %.0f s", peer[-6:], exc, UNARY_RETRY)
            self._unary_until[peer] = time.monotonic() + UNARY_RETRY
            return None
        self._streams[peer] = stream
        while len(self._streams) > MAX_PUSH_STREAMS:
            _, oldest = self._streams.popitem(last=False)
            oldest.close()
        return stream

    def _drop(self, peer: str) -> None:
        stream = self._streams.pop(peer, None)
        if stream is not None:
            stream.close()

    def close(self) -> None:
        """Close every push stream."""
        for peer in list(self._streams):
            self._drop(peer)
