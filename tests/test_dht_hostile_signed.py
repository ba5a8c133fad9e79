"""Signed records on a real DHT (127.0.0.1 only): only a record's owner can write it.

One module-scoped swarm of nodes started with ``signed_records=True`` (a bootstrap
node, an honest server, a client, and an attacker with a key of its own), plus a plain
hivemind node that stores whatever it is sent, through which forged records reach the
client. Every wait is bounded.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from dhthelpers import wait_until
from swarm_harness import Swarm
from test_dht_hostile import local_subkeys, store_raw

from distconf.dht import (
    ServerInfo,
    ServerState,
    announce_blocks,
    find_block_servers,
    find_models,
)

PREFIX = "signed-test-hf"
NUM_BLOCKS = 4
TTL = 600.0


@pytest.fixture(scope="module")
def swarm():
    with Swarm(dht_kwargs={"signed_records": True}) as s:
        boot = s.dht
        server = s.node(signed_records=True)
        attacker = s.node(signed_records=True)
        plain = s.plain_node()
        client = s.node(signed_records=True, client_mode=True)
        cfg = SimpleNamespace(dht_prefix=PREFIX, num_hidden_layers=NUM_BLOCKS, update_period=30.0)
        announce_blocks(server, cfg, 0, NUM_BLOCKS, ServerInfo(state=ServerState.ONLINE, throughput=7.0),
                        expiration=TTL)
        yield SimpleNamespace(boot=boot, server=server, attacker=attacker, plain=plain, client=client, cfg=cfg,
                              server_id=server.peer_id.to_base58())


def test_signed_records_round_trip(swarm):
    state = find_block_servers(swarm.client, swarm.cfg, timeout=20)
    assert state.signed
    assert [(s.peer_id, s.start, s.end, s.state) for s in state.spans] == [
        (swarm.server_id, 0, NUM_BLOCKS, ServerState.ONLINE)]
    assert swarm.server_id.startswith("Qm")  # an RSA identity: the peer id is the hash of the signing key
    stored = local_subkeys(swarm.boot, f"{PREFIX}.0")
    assert len(stored) == 1 and stored[0].startswith(swarm.server_id + "[owner:ssh-rsa ")
    assert find_models(swarm.client, timeout=20)[PREFIX].num_blocks == NUM_BLOCKS  # listings stay unsigned


def _owner_marker(dht) -> str:
    from distconf.dht.announce import record_subkey

    peer, marker, key = record_subkey(dht).partition("[owner:")
    assert peer == dht.peer_id.to_base58() and marker
    return marker + key


def test_only_the_owner_can_write_its_records(swarm):
    """Forged OFFLINE records (unsigned, unsignable, or signed by another key) change nothing."""
    victim = swarm.server_id
    victim_subkey = victim + _owner_marker(swarm.server)
    offline = (0, 0.0, {})
    forged = [(f"{PREFIX}.{i}", sub, offline, TTL * 3) for i in range(NUM_BLOCKS) for sub in (victim, victim_subkey)]
    store_raw(swarm.plain, forged)  # unsigned: cannot carry the victim's signature
    store_raw(swarm.attacker, [(f"{PREFIX}.{i}", victim + _owner_marker(swarm.attacker), offline, TTL * 3)
                               for i in range(NUM_BLOCKS)])  # signed, but with the attacker's own key
    assert len(local_subkeys(swarm.plain, f"{PREFIX}.0")) == 3  # all three forgeries reached storage
    assert local_subkeys(swarm.boot, f"{PREFIX}.0") == [victim_subkey]  # guarded nodes refused them
    state = find_block_servers(swarm.client, swarm.cfg, timeout=20)
    assert [(s.peer_id, s.state) for s in state.spans] == [(victim, ServerState.ONLINE)]
    reasons = " | ".join(s.reason for s in state.skipped)
    assert "unsigned" in reasons and "owner key" in reasons
    # and the owner's own refresh still goes through (nothing outlives it under its subkey)
    announce_blocks(swarm.server, swarm.cfg, 0, NUM_BLOCKS, ServerInfo(state=ServerState.ONLINE, throughput=9.0),
                    expiration=TTL)
    spans = wait_until(lambda: find_block_servers(swarm.client, swarm.cfg, timeout=20).spans,
                       lambda spans: spans and spans[0].throughput == 9.0)
    assert [(s.peer_id, s.throughput) for s in spans] == [(victim, 9.0)]


def test_signed_client_ignores_unsigned_records(swarm):
    plain_id = swarm.plain.peer_id.to_base58()
    store_raw(swarm.plain, [(f"{PREFIX}.{i}", plain_id, (2, 1e6, {}), TTL) for i in range(NUM_BLOCKS)])
    assert plain_id in local_subkeys(swarm.plain, f"{PREFIX}.0")
    state = find_block_servers(swarm.client, swarm.cfg, timeout=20)
    assert plain_id not in state.peers and state.peers == [swarm.server_id]


def test_rsa_identity_file_is_reused(tmp_path):
    from hivemind.p2p import PeerID

    from distconf.dht.identity import rsa_identity
    from distconf.dht.peerids import owner_matches_peer

    path = str(tmp_path / "identity.key")
    key, got_path, cleanup = rsa_identity(path)
    assert got_path == path and cleanup is None
    again, _, _ = rsa_identity(path)
    assert again.get_public_key().to_bytes() == key.get_public_key().to_bytes()
    with open(path, "rb") as f:
        peer = PeerID.from_identity(f.read()).to_base58()
    assert owner_matches_peer(peer, key.get_public_key().to_bytes())
    _, temp_path, cleanup = rsa_identity(None)
    cleanup()
    with pytest.raises(FileNotFoundError):
        open(temp_path, "rb")
