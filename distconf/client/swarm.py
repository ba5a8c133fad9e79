"""The client's connection to a swarm: a client-mode DHT node, its P2P replica, and the raw RPC calls.

Everything that touches the network goes through `SwarmClient`: coroutines run on
hivemind's background event loop (`RemoteExpertWorker`), so the rest of the client is
plain synchronous code. Calls are addressed to a peer by base58 id and use the Petals
2.x handler names (``TransformerConnectionHandler.rpc_*``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from distconf.dht import start_local_dht
from distconf.dht.uids import config_num_blocks
from distconf.rpc.protocol import HANDLER_CLASS_NAME, MAX_UNARY_PAYLOAD_SIZE, loads_metadata, stream_parts

if TYPE_CHECKING:  # pragma: no cover
    from hivemind import DHT
    from hivemind.dht import DHTNode
    from hivemind.p2p import P2P
    from hivemind.proto import runtime_pb2

__all__ = ["SwarmClient", "handle_name", "release_dht"]

logger = logging.getLogger(__name__)
T = TypeVar("T")


def handle_name(rpc: str) -> str:
    """P2P handler name of ``rpc`` (e.g. ``rpc_forward``) on a Petals 2.x-compatible server."""
    return f"{HANDLER_CLASS_NAME}.{rpc}"


async def _ping_many(_dht: DHT, node: DHTNode, peers: list[str], timeout: float) -> dict[str, float]:
    """Runs in the DHT process: round-trip time of a DHT ping to each peer (``inf`` on failure)."""
    from hivemind.p2p import PeerID
    from hivemind.proto import dht_pb2

    async def one(peer: str) -> float:
        start = time.perf_counter()
        try:
            request = dht_pb2.PingRequest(peer=node.protocol.node_info)
            await node.protocol.get_stub(PeerID.from_base58(peer)).rpc_ping(request, timeout=timeout)
        except Exception as exc:
            if str(exc) == "protocol not supported":  # a client-mode DHT answers, but not to pings
                return time.perf_counter() - start
            return math.inf
        return time.perf_counter() - start

    results = await asyncio.gather(*(one(p) for p in peers))
    return dict(zip(peers, results))


class SwarmClient:
    """A client-mode DHT node joined through ``config.initial_peers`` plus the P2P handle for RPCs.

    :param config: a distributed config (its ClientConfig fields: ``initial_peers``,
        ``daemon_startup_timeout``, ``dht_prefix``).
    :param dht: an already running ``hivemind.DHT`` to use instead of starting one (not
        shut down by `shutdown`).
    """

    def __init__(self, config: Any, dht: DHT | None = None) -> None:
        self.config = config
        self.dht_prefix = config.dht_prefix
        if not self.dht_prefix:
            raise ValueError(f"{type(config).__name__} has no dht_prefix: pass dht_prefix=... "
                             "or save it in config.json")
        self.num_blocks = config_num_blocks(config)
        self._own_dht = dht is None
        if dht is None:
            peers = list(config.initial_peers or ())
            if not peers:
                raise ValueError("initial_peers is empty: give the multiaddr of a peer of the swarm "
                                 "(initial_peers=[...] or DISTCONF_INITIAL_PEERS)")
            dht = start_local_dht(peers, startup_timeout=float(config.daemon_startup_timeout), client_mode=True,
                                  num_workers=8)
        self.dht = dht
        try:
            self.p2p: P2P = self.run(dht.replicate_p2p(), timeout=float(config.daemon_startup_timeout))
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------ running coroutines
    @staticmethod
    def run(coro: Awaitable[T], timeout: float | None = None) -> T:
        """Run ``coro`` on the background event loop and wait (at most ``timeout`` s) for its result."""
        from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker

        future = RemoteExpertWorker.run_coroutine(coro, return_future=True)
        try:
            return future.result(timeout=timeout)
        except TimeoutError:
            future.cancel()
            raise

    @staticmethod
    def peer(peer_id: str) -> Any:
        """A hivemind ``PeerID`` from its base58 form."""
        from hivemind.p2p import PeerID

        return PeerID.from_base58(peer_id)

    # ------------------------------------------------------------------ calls
    async def call_unary(self, peer_id: str, rpc: str, request: Any, timeout: float) -> runtime_pb2.ExpertResponse:
        """One request, one reply (``rpc_forward``, ``rpc_backward``, ``rpc_push``), bounded by ``timeout``."""
        from hivemind.proto import runtime_pb2

        call = self.p2p.call_protobuf_handler(self.peer(peer_id), handle_name(rpc), request, runtime_pb2.ExpertResponse)
        return await asyncio.wait_for(call, timeout)

    async def call_tensors(self, peer_id: str, rpc: str, uid: str, serialized: Sequence[Any], metadata: bytes,
                           timeout: float) -> list[Any]:
        """Send serialized tensors to ``rpc`` (its ``_stream`` form when too large for one message).

        Returns the serialized tensors of the reply (all parts joined for a streamed reply).
        """
        from hivemind.proto import runtime_pb2
        from hivemind.utils.streaming import combine_from_streaming

        size = sum(len(t.buffer) for t in serialized)
        if size <= MAX_UNARY_PAYLOAD_SIZE:
            request = runtime_pb2.ExpertRequest(uid=uid, tensors=list(serialized), metadata=metadata)
            response = await self.call_unary(peer_id, rpc, request, timeout)
            return list(response.tensors)

        async def parts() -> AsyncIterator[Any]:
            for part in stream_parts(uid, serialized, metadata):
                yield part

        async def streamed() -> list[Any]:
            stream = await self.p2p.iterate_protobuf_handler(
                self.peer(peer_id), handle_name(rpc + "_stream"), parts(), runtime_pb2.ExpertResponse)
            chunks = [t async for response in stream for t in response.tensors]
            return _combine(chunks, combine_from_streaming)

        return await asyncio.wait_for(streamed(), timeout)

    async def call_info(self, peer_id: str, uid: str, timeout: float) -> dict[str, Any]:
        """``rpc_info`` of ``peer_id`` for block ``uid`` (a msgpack dict)."""
        from hivemind.proto import runtime_pb2

        call = self.p2p.call_protobuf_handler(self.peer(peer_id), handle_name("rpc_info"),
                                              runtime_pb2.ExpertUID(uid=uid), runtime_pb2.ExpertInfo)
        info = await asyncio.wait_for(call, timeout)
        return loads_metadata(info.serialized_info)

    async def open_stream(self, peer_id: str, rpc: str, requests: AsyncIterator[Any], timeout: float
                          ) -> AsyncIterator[Any]:
        """Open a bidirectional stream (``rpc_inference``); connecting is bounded by ``timeout``."""
        from hivemind.proto import runtime_pb2

        call = self.p2p.iterate_protobuf_handler(self.peer(peer_id), handle_name(rpc), requests,
                                                 runtime_pb2.ExpertResponse)
        return await asyncio.wait_for(call, timeout)

    def ping(self, peers: Sequence[str], timeout: float) -> dict[str, float]:
        """Round-trip time to each peer in seconds, ``inf`` for a peer that did not answer in ``timeout``."""
        if not peers:
            return {}
        return self.dht.run_coroutine(partial(_ping_many, peers=list(peers), timeout=timeout))

    def shutdown(self) -> None:
        """Close the P2P handle and stop the DHT node, if this client started them.

        A DHT given by the caller keeps its P2P replica: hivemind shares one replica per
        DHT object, so closing it would cut off every other user of that DHT.
        """
        p2p = getattr(self, "p2p", None)
        if p2p is not None and self._own_dht:
            self.p2p = None
            try:
                self.run(p2p.shutdown(), timeout=5.0)
            except Exception as exc:
                logger.debug("closing the P2P handle: %r", exc)
        dht = getattr(self, "dht", None)
        if self._own_dht and dht is not None and dht.is_alive():
            dht.shutdown()


def _combine(chunks: list[Any], combine: Any) -> list[Any]:
    """Join streamed tensor parts back into whole tensors (a part with a dtype starts a new tensor)."""
    tensors: list[Any] = []
    pending: list[Any] = []
    for chunk in chunks:
        if chunk.dtype and pending:
            tensors.append(combine(pending))
            pending = []
        pending.append(chunk)
    if pending:
        tensors.append(combine(pending))
    return tensors


def release_dht(dht: DHT, timeout: float = 10.0) -> None:
    """Close the P2P replica clients made of ``dht`` (on the loop that made it), then shut ``dht`` down.

    Lets a caller that shared one DHT between several models end it cleanly: a replica
    left to the garbage collector is closed outside any event loop.
    """
    replica = getattr(dht, "_p2p_replica", None)  # hivemind keeps one replica per DHT object
    if replica is not None:
        try:
            SwarmClient.run(replica.shutdown(), timeout=timeout)
        except Exception as exc:
            logger.debug("closing the P2P replica: %r", exc)
        dht._p2p_replica = None
    if dht.is_alive():
        dht.shutdown()
