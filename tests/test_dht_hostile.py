"""Hostile peers on a real DHT (127.0.0.1 only): Petals-compatible mode.

One module-scoped swarm: a bootstrap node and two honest servers started by distconf (so
guarded), a plain hivemind node that stores whatever it is sent (as a Petals 2.x server
or any unguarded peer does), a plain hivemind node that attacks, and a guarded client.
Anything the attacker writes reaches the client through the plain nodes; distconf's
nodes refuse it at the door. Every wait is bounded.
"""

from __future__ import annotations

import faulthandler
import hashlib
import logging
import math
from functools import partial
from types import SimpleNamespace

import base58
import pytest
from dhthelpers import run_in_node, stand_in_config, wait_for
from hivemind.utils import get_dht_time
from swarm_harness import Swarm

from distconf.dht import (
    NoRouteError,
    ServerInfo,
    ServerState,
    announce_blocks,
    find_block_servers,
    make_route,
    start_local_dht,
)

PREFIX = "hostile-test-hf"
NUM_BLOCKS = 8
TTL = 600.0


def model(prefix: str = PREFIX, n: int = NUM_BLOCKS):
    """A stand-in config of ``n`` blocks under ``prefix``."""
    return stand_in_config(prefix, n)


def made_up_peer_id(seed: str) -> str:
    """A well-formed Ed25519 peer id that no running node has."""
    key = hashlib.sha256(seed.encode()).digest()
    return base58.b58encode(bytes([0, 0x24, 8, 1, 0x12, 0x20]) + key).decode()


async def _store_raw(_dht, node, items):
    """Runs in the attacker's process: store each (key, subkey, value, ttl) as given."""
    for key, subkey, value, ttl in items:
        await node.store(key, value, get_dht_time() + ttl, subkey=subkey)
    return True


def store_raw(dht, items, timeout: float = 60.0):
    """Store raw items through ``dht`` (payloads stay small: hivemind reads its pipe non-blocking)."""
    return run_in_node(dht, partial(_store_raw, items=items), timeout=timeout)


async def _local_subkeys(_dht, node, key):
    """Runs in a node's process: what it stores under ``key`` (None, "plain" or its subkeys)."""
    from hivemind.dht.routing import DHTID
    from hivemind.dht.storage import DictionaryDHTValue

    item = node.protocol.storage.get(DHTID.generate(source=key))
    if item is None:
        return None
    if not isinstance(item.value, DictionaryDHTValue):
        return "plain"
    return sorted(str(sub) for sub, _ in item.value.items())


def local_subkeys(dht, key):
    """What ``dht``'s node keeps in its own storage under ``key``."""
    return run_in_node(dht, partial(_local_subkeys, key=key), timeout=30)


def deep_tuple(levels: int):
    """A tuple nested ``levels`` deep: about 200 levels overflow hivemind's decoder."""
    value: object = 1
    for _ in range(levels):
        value = (value,)
    return value


@pytest.fixture(scope="module")
def swarm():
    with Swarm() as s:
        boot, peers = s.dht, s.peers
        a, b = s.node(), s.node()
        petals, attacker = s.plain_node(), s.plain_node()
        client = s.node(client_mode=True)
        cfg = model()
        announce_blocks(a, cfg, 0, 5, ServerInfo(state=ServerState.ONLINE, throughput=10.0), expiration=TTL)
        announce_blocks(b, cfg, 3, 8, ServerInfo(state=ServerState.ONLINE, throughput=5.0), expiration=TTL)
        yield SimpleNamespace(boot=boot, a=a, b=b, petals=petals, attacker=attacker, client=client, cfg=cfg,
                              peers=peers, ids={"a": a.peer_id.to_base58(), "b": b.peer_id.to_base58()},
                              attacker_id=attacker.peer_id.to_base58())


def honest_blocks(state, ids):
    """Per block, which honest servers (a, b) the state shows."""
    names = {v: k for k, v in ids.items()}
    return ["".join(sorted(names[p] for p in block if p in names)) for block in state.servers]


EXPECTED = ["a", "a", "a", "ab", "ab", "b", "b", "b"]


# --------------------------------------------------------------------------- one bad record hides nothing
def test_undecodable_and_deep_records_hide_nothing(swarm, caplog):
    """A map with an integer key and a tuple nested 300 deep: once hung the search, or crashed the client."""
    store_raw(swarm.attacker, [(f"{PREFIX}.3", swarm.attacker_id, {1: 2}, TTL),
                               (f"{PREFIX}.5", swarm.attacker_id, deep_tuple(300), TTL)])
    assert local_subkeys(swarm.petals, f"{PREFIX}.3") is not None  # the bad records did reach storage
    with caplog.at_level(logging.WARNING, logger="distconf.dht.discovery"):
        for _ in range(2):
            state = find_block_servers(swarm.client, swarm.cfg, timeout=30)
            assert honest_blocks(state, swarm.ids) == EXPECTED
            assert not state.failed
    assert swarm.client.is_alive()
    reasons = {s.uid: s.reason for s in state.skipped}
    assert "not a string" in reasons[f"{PREFIX}.3"] and "nested" in reasons[f"{PREFIX}.5"]
    assert "refused on arrival" in caplog.text


def test_plain_value_over_a_block_key_hides_nothing(swarm):
    """A plain value stored over a block's key replaced every server record of that block."""
    store_raw(swarm.attacker, [(f"{PREFIX}.1", None, (2, 1.0, {}), TTL * 2)])
    assert local_subkeys(swarm.petals, f"{PREFIX}.1") == "plain"  # a Petals 2.x node lost the records
    assert local_subkeys(swarm.a, f"{PREFIX}.1") != "plain"  # ours refused the plain value
    state = find_block_servers(swarm.client, swarm.cfg, timeout=30)
    assert honest_blocks(state, swarm.ids) == EXPECTED


# --------------------------------------------------------------------------- the door
PETALS_PEER = made_up_peer_id("petals-server")
PETALS_RECORD = (2, 1234.5, {
    "start_block": 0, "end_block": 2, "public_name": "petals-server", "version": "2.3.0.dev2",
    "network_rps": 1000.0, "forward_rps": 900.0, "inference_rps": 300.0, "adapters": ("lora-a",),
    "torch_dtype": "bfloat16", "quant_type": "nf4", "using_relay": False, "cache_tokens_left": 163840,
    "next_pings": {made_up_peer_id("next"): 0.012, made_up_peer_id("failed"): math.inf},
})
GARBAGE = {
    "int-key": (made_up_peer_id("i"), {1: 2}),
    "deep": (made_up_peer_id("d"), deep_tuple(300)),
    "made-up": ("junk1", (2, 1.0, {})),
    "state": (made_up_peer_id("s"), (7, 1.0, {})),
    "nan-ping": (made_up_peer_id("n"), (2, 1.0, {"next_pings": {"x": math.nan}})),
    "negative-ping": (made_up_peer_id("m"), (2, 1.0, {"next_pings": {"x": -1.0}})),
}


def test_guarded_nodes_refuse_garbage_at_the_door(swarm):
    """Every node distconf starts refuses malformed records; Petals 2.x records pass."""
    key = "door-test.0"
    items = [(key, sub, value, TTL) for sub, value in GARBAGE.values()]
    items += [(key, PETALS_PEER, PETALS_RECORD, TTL), ("door-test.1", None, (2, 1.0, {}), TTL)]
    items += [("_petals.models", "door-test", {"num_blocks": 2**63}, TTL),
              ("_petals.models", "door test", {"num_blocks": 2}, TTL),
              (key, made_up_peer_id("far"), (2, 1.0, {}), 10 * 365 * 86400.0)]
    store_raw(swarm.attacker, items)
    plain = local_subkeys(swarm.petals, key)
    assert len(plain) == len(GARBAGE) + 2  # the unguarded node keeps everything
    for node in (swarm.boot, swarm.a, swarm.b):
        assert local_subkeys(node, key) == [PETALS_PEER]  # only the Petals 2.x record
        assert local_subkeys(node, "door-test.1") is None
        listing = local_subkeys(node, "_petals.models") or []
        assert "door-test" not in listing and "door test" not in listing


# --------------------------------------------------------------------------- ownership (Petals-compatible)
def test_offline_claim_blocks_a_servers_refresh_until_it_expires(swarm):
    """Anyone can write OFFLINE under a server's subkey (a documented limit of Petals-compatible mode)."""
    cfg = model("offline-claim-hf", 4)
    victim = swarm.ids["b"]
    announce_blocks(swarm.b, cfg, 0, 4, ServerInfo(state=ServerState.ONLINE, throughput=5.0), expiration=TTL)
    store_raw(swarm.attacker, [(f"offline-claim-hf.{i}", victim, (0, 0.0, {}), TTL * 3) for i in range(4)])
    state = wait_for(lambda: (s := find_block_servers(swarm.client, cfg, timeout=30)).spans
                     and s.spans[0].state == ServerState.OFFLINE and s)
    assert state, "the forged OFFLINE record never arrived"
    # the victim's own refresh cannot replace it (hivemind keeps the later expiration)
    announce_blocks(swarm.b, cfg, 0, 4, ServerInfo(state=ServerState.ONLINE, throughput=5.0), expiration=TTL)
    state = find_block_servers(swarm.client, cfg, timeout=30)
    assert [s.state for s in state.spans] == [ServerState.OFFLINE]
    with pytest.raises(NoRouteError):
        make_route(state)
    # the victim still answers pings; made-up and malformed ids do not
    from distconf.dht import ping_peers

    pings = ping_peers(swarm.client, [victim, made_up_peer_id("nobody"), "junk1"], timeout=5)
    assert {p for p, rtt in pings.items() if math.isfinite(rtt)} == {victim}
    client_id = swarm.client.peer_id.to_base58()  # a client-mode node has no DHT handlers, yet answers
    assert math.isfinite(ping_peers(swarm.a, [client_id], timeout=5)[client_id])


def test_made_up_peer_ids_do_not_capture_routes(swarm):
    """Records under made-up peer ids advertising huge throughput captured every hop."""
    fake = made_up_peer_id("fast-liar")
    items = [(f"{PREFIX}.{i}", fake, (2, 1e9, {}), TTL) for i in range(NUM_BLOCKS)]
    items += [(f"{PREFIX}.{i}", "Qmjunk1", (2, 1e9, {}), TTL) for i in range(NUM_BLOCKS)]
    store_raw(swarm.attacker, items)
    state = wait_for(lambda: fake in (s := find_block_servers(swarm.client, swarm.cfg, timeout=30)).peers and s)
    assert state, "the well-formed fake never arrived"
    assert "Qmjunk1" not in state.peers  # not a peer id: refused
    assert {h.peer_id for h in make_route(state)} == {fake}  # records alone cannot tell
    from distconf.dht import ping_peers
    from distconf.dht.liveness import unreachable_peers

    dead = unreachable_peers(ping_peers(swarm.client, state.peers, timeout=5))  # the client's policy
    route = make_route(state, avoid_if_possible=[dead])
    assert {h.peer_id for h in route} == set(swarm.ids.values())
    assert [(h.start, h.end) for h in route] == [(0, 5), (5, 8)]


# --------------------------------------------------------------------------- bounded work
MAX_RECORDS_PER_KEY = 256  # distconf.dht.guard.MAX_RECORDS_PER_KEY (checked below)


async def _flood(_dht, node, prefix, num_blocks, per_block, ttl):
    """Runs in the attacker's process: ``per_block`` well-formed records under made-up ids per block."""
    import os

    keys, subkeys, values = [], [], []
    for block in range(num_blocks):
        for _ in range(per_block):
            sub = base58.b58encode(bytes([0, 0x24, 8, 1, 0x12, 0x20]) + os.urandom(32)).decode()
            keys.append(f"{prefix}.{block}")
            subkeys.append(sub)
            values.append((2, 1.0, {}))
    for i in range(0, len(keys), 1000):
        await node.store_many(keys[i:i + 1000], values[i:i + 1000], get_dht_time() + ttl,
                              subkeys=subkeys[i:i + 1000], num_workers=8)
    return len(keys)


def test_junk_subkeys_are_bounded_per_key(swarm):
    """Thousands of junk subkeys per block made discovery linear in the junk."""
    per_block = MAX_RECORDS_PER_KEY + 200
    run_in_node(swarm.attacker, partial(_flood, prefix=PREFIX, num_blocks=NUM_BLOCKS, per_block=per_block, ttl=TTL),
                timeout=300)
    assert len(local_subkeys(swarm.petals, f"{PREFIX}.0")) > per_block  # unguarded storage keeps it all
    assert len(local_subkeys(swarm.a, f"{PREFIX}.0")) <= MAX_RECORDS_PER_KEY  # ours store at most the cap
    state = find_block_servers(swarm.client, swarm.cfg, timeout=30)
    assert all(len(block) <= MAX_RECORDS_PER_KEY for block in state.servers)
    assert all(set(want) <= set(got) for want, got in zip(EXPECTED, honest_blocks(state, swarm.ids), strict=True))
    small = find_block_servers(swarm.client, swarm.cfg, timeout=30, max_records_per_block=16)
    assert all(len(block) <= 16 for block in small.servers)
    assert honest_blocks(small, swarm.ids) == EXPECTED  # honest records were stored first: kept first
    from distconf.dht.guard import MAX_RECORDS_PER_KEY as cap

    assert cap == MAX_RECORDS_PER_KEY


async def _store_locally(_dht, node, key, subkey, value, ttl):
    """Runs in the attacker's process: put a record in its own storage only (it serves it to searches)."""
    from hivemind.dht.routing import DHTID
    from hivemind.utils.serializer import MSGPackSerializer

    return node.protocol.storage.store_subkey(DHTID.generate(source=key), subkey, MSGPackSerializer.dumps(value),
                                              get_dht_time() + ttl)


def test_deep_subkey_cannot_crash_a_guarded_node(swarm):
    """A subkey nested 300 deep overflows the C stack of any unguarded node that decodes it (the client did)."""
    job = partial(_store_locally, key=f"{PREFIX}.6", subkey=deep_tuple(300), value=(2, 1.0, {}), ttl=TTL)
    assert run_in_node(swarm.attacker, job, timeout=60)
    state = find_block_servers(swarm.client, swarm.cfg, timeout=30)
    assert honest_blocks(state, swarm.ids) == EXPECTED
    assert all(node.is_alive() for node in (swarm.client, swarm.boot, swarm.a, swarm.b))


async def _refresh_over_a_deep_record(_dht, node, key):
    """Runs in a node's process: a deep record in its storage, the key in its cache, then a store into the key.

    hivemind then refreshes the key at once, decoding every record the node holds under it.
    """
    import resource

    from hivemind.dht.routing import DHTID
    from hivemind.utils.serializer import MSGPackSerializer

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a plain node crashes here: no core file
    key_id, expiration = DHTID.generate(source=key), get_dht_time() + TTL
    node.protocol.storage.store_subkey(key_id, "planted", MSGPackSerializer.dumps(deep_tuple(300)), expiration)
    node.protocol.cache.store_subkey(key_id, "cached", MSGPackSerializer.dumps(1), expiration)
    await node.store(key, (2, 1.0, {}), expiration, subkey="own")
    return True


@pytest.mark.swarm
@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "plain"])
def test_cache_refresh_over_a_deep_record(guarded, monkeypatch):
    """A plain hivemind node that refreshes a key holding a deep record crashes itself (SIGSEGV); ours does not."""
    from hivemind import DHT
    from hivemind.utils.serializer import MSGPackSerializer

    if not guarded:  # the node is forked from this process, guarded itself by any RPC loop an earlier test made
        current = MSGPackSerializer.__dict__["_decode_ext_types"].__func__
        monkeypatch.setattr(MSGPackSerializer, "_decode_ext_types",
                            classmethod(getattr(current, "__wrapped__", current)))
    quiet = not guarded and faulthandler.is_enabled()
    if quiet:  # the plain node's crash is the expected result: no stack dump in the test log
        faulthandler.disable()
    try:
        node = start_local_dht() if guarded else DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    finally:
        if quiet:
            faulthandler.enable()
    try:
        try:
            run_in_node(node, partial(_refresh_over_a_deep_record, key="refresh-test.0"), timeout=30)
        except AssertionError:  # the node died before answering
            assert not guarded
        wait_for(lambda: not node.is_alive(), timeout=3)
        assert node.is_alive() == guarded, f"exit code {node.exitcode}"
    finally:
        if node.is_alive():
            node.shutdown()


# --------------------------------------------------------------------------- the listing and the CLI
CLI_CODE = """
import resource, sys
resource.setrlimit(resource.RLIMIT_DATA, (3 << 29, 3 << 29))  # a runaway allocation fails fast instead
from distconf.cli import main
raise SystemExit(main(sys.argv[1:]))
"""


def run_cli_process(*args: str, timeout: float = 90.0):
    """``distconf ...`` in a child process with bounded memory and time (its whole group is killed on timeout)."""
    import os
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", CLI_CODE, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the CLI, its DHT process and its p2p daemon
        proc.communicate()
        raise
    return SimpleNamespace(returncode=proc.returncode, stdout=out, stderr=err)


def test_hostile_listing_cannot_blow_up_the_swarm_command(swarm):
    """A listing of 2**63 blocks for an honest prefix made `distconf swarm` run 71 s, use 5.4 GB and crash."""
    store_raw(swarm.attacker, [("_petals.models", PREFIX, {"num_blocks": 2**63 - 1, "repository": None}, TTL * 3),
                               ("_petals.models", "only-hostile-hf", {"num_blocks": 2**63 - 1}, TTL * 3)])
    proc = run_cli_process("swarm", "--initial-peers", *swarm.peers, "--model", PREFIX, "--timeout", "20")
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{PREFIX}: {NUM_BLOCKS} blocks" in proc.stdout  # the honest listing, not the hostile one
    from distconf.cli import main

    assert main(["swarm", "--initial-peers", *swarm.peers, "--model", "only-hostile-hf", "--timeout", "20"]) == 1


def test_block_count_is_cross_checked_against_the_config(capsys):
    from distconf.cli.cmd_swarm import _block_count
    from distconf.dht import ModelInfo

    listing = {"m": ModelInfo(num_blocks=1000)}
    assert _block_count("m", None, 8, listing, {}) == 8  # the config wins
    assert "lists 'm' with 1000 blocks but its config has 8" in capsys.readouterr().err
    assert _block_count("m", None, None, listing, {}) == 1000  # capped by ModelInfo itself
    assert _block_count("m", 4, None, listing, {}) == 4
    assert _block_count("x", None, None, listing, {"x": "num_blocks: too big"}) is None
    err = capsys.readouterr().err
    assert "lists no model 'x'; its listing is invalid: num_blocks: too big" in err
    many = {f"model-{i:03d}": ModelInfo(num_blocks=2) for i in range(500)}
    assert _block_count("x", None, None, many, {}) is None
    assert "and 490 more" in capsys.readouterr().err  # bounded


def test_printed_tables_are_bounded():
    from distconf.dht import SwarmState
    from distconf.dht.discovery import merge_spans
    from distconf.dht.report import MAX_ROWS, format_coverage, format_route

    n = 1000
    servers = [{made_up_peer_id(f"p{j}"): ServerInfo(state=ServerState.ONLINE, throughput=1.0,
                                                    public_name="\x1b[2Jevil" * 10) for j in range(i, i + 2)}
               for i in range(n)]
    state = SwarmState("wide", n, servers, merge_spans(servers))
    text = format_coverage(state)
    lines = text.splitlines()
    assert len(lines) <= MAX_ROWS + 6 and max(len(line) for line in lines) < 400
    assert "more span(s)" in text and "\x1b" not in text
    ok, route = format_route(state)
    assert ok and len(route) < 600 and "more)" in route
