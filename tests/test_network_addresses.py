"""Where a server listens and what it announces (Petals' flags), its identity file, and why peers are unreachable."""

from __future__ import annotations

import ipaddress
import os
import socket

import pytest

from distconf.dht import addresses
from distconf.dht.addresses import NetworkOptions, is_loopback_maddr, plan_addresses
from distconf.dht.bootstrap import explain_unreachable, tcp_endpoint

# Addresses below are parsed, never dialled (LAN and documentation ranges).
LAN, HERE, PUBLIC, OTHER = "10.1.2.3", "10.9.8.7", "203.0.113.5", "198.51.100.4"
ANY = addresses.ANY_IPV4
PEER_ID = "QmSoLnSGccFuZQJzRadHn95W2CrSFmZuTdDWP8HXaHca9z"
LOOPBACK_PEER = f"/ip4/127.0.0.1/tcp/31337/p2p/{PEER_ID}"
LAN_PEER = f"/ip4/{LAN}/tcp/31337/p2p/{PEER_ID}"


@pytest.fixture
def interfaces(monkeypatch):
    found = [ipaddress.ip_address(a) for a in ("127.0.0.1", "::1", HERE, "2001:db8::7")]
    monkeypatch.setattr(addresses, "local_addresses", lambda: found)
    return found


def test_a_swarm_on_this_machine_listens_on_loopback_only():
    for peers in ([], [LOOPBACK_PEER]):
        plan = plan_addresses(NetworkOptions(), peers)
        assert plan.listen == ("/ip4/127.0.0.1/tcp/0",) and plan.announce is None and plan.local_only


def test_peers_on_a_network_mean_every_interface_and_announcing_all_but_loopback(interfaces):
    plan = plan_addresses(NetworkOptions(), [LAN_PEER])
    port = plan.port
    assert port > 0 and plan.listen == (f"/ip4/{ANY}/tcp/{port}", f"/ip6/::/tcp/{port}")
    assert plan.announce == (f"/ip4/{HERE}/tcp/{port}", f"/ip6/2001:db8::7/tcp/{port}")
    assert not plan.local_only


def test_public_ip_is_announced_on_the_port_given_and_needs_one(interfaces):
    plan = plan_addresses(NetworkOptions(public_ip=PUBLIC, port=31337), [LAN_PEER])
    assert plan.announce == (f"/ip4/{PUBLIC}/tcp/31337",)
    assert plan_addresses(NetworkOptions(public_ip="2001:db8::5", port=31337), []).announce == (
        "/ip6/2001:db8::5/tcp/31337",)
    with pytest.raises(ValueError, match="--public-ip needs --port"):
        plan_addresses(NetworkOptions(public_ip=PUBLIC), [])
    with pytest.raises(ValueError, match="--public-ip must be an IPv4 or IPv6 address"):
        plan_addresses(NetworkOptions(public_ip="example.org", port=1), [])


def test_clashing_flags_are_refused_as_petals_refuses_them():
    with pytest.raises(ValueError, match="--port and --host-maddrs"):
        plan_addresses(NetworkOptions(port=1, host_maddrs=(f"/ip4/{ANY}/tcp/2",)), [])
    with pytest.raises(ValueError, match="--public-ip and --announce-maddrs"):
        plan_addresses(NetworkOptions(public_ip=PUBLIC, port=1, announce_maddrs=(f"/ip4/{OTHER}/tcp/1",)), [])


def test_given_addresses_are_used_as_given(interfaces):
    named = "/" + "/".join(("dns4", "x.test", "tcp", "4000"))
    plan = plan_addresses(NetworkOptions(host_maddrs=("/ip6/::/tcp/4000",), announce_maddrs=(named,)), [])
    assert plan.listen == ("/ip6/::/tcp/4000",) and plan.announce == (named,)
    plan = plan_addresses(NetworkOptions(host=HERE, port=4001), [])
    assert plan.listen == (f"/ip4/{HERE}/tcp/4001",) and plan.announce == (f"/ip4/{HERE}/tcp/4001",)
    assert plan_addresses(NetworkOptions(host="127.0.0.1"), []).local_only


def test_a_machine_with_no_dialable_address_is_told_what_to_give(monkeypatch):
    monkeypatch.setattr(addresses, "local_addresses", lambda: [ipaddress.ip_address("127.0.0.1")])
    with pytest.raises(ValueError, match=r"no address other peers can dial.*--public-ip"):
        plan_addresses(NetworkOptions(), [LAN_PEER])


def test_loopback_multiaddrs():
    assert is_loopback_maddr("/ip4/127.0.0.1/tcp/1") and is_loopback_maddr("/ip6/::1/tcp/1")
    assert is_loopback_maddr("/" + "dns/localhost/tcp/1")
    assert not is_loopback_maddr(f"/ip4/{LAN}/tcp/1") and not is_loopback_maddr("/ip6/2001:db8::1/tcp/1")


def test_the_machines_own_addresses_are_found():
    found = addresses.local_addresses()
    assert ipaddress.ip_address("127.0.0.1") in found
    assert not any(ip.is_link_local for ip in found)


def test_an_identity_is_made_private_kept_and_refused_when_others_can_read_it(tmp_path):
    from distconf.dht.identity import IdentityError, load_identity

    key = tmp_path / "id.key"
    peer = load_identity(str(key))
    assert oct(os.stat(key).st_mode & 0o777) == "0o600"
    assert load_identity(str(key)) == peer
    key.chmod(0o640)
    with pytest.raises(IdentityError, match=r"permissions 0640 are too open.*chmod 600"):
        load_identity(str(key))
    junk = tmp_path / "junk.key"
    junk.write_bytes(b"not a key")
    junk.chmod(0o600)
    with pytest.raises(IdentityError, match="not a libp2p private key"):
        load_identity(str(junk))
    with pytest.raises(IdentityError, match="not a regular file"):
        load_identity(str(tmp_path))
    with pytest.raises(IdentityError, match="cannot create"):
        load_identity(str(tmp_path / "missing-folder" / "id.key"))


def test_unreachable_initial_peers_are_each_named_with_the_cause():
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # bound, never listening: refused
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        other = listening.getsockname()[1]
        text = explain_unreachable([f"/ip4/127.0.0.1/tcp/{port}/p2p/X", f"/ip4/127.0.0.1/tcp/{other}/p2p/Y",
                                    "/unix/tmp/x"])
    refused, wrong, odd = text.split("; ")
    assert refused == f"/ip4/127.0.0.1/tcp/{port}/p2p/X: connection refused"
    assert wrong.startswith(f"/ip4/127.0.0.1/tcp/{other}/p2p/Y: its port answers, but not as the peer named")
    assert odd.startswith("/unix/tmp/x: not a TCP address")
    assert tcp_endpoint("/" + "dns4/example.test/tcp/5/p2p/Z") == ("example.test", 5)


def test_serve_help_names_every_compression_hivemind_has():
    from distconf.cli.cmd_serve import COMPRESSION_NAMES
    from distconf.rpc.protocol import COMPRESSIONS, compression_code

    assert set(COMPRESSION_NAMES) == set(COMPRESSIONS)
    assert compression_code("float16") == COMPRESSIONS["FLOAT16"]
    with pytest.raises(ValueError, match="unknown compression 'zip': one of NONE"):
        compression_code("zip")
