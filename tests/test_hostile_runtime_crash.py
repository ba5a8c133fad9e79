"""Peers that try to crash a process, and processes that die anyway (issue 22: crashes and orphans).

Against one real ``distconf serve`` process (shared by the module) a hostile client
(`hostile_client.HostileClient`) sends metadata nested too deep for any reader: hivemind
tuples 400 deep (each level a nested C decode: they used to kill the server with SIGSEGV),
plain msgpack arrays and maps past msgpack's own stack, lists 990 deep as ``args_structure``
(a RecursionError and a traceback per request before), and tuples of deep lists, through
``rpc_forward``, the first message of ``rpc_inference`` and ``rpc_push``. After each case the
victim is checked as the issue's attack run did (`hostile_client.Victim`). A test-only server
whose ``rpc_info`` reply is nested 400 deep must not crash the real client, which generates
the right tokens anyway. Then real servers and clients are killed with SIGKILL and SIGSEGV:
none of their child processes (the DHT node, p2pd) may outlive them, and a killed server's
records say OFFLINE (its DHT node's last will) instead of ONLINE until they expire.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

import forkserver
import msgpack
import psutil
import pytest
import torch
from client_swarm import REPO, START_DEADLINE, start_server
from dhthelpers import wait_until
from hostile_client import HostileClient, Victim, raw_request
from swarm_harness import Swarm as HarnessSwarm
from swarm_harness import swarm_fixture

from distconf.dht import ServerState
from distconf.dht.wire import TUPLE_EXT_CODE
from distconf.tools.serving import ServerProcess

pytestmark = pytest.mark.swarm

CHILDREN_LIMIT = 30.0
"""Seconds the children of a killed process may take to be gone (the DHT child polls its parent)."""
RSS_SLACK_MIB = 200.0
"""Most the victim's RSS may grow over the whole module (its baseline is taken after warm-up)."""


# ----------------------------------------------------------------------------- crafted msgpack
def tuples(levels: int, leaf: bytes = b"\xc0") -> bytes:
    """hivemind tuples nested ``levels`` deep (each one a msgpack extension holding a 1-array)."""
    value = leaf
    for _ in range(levels):
        value = msgpack.packb(msgpack.ExtType(TUPLE_EXT_CODE, b"\x91" + value))
    return value


def lists(levels: int, leaf: bytes = b"\xc0") -> bytes:
    """Plain msgpack arrays nested ``levels`` deep."""
    return b"\x91" * levels + leaf


def maps(levels: int) -> bytes:
    """Plain msgpack maps nested ``levels`` deep."""
    return b"\x81\xa1k" * levels + b"\xc0"


def dictionaries(levels: int, leaf: bytes = b"\xc0") -> bytes:
    """hivemind's registered ``DictionaryDHTValue`` nested ``levels`` deep (decoded by hivemind's own loads)."""
    from hivemind.dht.storage import DictionaryDHTValue
    from hivemind.utils.serializer import MSGPackSerializer

    code = next(c for c, t in MSGPackSerializer._ext_type_codes.items() if t is DictionaryDHTValue)
    for _ in range(levels):  # [maxsize, latest expiration, [(key, value, expiration)]]
        leaf = msgpack.packb(msgpack.ExtType(code, b"\x93\x00\x00\x91\x93\xa1k" + leaf + b"\x00"))
    return leaf


def metadata(deep: bytes, **fields: Any) -> bytes:
    """A msgpack dict of ``fields`` with ``args_structure`` = the ``deep`` bytes (written as is)."""
    head = b"".join(msgpack.packb(k) + msgpack.packb(v) for k, v in fields.items())
    return bytes([0x80 | (len(fields) + 1)]) + head + msgpack.packb("args_structure") + deep  # a fixmap


DEEP = {
    "tuples-400": tuples(400),
    "lists-990": lists(990),
    "lists-5000": lists(5000),  # past msgpack's 1,024-level stack
    "maps-5000": maps(5000),
    "tuples-30-of-lists-1000": tuples(30, lists(1000)),  # 30,000 levels in 30 nested decodes
    "dictionaries-400": dictionaries(400),
}


# ----------------------------------------------------------------------------- the swarm
class Swarm(HarnessSwarm):
    """The harness's bootstrap DHT, a tiny 2-block model, the victim server and the hostile client."""

    def build(self) -> None:
        from distconf.rpc import chain_uid

        self.model_dir, self.local = self.add_model("llama", layers=2)
        self.uid = chain_uid(self.config.dht_prefix, 0, 2)
        self.server = self.start_server(self.model_dir, "0:2", log="victim.log")
        self.wait_ready()
        self.client = HostileClient(self.dht)
        self.on_close(self.client.shutdown)
        self.victim = Victim(self.server, self.client, self.uid, self.config.hidden_size)
        self.baseline_rss = self.victim.rss_mib()


swarm = swarm_fixture("crash", None, cls=Swarm)


def check_victim(swarm: Swarm, mark: int) -> None:
    """The issue's checks after a case: alive, honest callers unaffected, budget full, a quiet log, bounded RSS."""
    assert swarm.victim.unaffected() == []
    log = swarm.victim.log_since(mark)
    assert "Traceback" not in log, log[-3000:]
    honest_session = ("rpc_inference.open(blocks=0:2", "rpc_inference.close(blocks=0:2")  # the check's own
    attack = [line for line in log.splitlines() if not any(tag in line for tag in honest_session)]
    assert len(attack) <= 2, log[-3000:]  # the refusal (and the stream's end), not a flood
    assert swarm.victim.rss_mib() < swarm.baseline_rss + RSS_SLACK_MIB


# ----------------------------------------------------------------------------- crashes: server side
@pytest.mark.parametrize("case", list(DEEP))
def test_deep_metadata_in_a_forward_is_refused(swarm: Swarm, case: str) -> None:
    mark = swarm.victim.log_mark()
    request = raw_request(swarm.uid, [swarm.victim.hidden(2, 9), torch.empty(0)], metadata(DEEP[case]))
    outcome, detail = swarm.client.forward(swarm.server.peer_id, request)
    assert outcome == "refused", detail
    check_victim(swarm, mark)


@pytest.mark.parametrize("case", list(DEEP))
def test_deep_metadata_in_the_first_inference_message_is_refused(swarm: Swarm, case: str) -> None:
    mark = swarm.victim.log_mark()
    first = raw_request(swarm.uid, [swarm.victim.hidden(2, 9), torch.empty(0), torch.empty(0, dtype=torch.int64)],
                        metadata(DEEP[case], max_length=16, session_id=f"deep-{case}", step_id="s0"))
    outcome, detail = swarm.client.inference(swarm.server.peer_id, [first])
    assert outcome == "refused", detail
    check_victim(swarm, mark)


@pytest.mark.parametrize("case", list(DEEP))
def test_deep_metadata_in_a_push_is_refused(swarm: Swarm, case: str) -> None:
    mark = swarm.victim.log_mark()
    request = raw_request(swarm.uid, [swarm.victim.hidden(1, 9), torch.empty(0), torch.empty(0, dtype=torch.int64)],
                          metadata(DEEP[case], session_id="no-such-session", step_id="s1"))
    swarm.client.push(swarm.server.peer_id, request)  # answered or refused: a push is never acknowledged
    check_victim(swarm, mark)


def test_the_args_structure_refusal_is_one_line(swarm: Swarm) -> None:
    mark = swarm.victim.log_mark()
    request = raw_request(swarm.uid, [swarm.victim.hidden(2, 9), torch.empty(0)], metadata(lists(990)))
    outcome, detail = swarm.client.forward(swarm.server.peer_id, request)
    assert outcome == "refused" and "nested more than" in detail, detail
    log = swarm.victim.log_since(mark)
    assert "RecursionError" not in log and "Traceback" not in log, log[-3000:]


# ----------------------------------------------------------------------------- crashes: client side
DEEP_INFO_SERVER = """
import sys, time
import msgpack
from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2
from distconf.dht import ServerInfo, ServerState, announce_blocks, start_local_dht
from distconf.loader.auto import AutoDistributedConfig
from distconf.rpc import BlockServicer, RpcLoop

model_dir, peers = sys.argv[1], sys.argv[2:]
deep = b"\\xc0"
for _ in range(400):
    deep = msgpack.packb(msgpack.ExtType(0x40, b"\\x91" + deep))
reply = b"\\x81" + msgpack.packb("inference_schema") + deep


class DeepInfo(BlockServicer):
    async def rpc_info(self, request: runtime_pb2.ExpertUID, context: P2PContext) -> runtime_pb2.ExpertInfo:
        print("INFO", flush=True)
        return runtime_pb2.ExpertInfo(serialized_info=reply)


config = AutoDistributedConfig.from_pretrained(model_dir)
dht = start_local_dht(peers)
loop = RpcLoop(dht)
loop.run(DeepInfo().add_p2p_handlers(loop.p2p), timeout=30)
announce_blocks(dht, config, 0, 2, ServerInfo(state=ServerState.ONLINE, throughput=1e9), expiration=600)
print("READY", dht.peer_id.to_base58(), flush=True)
sys.stdin.read()  # until the test closes our input
loop.shutdown()
dht.shutdown()
"""


INFO_PROBE = """
import sys
from distconf.dht import start_local_dht
from distconf.rpc import RpcLoop, call_info
dht = start_local_dht(sys.argv[2:], client_mode=True)
loop = RpcLoop(dht)
try:
    loop.run(call_info(loop.p2p, sys.argv[1], timeout=30), timeout=35)
    print("ACCEPTED")
except Exception as exc:
    print("REFUSED", type(exc).__name__, exc)
loop.shutdown()
dht.shutdown()
"""


def run_client(*args: str) -> subprocess.CompletedProcess[str]:
    """A client process (a crash is its exit code, not this test process's)."""
    return forkserver.run([sys.executable, *args], timeout=300, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_a_server_replying_deep_rpc_info_does_not_crash_the_client(swarm: Swarm) -> None:
    hostile = ServerProcess([sys.executable, forkserver.script(DEEP_INFO_SERVER), str(swarm.model_dir), *swarm.peers],
                            swarm.root / "deep-info.log", name="deep-info", env={"PYTHONPATH": str(REPO)}, stdin=True)
    try:
        peer = hostile.expect("READY", time.monotonic() + START_DEADLINE).split()[1]
        probe = run_client(forkserver.script(INFO_PROBE), peer, *swarm.peers)
        result = run_client("-m", "distconf.cli.cmd_generate", str(swarm.model_dir), "--initial-peers", *swarm.peers,
                            "--ids", "5,17,42", "--max-new-tokens", "4")
        asked = hostile.log_tail(10**6).count("INFO")
    finally:
        hostile.stop()
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert probe.stdout.startswith("REFUSED ProtocolError"), probe.stdout
    assert "nests tuples more than" in probe.stdout
    assert result.returncode == 0, result.stderr[-3000:]
    ids = torch.tensor([[5, 17, 42]])
    expected = swarm.local.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                                    pad_token_id=0)[0, 3:].tolist()
    assert [int(t) for t in result.stdout.split()] == expected
    assert asked >= 2  # the probe's call, and the generating client's own: it read the reply and went on


# ----------------------------------------------------------------------------- orphans
CLIENT = """
import sys, time
import torch
from distconf.client import AutoDistributedModelForCausalLM
model = AutoDistributedModelForCausalLM.from_pretrained(sys.argv[1], initial_peers=sys.argv[2:])
ids = torch.tensor([[5, 17, 42]])
model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, pad_token_id=0)
print("READY", flush=True)
time.sleep(600)
"""


def children_left(pid: int, sig: int, proc: subprocess.Popen) -> tuple[list[str], list[str]]:
    """Kill ``pid`` with ``sig``; return its children before, and those still running ``CHILDREN_LIMIT`` s later."""
    children = psutil.Process(pid).children(recursive=True)
    names = [f"{c.pid} {c.name()}" for c in children]
    os.kill(pid, sig)
    proc.wait(60)
    assert proc.returncode == -sig
    left = wait_until(lambda: [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE],
                      lambda left: not left, CHILDREN_LIMIT, 0.1)
    return names, [f"{c.pid} {c.name()}" for c in left]


def reap(names: list[str]) -> None:
    """SIGKILL what a failed test left running (pids it named itself)."""
    for entry in names:
        try:
            psutil.Process(int(entry.split()[0])).kill()
        except psutil.Error:
            pass


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSEGV], ids=["SIGKILL", "SIGSEGV"])
def test_a_killed_server_takes_its_children_with_it(swarm: Swarm, sig: int) -> None:
    server = start_server(swarm.model_dir, swarm.peers, "0:2", swarm.root / f"killed-{sig}.log")
    names: list[str] = []
    try:
        server.wait_ready(time.monotonic() + START_DEADLINE)
        names, left = children_left(server.proc.pid, sig, server.proc)
    finally:
        server.stop()
    reap(names)
    assert any("p2pd" in n for n in names) and any("python" in n for n in names), names  # the DHT child, p2pd
    assert left == []
    assert announced_states(swarm, server.peer_id) == {ServerState.OFFLINE}  # its DHT child's last will


def announced_states(swarm: Swarm, peer_id: str, limit: float = CHILDREN_LIMIT) -> set[Any]:
    """The states ``peer_id``'s records say, once they all say OFFLINE or ``limit`` seconds from now."""
    from distconf.dht import find_servers_by_prefix

    def states() -> set[Any]:
        found = find_servers_by_prefix(swarm.dht, swarm.config.dht_prefix, 2, timeout=10)
        return {span.state for span in found.spans if span.peer_id == peer_id}

    return wait_until(states, lambda s: s == {ServerState.OFFLINE}, limit, 0.25)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSEGV], ids=["SIGKILL", "SIGSEGV"])
def test_a_killed_client_takes_its_children_with_it(swarm: Swarm, sig: int) -> None:
    client = ServerProcess([sys.executable, forkserver.script(CLIENT), str(swarm.model_dir), *swarm.peers],
                           swarm.root / f"client-{sig}.log", name="client", env={"PYTHONPATH": str(REPO)})
    names: list[str] = []
    try:
        client.expect("READY", time.monotonic() + START_DEADLINE)
        names, left = children_left(client.proc.pid, sig, client.proc)
    finally:
        client.stop()
    reap(names)
    assert any("p2pd" in n for n in names) and any("python" in n for n in names), names
    assert left == []
