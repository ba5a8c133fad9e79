"""Petals' reachability check, answered and asked by distconf peers (on loopback; across NAT in test_lab_swarm)."""

from __future__ import annotations

import asyncio

import pytest
from hivemind.p2p import P2P, PeerID, ServicerBase
from hivemind.proto import dht_pb2
from swarm_harness import dht_node

from distconf.dht import visible_maddrs
from distconf.dht.reachability import ReachabilityService, check_direct_reachability
from distconf.rpc.calls import BackgroundLoop, RpcLoop

pytestmark = pytest.mark.swarm


@pytest.fixture(scope="module")
def helper():
    """A DHT node answering Petals' rpc_check (as every directly reachable server does)."""
    with dht_node() as dht:
        rpc = RpcLoop(dht)
        service = ReachabilityService(rpc.p2p)
        rpc.run(service.start(), timeout=30)
        try:
            yield visible_maddrs(dht)[0], rpc
        finally:
            rpc.run(service.stop(), timeout=10)
            rpc.shutdown()


class ReachabilityProtocol(ServicerBase):
    """Petals' servicer, as src/petals/server/reachability.py names it: its handle is ReachabilityProtocol.rpc_check."""

    async def rpc_check(self, request: dht_pb2.PingRequest, context: object) -> dht_pb2.PingResponse:
        return dht_pb2.PingResponse(available=True)


def run(coro):
    return BackgroundLoop.shared().run(coro, timeout=120)


def test_a_peer_that_can_be_dialled_back_is_reachable(helper):
    maddr, _ = helper
    found = run(check_direct_reachability([maddr], ["/ip4/127.0.0.1/tcp/0"], None))
    assert (found.reachable, found.answered, found.dialled, found.relays) == (True, 1, 1, (maddr,))
    assert found.observed is None  # only asked when a peer could not dial back


def test_a_peer_announcing_an_address_nobody_listens_on_is_not_reachable(helper):
    import socket

    maddr, _ = helper
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    found = run(check_direct_reachability([maddr], ["/ip4/127.0.0.1/tcp/0"], [f"/ip4/127.0.0.1/tcp/{port}"]))
    assert (found.reachable, found.answered, found.dialled) == (False, 1, 0)
    assert found.relays == (maddr,)  # it answered: it can relay
    assert found.observed is not None and found.observed.startswith("/ip4/127.0.0.1/tcp/")


def test_petals_stub_gets_the_same_answers(helper):
    """Petals' client side (a hivemind ServicerBase named ReachabilityProtocol) against our handler."""
    maddr, _ = helper
    helper_id = PeerID.from_base58(maddr.rsplit("/", 1)[1])

    async def ask(about_self: bool) -> bool:
        p2p = await P2P.create([maddr])
        try:
            await ReachabilityProtocol().add_p2p_handlers(p2p)  # so that the helper's probe gets an answer
            check_peer = p2p.peer_id if about_self else helper_id
            stub = ReachabilityProtocol.get_stub(p2p, helper_id)
            request = dht_pb2.PingRequest(peer=dht_pb2.NodeInfo(node_id=check_peer.to_bytes()))
            return (await asyncio.wait_for(stub.rpc_check(request), 20)).available
        finally:
            await p2p.shutdown()

    assert run(ask(about_self=True)) is True
    assert run(ask(about_self=False)) is True  # a peer asked about itself says yes


def test_a_peer_may_not_make_a_server_dial_someone_else(helper):
    maddr, _ = helper
    with dht_node() as other:
        third = PeerID.from_base58(visible_maddrs(other)[0].rsplit("/", 1)[1])

        async def ask() -> bool:
            p2p = await P2P.create([maddr])
            try:
                request = dht_pb2.PingRequest(peer=dht_pb2.NodeInfo(node_id=third.to_bytes()))
                response = await p2p.call_protobuf_handler(PeerID.from_base58(maddr.rsplit("/", 1)[1]),
                                                           "ReachabilityProtocol.rpc_check", request,
                                                           dht_pb2.PingResponse)
                return response.available
            finally:
                await p2p.shutdown()

        assert run(ask()) is False


def test_a_petals_peer_without_distconfs_handlers_is_asked_petals_question():
    """A peer that only answers ReachabilityProtocol.rpc_check (a Petals server) is asked that, and its answer used."""

    async def ask() -> tuple:
        helper = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        try:
            await ReachabilityProtocol().add_p2p_handlers(helper)  # says yes to everything, as a stand-in Petals peer
            maddr = f"{(await helper.get_visible_maddrs())[0]}"
            found = await check_direct_reachability([maddr], ["/ip4/127.0.0.1/tcp/0"], None)
            return found.reachable, found.answered
        finally:
            await helper.shutdown()

    assert run(ask()) == (True, 1)
