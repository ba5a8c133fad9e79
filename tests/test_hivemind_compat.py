"""`distconf.dht.hivemind_compat` and `distconf.dht.hivemind_rpc_compat` on the installed hivemind: the version
gate and one test per item.

Process-wide patches are applied in this process and undone after each test (the DHT
processes later tests start are forked from this one and must start unpatched); the
dictionary filter and the speed-up wiring run in real DHT nodes on loopback.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import pickle
import tomllib
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import base58
import pytest
from dhthelpers import run_in_node
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import ValueWithExpiration
from packaging.specifiers import SpecifierSet
from swarm_harness import Swarm

from distconf.dht import hivemind_compat as compat
from distconf.dht import hivemind_rpc_compat as rpc_compat
from distconf.dht.wire import TUPLE_EXT_CODE

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def restore():
    """``restore(cls, *names)``: put those class attributes back as they are now after the test."""
    saved = []

    def save(cls: type, *names: str) -> None:
        saved.extend((cls, name, cls.__dict__.get(name)) for name in names)

    yield save
    for cls, name, value in reversed(saved):
        if value is None:
            if name in cls.__dict__:
                delattr(cls, name)
        else:
            setattr(cls, name, value)


def deep_tuple(levels: int) -> object:
    value: object = 1
    for _ in range(levels):
        value = (value,)
    return value


# ----------------------------------------------------------------------------- version gate
def test_supported_range_is_the_pyproject_pin():
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    pin = next(d for d in dependencies if d.startswith("hivemind"))
    assert SpecifierSet(pin.removeprefix("hivemind")) == SpecifierSet(compat.SUPPORTED_HIVEMIND)
    assert compat.TESTED_HIVEMIND in SpecifierSet(compat.SUPPORTED_HIVEMIND)


def test_installed_hivemind_is_accepted():
    import hivemind

    assert compat.check_hivemind_version() == hivemind.__version__


@pytest.mark.parametrize("version", ["1.1.12", "1.1.13", "1.1.99"])
def test_versions_in_range_are_accepted(version):
    assert compat.check_hivemind_version(version) == version


@pytest.mark.parametrize("version", ["1.1.11", "1.2.0", "1.2.0rc1", "2.0", "0.9.10", "not a version"])
def test_versions_out_of_range_are_refused(version):
    with pytest.raises(compat.HivemindVersionError) as caught:
        compat.check_hivemind_version(version)
    message = str(caught.value)
    assert f"hivemind {version} is installed" in message
    assert compat.SUPPORTED_HIVEMIND in message and compat.TESTED_HIVEMIND in message


# ----------------------------------------------------------------------------- 1. msgpack depth
def test_msgpack_depth_guard_refuses_deep_tuples(restore):
    restore(MSGPackSerializer, "_decode_ext_types")
    current = MSGPackSerializer.__dict__["_decode_ext_types"].__func__  # a loop made here earlier installs it
    MSGPackSerializer._decode_ext_types = classmethod(getattr(current, "__wrapped__", current))
    limit = rpc_compat.MAX_EXT_DEPTH
    too_deep = MSGPackSerializer.dumps(deep_tuple(limit + 1))
    assert MSGPackSerializer.loads(too_deep) == deep_tuple(limit + 1)  # unguarded: decoded
    rpc_compat.guard_msgpack_depth()
    rpc_compat.guard_msgpack_depth()  # idempotent: one wrap, not two
    assert MSGPackSerializer.loads(MSGPackSerializer.dumps(deep_tuple(limit))) == deep_tuple(limit)
    with pytest.raises(ValueError, match="nested more than 32 levels"):
        MSGPackSerializer.loads(too_deep)
    assert MSGPackSerializer.loads(MSGPackSerializer.dumps([(1, 2), {"a": (3,)}])) == [(1, 2), {"a": (3,)}]


_DECODE = """
import sys
from hivemind.utils.serializer import MSGPackSerializer
levels, kind = int(sys.argv[1]), sys.argv[2]
if kind == "tuple":
    value = 1
    for _ in range(levels):
        value = (value,)
    raw = MSGPackSerializer.dumps(value)
else:  # plain msgpack arrays (fixarray of one) or maps (fixmap of one)
    raw = (b"\\x91" if kind == "list" else b"\\x81\\xa1k") * levels + b"\\x00"
try:
    MSGPackSerializer.loads(raw)
    print("decoded")
except Exception as exc:
    print(type(exc).__name__)
"""


@pytest.mark.slow  # a few seconds: kept out of make test-fast
@pytest.mark.parametrize(("levels", "kind", "outcome"), [
    (100, "tuple", "decoded"), (400, "tuple", -11),  # each tuple level is a nested C decode
    (1000, "list", "decoded"), (1100, "list", "StackError"), (100_000, "map", "StackError"),  # iterative in C
])
def test_what_nesting_kills_an_unguarded_process(levels, kind, outcome):
    """Why item 1 guards extension types only: plain arrays and maps are refused by msgpack itself."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _DECODE, str(levels), kind], capture_output=True, text=True,
                          timeout=120)
    assert (done.returncode if isinstance(outcome, int) else done.stdout.strip()) == outcome, done.stderr[-500:]


def test_every_rpc_loop_process_is_guarded(restore):
    """`distconf.rpc.calls` makes every loop for RPCs in a process with the depth guard (servers, clients)."""
    from distconf.rpc.calls import BackgroundLoop

    restore(MSGPackSerializer, "_decode_ext_types")
    current = MSGPackSerializer.__dict__["_decode_ext_types"].__func__
    MSGPackSerializer._decode_ext_types = classmethod(getattr(current, "__wrapped__", current))
    loop = BackgroundLoop(name="compat-test-loop")
    try:
        assert compat._marked(MSGPackSerializer.__dict__["_decode_ext_types"].__func__)
    finally:
        loop.stop()


def test_tuple_extension_code_matches_hivemind():
    assert TUPLE_EXT_CODE == MSGPackSerializer._TUPLE_EXT_TYPE_CODE


# ----------------------------------------------------------------------------- 2. dictionary filter
async def _store_locally(_dht, node, key, records):
    """Runs in a node's process: put records in its own storage only (it serves them to searches)."""
    key_id = DHTID.generate(source=key)
    for subkey, value in records.items():
        node.protocol.storage.store_subkey(key_id, subkey, MSGPackSerializer.dumps(value), get_dht_time() + 60)
    return True


async def _drop_bad_subkeys(_dht, node):
    """Runs in a node's process: filter every dictionary it receives, dropping subkeys that start with 'bad'."""
    def drop_invalid(_key_bytes, dictionary):
        for subkey in [s for s, _ in dictionary.items() if str(s).startswith("bad")]:
            del dictionary[subkey]

    compat.filter_dictionaries(node.protocol, drop_invalid)
    return True


async def _patch_marks(_dht, _node):
    """Runs in a node's process: which process-wide patches are applied there."""
    from hivemind.dht import node as hivemind_node

    return {
        "peer_id_text": compat._marked(PeerID.__init__),
        "msgpack_depth": compat._marked(MSGPackSerializer.__dict__["_decode_ext_types"].__func__),
        "search_expiration": compat._marked(hivemind_node._SearchState.add_candidate),
        "dictionary_decoding": compat._marked(DictionaryDHTValue.unpackb),
    }


@pytest.fixture(scope="module")
def nodes():
    with Swarm() as s:
        yield SimpleNamespace(local=s.dht, plain=s.plain_node())


def test_dictionary_filter_drops_records_and_keeps_the_rest(nodes):
    key = "compat.filter"
    assert run_in_node(nodes.local, partial(_store_locally, key=key, records={"good": 1, "bad": 2, "bad2": 3}))
    assert run_in_node(nodes.plain, _drop_bad_subkeys)
    found = nodes.plain.get(key, latest=True)
    assert found is not None and sorted(found.value) == ["good"]  # hivemind alone keeps all three or none
    assert found.value["good"].value == 1


# ----------------------------------------------------------------------------- 3. subkey cap
def test_subkey_cap_refuses_new_subkeys_only():
    storage = DHTLocalStorage()
    capped, free = DHTID.generate(source="capped"), DHTID.generate(source="free")
    refused = []
    compat.cap_stored_subkeys(storage, lambda key: 2 if key == capped.to_bytes() else None,
                              lambda: refused.append(1))
    expiration = get_dht_time() + 60
    assert [storage.store_subkey(capped, s, b"v", expiration) for s in ("a", "b", "c")] == [True, True, False]
    assert storage.store_subkey(capped, "a", b"w", expiration + 1)  # a refresh of a held subkey
    assert all(storage.store_subkey(free, s, b"v", expiration) for s in ("a", "b", "c"))
    assert len(refused) == 1 and sorted(s for s, _ in storage.get(capped).value.items()) == ["a", "b"]
    compat.cap_stored_subkeys(storage, lambda key: 3, lambda: refused.append(1))  # replaces, does not stack
    assert storage.store_subkey(capped, "c", b"v", expiration)
    assert not storage.store_subkey(capped, "d", b"v", expiration) and len(refused) == 2


# ----------------------------------------------------------------------------- 4. search expiration
def test_search_takes_dictionary_expiration_from_its_records(restore):
    from hivemind.dht.node import _SearchState

    restore(_SearchState, "add_candidate")
    now = get_dht_time()
    records = DictionaryDHTValue()
    records.store("peer", b"v", now + 10)

    async def search(candidate: ValueWithExpiration) -> _SearchState:
        state = _SearchState(DHTID.generate(source="k"), now + 100, future=asyncio.get_running_loop().create_future())
        state.add_candidate(candidate, None)
        return state

    lying = ValueWithExpiration(records, math.inf)
    assert asyncio.run(search(lying)).finished  # unpatched: a claim of +inf ends the search
    compat.expire_dictionaries_by_records()
    state = asyncio.run(search(lying))
    assert not state.finished and state.expiration_time == now + 10
    empty = asyncio.run(search(ValueWithExpiration(DictionaryDHTValue(), math.inf)))
    assert empty.binary_value is None and empty.expiration_time is None


# ----------------------------------------------------------------------------- 5. dictionary decoding
def test_dictionary_decoding_is_bounded(restore):
    restore(DictionaryDHTValue, "unpackb")
    now = get_dht_time()
    big = DictionaryDHTValue()
    for i in range(10):
        big.store(f"s{i}", MSGPackSerializer.dumps(i), now + 10 + i)
    compat.bound_dictionary_decoding(3)
    decoded = MSGPackSerializer.loads(MSGPackSerializer.dumps(big))
    assert isinstance(decoded, DictionaryDHTValue) and len(decoded) == 3
    assert {s for s, _ in decoded.items()} <= {s for s, _ in big.items()}
    assert decoded.latest_expiration_time == big.latest_expiration_time
    small = DictionaryDHTValue()
    small.store("only", b"v", now + 5)
    again = MSGPackSerializer.loads(MSGPackSerializer.dumps(small))  # hivemind's layout, read as hivemind does
    assert [(s, item.value, item.expiration_time) for s, item in again.items()] == [("only", b"v", now + 5)]


# ----------------------------------------------------------------------------- 6. PeerID text
def test_peer_id_text_is_lazy_and_survives_pickling(restore):
    raw = bytes([0x12, 32]) + hashlib.sha256(b"compat").digest()
    text = base58.b58encode(raw).decode()
    names = ("__init__", "to_base58", "__getstate__")
    restore(PeerID, *names)
    unpatched = {name: PeerID.__dict__.get(name) for name in names}
    compat.lazy_peer_id_text()
    peer = PeerID(raw)
    assert "_b58_str" not in peer.__dict__
    assert peer.to_base58() == str(peer) == text and peer == PeerID.from_base58(text)
    assert hash(PeerID(raw)) == hash(peer)
    pickled = pickle.dumps(PeerID(raw))
    for name, value in unpatched.items():  # a process without the patch reads the pickle
        if value is None:
            delattr(PeerID, name)
        else:
            setattr(PeerID, name, value)
    assert pickle.loads(pickled).to_base58() == text


def test_start_local_dht_applies_the_speed_up_in_the_node_only(nodes):
    marks = run_in_node(nodes.local, _patch_marks)
    assert marks == {"peer_id_text": True, "msgpack_depth": True, "search_expiration": True,
                     "dictionary_decoding": True}
    assert not compat._marked(PeerID.__init__)  # the caller's process is left alone


@pytest.mark.swarm
def test_a_node_process_guards_msgpack_before_its_node_starts(restore):
    """Its bootstrap peers' replies are decoded before `install_guard` runs: the child's start installs item 1."""
    from distconf.dht.node_process import NodeProcess

    restore(MSGPackSerializer, "_decode_ext_types")  # the child is forked from an unguarded process
    current = MSGPackSerializer.__dict__["_decode_ext_types"].__func__
    MSGPackSerializer._decode_ext_types = classmethod(getattr(current, "__wrapped__", current))
    node = NodeProcess(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])  # not start_local_dht: no install_guard
    try:
        assert run_in_node(node, _patch_marks)["msgpack_depth"]
    finally:
        node.shutdown()


# ----------------------------------------------------------------------------- 7, 8. private state
def test_composite_validators_lists_the_installed_ones():
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.dht.validation import CompositeValidator

    rsa = RSASignatureValidator()
    assert compat.composite_validators(CompositeValidator([rsa])) == [rsa]
    assert compat.composite_validators(rsa) == []


def test_rsa_private_key_from_der_round_trips():
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519
    from hivemind.utils.crypto import RSAPrivateKey

    key = RSAPrivateKey()
    again = compat.rsa_private_key_from_der(key.to_bytes())
    assert again.get_public_key().to_bytes() == key.get_public_key().to_bytes()
    signature = again.sign(b"data")
    assert key.get_public_key().verify(b"data", signature)
    other = ed25519.Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    with pytest.raises(ValueError, match="not an RSA private key"):
        compat.rsa_private_key_from_der(other)


# ----------------------------------------------------------------------------- 10, 11. P2P
def test_forget_p2p_replica_detaches_the_one_replica(nodes):
    assert compat.forget_p2p_replica(nodes.plain) is None

    async def replicate_and_forget() -> bool:
        replica = await nodes.plain.replicate_p2p()
        try:
            assert await nodes.plain.replicate_p2p() is replica  # hivemind keeps one per DHT object
            assert compat.forget_p2p_replica(nodes.plain) is replica
            assert compat.forget_p2p_replica(nodes.plain) is None
            return await nodes.plain.replicate_p2p() is not replica  # the next call makes a new one
        finally:
            await replica.shutdown()
            fresh = compat.forget_p2p_replica(nodes.plain)
            if fresh is not None:
                await fresh.shutdown()

    assert asyncio.run(asyncio.wait_for(replicate_and_forget(), 60))


def test_p2p_message_limits_are_hiveminds():
    from hivemind.p2p.p2p_daemon_bindings import control

    largest, unary = compat.p2p_message_limits()
    assert (largest, unary) == (control.DEFAULT_MAX_MSG_SIZE, control.MAX_UNARY_PAYLOAD_SIZE)
    assert 0 < unary <= largest


# ----------------------------------------------------------------------------- 12. p2pd process group
def test_isolate_p2p_daemon_detaches_p2pd_only(monkeypatch):
    import asyncio.subprocess as aio_subprocess

    calls = []

    async def fake_exec(program, *args, **kwargs):
        calls.append((program, kwargs))

    monkeypatch.setattr(aio_subprocess, "create_subprocess_exec", fake_exec)  # undone after the test
    rpc_compat.isolate_p2p_daemon()
    rpc_compat.isolate_p2p_daemon()  # idempotent: one wrapper
    assert compat._marked(aio_subprocess.create_subprocess_exec)
    asyncio.run(aio_subprocess.create_subprocess_exec("/somewhere/hivemind_cli/p2pd", "-listen=x"))
    asyncio.run(aio_subprocess.create_subprocess_exec("/bin/true"))
    assert [program for program, _ in calls] == ["/somewhere/hivemind_cli/p2pd", "/bin/true"]
    assert callable(calls[0][1]["preexec_fn"]) and "preexec_fn" not in calls[1][1]


def _p2p_daemon_of(dht) -> int:
    import psutil

    daemons = [p.pid for p in psutil.Process(dht.pid).children() if p.name() == rpc_compat.P2P_DAEMON_NAME]
    assert len(daemons) == 1, daemons
    return daemons[0]


def test_start_local_dht_gives_p2pd_its_own_process_group(nodes):
    import os

    isolated = _p2p_daemon_of(nodes.local)
    assert os.getpgid(isolated) == isolated != os.getpgid(nodes.local.pid)
    plain = _p2p_daemon_of(nodes.plain)  # hivemind as it is: p2pd in the group of the DHT process
    assert os.getpgid(plain) == os.getpgid(nodes.plain.pid)


# ----------------------------------------------------------------------------- 13. one write per message
class _RecordingWriter:
    """Collects what is written (the stream writer ``send_protobuf`` is given)."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    async def drain(self) -> None:
        pass


def test_coalesced_writes_send_hiveminds_bytes_in_one_write(restore):
    from hivemind.p2p import P2P
    from hivemind.proto import runtime_pb2
    from hivemind.proto.p2pd_pb2 import RPCError

    messages = [runtime_pb2.ExpertRequest(uid="a.0", metadata=b"m" * 100), RPCError(message="refused"),
                P2P.END_OF_STREAM, runtime_pb2.ExpertRequest(uid="big", metadata=b"b" * 5000)]

    def written() -> list[list[bytes]]:
        out = []
        for message in messages:
            writer = _RecordingWriter()
            asyncio.run(P2P.send_protobuf(message, writer))
            out.append(writer.writes)
        return out

    restore(P2P, "send_protobuf")
    current = P2P.__dict__["send_protobuf"].__func__  # an earlier test of this process may have patched it
    P2P.send_protobuf = staticmethod(getattr(current, "__wrapped__", current))
    unpatched = written()
    rpc_compat.coalesce_p2p_writes(limit=1000)
    rpc_compat.coalesce_p2p_writes(limit=10)  # idempotent: the first limit stays
    patched = written()
    assert [b"".join(w) for w in patched] == [b"".join(w) for w in unpatched]
    assert [len(w) for w in patched[:3]] == [1, 1, 1] and len(patched[3]) == len(unpatched[3]) > 1

    async def round_trip() -> tuple[object, object]:  # hivemind's reader parses what the patch wrote
        reader = asyncio.StreamReader()
        for message in messages[:2]:
            writer = _RecordingWriter()
            await P2P.send_protobuf(message, writer)
            reader.feed_data(b"".join(writer.writes))
        first, _ = await P2P.receive_protobuf(runtime_pb2.ExpertRequest, reader)
        _, error = await P2P.receive_protobuf(runtime_pb2.ExpertRequest, reader)
        return first, error

    first, error = asyncio.run(round_trip())
    assert first == messages[0] and error.message == "refused"


# ----------------------------------------------------------------------------- 14-16. p2p daemon across networks
def test_static_relays_turn_relay_discovery_off_only_with_trusted_relays_and_autorelay(restore):
    from hivemind.p2p import P2P

    from distconf.dht import hivemind_p2p_compat as p2p_compat

    restore(P2P, "_make_process_args")
    relay = "/ip6/2001:db8::1/tcp/1/p2p/X"  # parsed, never dialled
    before = P2P._make_process_args("p2pd", autoRelay=True, trustedRelays=relay)
    assert not any(arg.startswith("-relayDiscovery") for arg in before)  # hivemind leaves it on: a 3-minute boot
    p2p_compat.static_relays()
    p2p_compat.static_relays()  # idempotent
    assert "-relayDiscovery=0" in P2P._make_process_args("p2pd", autoRelay=True, trustedRelays=relay)
    assert not any(a.startswith("-relayDiscovery") for a in P2P._make_process_args("p2pd", autoRelay=True))
    assert not any(a.startswith("-relayDiscovery") for a in P2P._make_process_args("p2pd", trustedRelays="x"))


def test_p2p_ids_are_encoded_as_the_daemon_reads_them(monkeypatch):
    from hivemind.utils.multiaddr import Multiaddr
    from hivemind.utils.multiaddr.codecs import cid as cid_codec

    from distconf.dht import hivemind_p2p_compat as p2p_compat

    monkeypatch.setattr(cid_codec, "to_bytes", cid_codec.to_bytes)  # undone after the test
    ed25519 = "12D3KooWBJQigz5bFaVCo4C8vdftjUhgfYtGiHTCXorg63Y9KYFL"
    rsa = "QmSoLnSGccFuZQJzRadHn95W2CrSFmZuTdDWP8HXaHca9z"
    text = f"/ip6/2001:db8::2/tcp/31337/p2p/{ed25519}/p2p-circuit/p2p/{rsa}"
    hiveminds = Multiaddr(text).to_bytes()
    p2p_compat.daemon_peer_ids_as_multihash()
    ours = Multiaddr(text).to_bytes()
    # go-multiaddr: /p2p/ is 0xa5 0x03, a varint length, the peer id's multihash (identity 0x00 or sha2-256 0x12 0x20)
    ed_hash, rsa_hash = base58.b58decode(ed25519), base58.b58decode(rsa)
    assert bytes([0xA5, 0x03, len(ed_hash)]) + ed_hash in ours
    assert bytes([0xA5, 0x03, len(rsa_hash)]) + rsa_hash in ours
    assert bytes([0xA5, 0x03, len(ed_hash) + 2, 0x01, 0x72]) + ed_hash in hiveminds  # CIDv1: the daemon refuses it
    assert str(Multiaddr(ours)) == text  # the text form is unchanged


def test_connect_and_disconnect_reach_the_daemon_client():
    from hivemind.p2p.p2p_daemon_bindings.p2pclient import Client

    assert callable(Client.connect) and callable(Client.disconnect)  # what connect_peer and disconnect_peer call


def test_every_compression_round_trips_with_8bit_headers_fixed(monkeypatch):
    import numpy
    import torch
    from hivemind.compression import quantization

    from distconf.dht import hivemind_p2p_compat as p2p_compat
    from distconf.rpc.protocol import COMPRESSIONS, deserialize_tensors, serialize_tensors

    monkeypatch.setattr(quantization, "np", numpy)  # hivemind's own, undone after the test
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(0))
    if tuple(int(p) for p in numpy.__version__.split(".")[:2]) >= (2, 4):
        with pytest.raises(Exception, match="only 0-dimensional arrays"):
            deserialize_tensors(serialize_tensors([x], compression=COMPRESSIONS["UNIFORM_8BIT"]))
    p2p_compat.scalar_headers_for_numpy()
    p2p_compat.scalar_headers_for_numpy()  # idempotent
    for name, code in COMPRESSIONS.items():
        restored, empty = deserialize_tensors(serialize_tensors([x, torch.empty(0)], compression=code))
        assert restored.shape == x.shape and empty.numel() == 0, name
        bound = {"NONE": 0.0, "FLOAT16": 1e-2, "MEANSTD_16BIT": 1e-2, "BLOCKWISE_8BIT": 0.1}.get(name, 2.0)
        assert (restored - x).abs().max().item() <= bound, name


# ----------------------------------------------------------------------------- 20. MPFuture locks after a kill
async def _hold_update_lock(_dht, _node) -> None:
    """In a DHT process: take hivemind's reply lock for ever (as a process killed while it sends a reply)."""
    import threading

    from hivemind.utils.mpfuture import MPFuture

    threading.Thread(target=MPFuture._update_lock.acquire, daemon=True).start()


def _update_lock_held() -> bool:
    from hivemind.utils.mpfuture import MPFuture

    if MPFuture._update_lock.acquire(block=False):
        MPFuture._update_lock.release()
        return False
    return True


KILLED_HOLDING_THE_LOCK = """
from distconf.dht import start_local_dht
from dhthelpers import wait_for
from test_hivemind_compat import _hold_update_lock, _update_lock_held
node = start_local_dht()
try:
    node.run_coroutine(_hold_update_lock, return_future=True)
    print("held", wait_for(_update_lock_held, timeout=30, interval=0.05), flush=True)
finally:
    node.kill_now()
try:
    after = start_local_dht(startup_timeout=15)
except TimeoutError as exc:
    print("next node:", exc)
else:
    print("next node ready; it answers:", bool(after.get_visible_maddrs()))  # a reply through the renewed lock
    after.shutdown()
"""


@pytest.mark.slow  # two DHT nodes and a 15 s bound on old code
def test_a_node_killed_holding_hiveminds_reply_lock_does_not_block_the_next_node():
    """A DHT process killed while it held ``MPFuture._update_lock`` (shared with its parent) left every later node of
    the parent unable to say it is ready; `NodeProcess.kill_now` renews the locks once no node is left. (In a
    process of its own: this one's module-scoped nodes are running.)"""
    import os
    import sys

    import forkserver

    tests = Path(__file__).resolve().parent
    done = forkserver.run([sys.executable, forkserver.script(KILLED_HOLDING_THE_LOCK)], timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tests.parent), str(tests)])})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["held True", "next node ready; it answers: True"], done.stdout
