"""Server-to-server pushes: one long-lived ``rpc_push_stream`` per next peer, unary ``rpc_push`` for a peer without it.

The peer here is a bare hivemind P2P that registers only ``rpc_push`` (as a Petals 2.x server does): the pushes
reach it as unary calls, and the stream is not asked for again at every push.
"""

from __future__ import annotations

import asyncio

from hivemind.p2p import P2P, P2PContext
from hivemind.proto import runtime_pb2

from distconf.rpc.calls import PushStream
from distconf.rpc.servicer import handle_name
from distconf.server.push_streams import PushStreams


def test_a_peer_without_push_streams_gets_unary_pushes(monkeypatch) -> None:
    async def main() -> None:
        receiver = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        got: list[str] = []

        async def rpc_push(request: runtime_pb2.ExpertRequest, _: P2PContext) -> runtime_pb2.ExpertResponse:
            got.append(request.uid)
            return runtime_pb2.ExpertResponse()

        await receiver.add_protobuf_handler(handle_name("rpc_push"), rpc_push,
                                            runtime_pb2.ExpertRequest)
        sender = await P2P.create(initial_peers=[str(m) for m in await receiver.get_visible_maddrs()])
        try:
            pushes = PushStreams(sender, timeout=10)
            peer = receiver.peer_id.to_base58()
            opened: list[str] = []
            original = PushStream.open

            async def counted_open(*args, **kwargs):  # count the attempts, keep the real behaviour
                opened.append(peer)
                return await original(*args, **kwargs)

            monkeypatch.setattr(PushStream, "open", counted_open)
            results = [await pushes.push(peer, runtime_pb2.ExpertRequest(uid=f"x.{i}")) for i in range(3)]
            assert results == [False, False, False]  # unary each time ...
            assert got == ["x.0", "x.1", "x.2"]  # ... and every push arrived, in order
            assert len(opened) == 1  # the stream was asked for once
            pushes.close()
        finally:
            await sender.shutdown()
            await receiver.shutdown()

    asyncio.run(asyncio.wait_for(main(), 60))
