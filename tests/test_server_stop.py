"""A clean stop: SIGINT or SIGTERM to a server (or a client), or to its whole process group.

Each real ``distconf serve`` process runs in a session of its own: after the signal it
must exit within `STOP_LIMIT` seconds, its OFFLINE record must be readable from a DHT peer
that stays up, and no process of its session (its DHT node, the p2p daemon) may be left.
A client process (a user's program holding a DHT node) must leave nothing behind either,
however it ends.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import forkserver
import psutil
import pytest
from client_swarm import REPO, START_DEADLINE, start_server
from dhthelpers import wait_until
from swarm_harness import Swarm

from distconf.dht import ServerState, find_servers_by_prefix, visible_maddrs
from distconf.tools.serving import ServerProcess

pytestmark = pytest.mark.swarm

STOP_LIMIT = 20.0
"""Seconds a signalled server may take to exit."""
LEFT_LIMIT = 3.0
"""Seconds the processes of an exited server's (or client's) session may take to be gone."""

CLIENT = """
import signal, sys, time
# Ctrl-C as a terminal delivers it, whatever the test worker that starts this process ignores or blocks
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
from distconf.dht import start_local_dht
dht = start_local_dht(sys.argv[1:], client_mode=True)
print("READY", flush=True)
time.sleep(120)
"""

UNTIL_END_OF_INPUT = """
import sys
print("READY", flush=True)
sys.stdin.read()  # a demo server's stdin pump: it stops when its input ends
print("END", flush=True)
"""


def session_processes(sid: int) -> list[psutil.Process]:
    """The live (not zombie) processes of session ``sid``."""
    found = []
    for proc in psutil.process_iter(["status"]):
        try:
            if os.getsid(proc.pid) == sid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (ProcessLookupError, PermissionError):
            continue
    return found


def processes_left(sid: int, before: list[psutil.Process], limit: float = LEFT_LIMIT) -> list[str]:
    """What is still running, ``limit`` seconds at most after the leader exited, of the session and of ``before``."""
    def running() -> dict[int, psutil.Process]:
        left = {p.pid: p for p in session_processes(sid)}
        left.update({p.pid: p for p in before if p.is_running() and p.status() != psutil.STATUS_ZOMBIE})
        return left

    return [f"{pid} {p.name()}" for pid, p in wait_until(running, lambda left: not left, limit, 0.1).items()]


def deliver(proc: subprocess.Popen, sig: int, target: str) -> None:
    """Send ``sig`` to the process alone or to its whole process group (as ``kill -- -PGID`` does)."""
    if target == "group":
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    """A bootstrap DHT node that stays up (the peer the OFFLINE records are read from) and a tiny model."""
    with Swarm(tmp_path_factory.mktemp("stop"), "llama", layers=2) as s:
        yield s.dht, s.model_dir, s.root


@pytest.mark.parametrize("target", ["process", "group"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_server_stops_cleanly(swarm, sig, target):
    boot, model_dir, root = swarm
    log = root / f"server-{sig.name}-{target}.log"
    server = start_server(model_dir, visible_maddrs(boot), "0:2", log)
    try:
        ready = server.wait_ready(time.monotonic() + START_DEADLINE)
        before = session_processes(server.proc.pid)
        assert "p2pd" in [p.name() for p in before] and len(before) >= 3, before  # server, DHT node, p2pd
        started = time.monotonic()
        deliver(server.proc, sig, target)
        code = server.proc.wait(STOP_LIMIT)
        took = time.monotonic() - started
        left = processes_left(server.proc.pid, before)
        assert code == 0, server.log_tail()
        assert not left, f"left behind: {left}"
        assert took < STOP_LIMIT
        state = find_servers_by_prefix(boot, ready["dht_prefix"], 2, timeout=20)
        spans = [span for span in state.spans if span.peer_id == server.peer_id]
        assert spans and {span.state for span in spans} == {ServerState.OFFLINE}, (spans, server.log_tail())
        text = Path(log).read_text()
        assert "announcing OFFLINE" in text
        assert "hard way" not in text and "did not stop" not in text  # the DHT node stopped when asked
    finally:
        server.stop(timeout=1.0)  # kills whatever is left of its group


@pytest.mark.parametrize(("sig", "target"), [(signal.SIGINT, "group"), (signal.SIGTERM, "process"),
                                             (signal.SIGTERM, "group"), (signal.SIGKILL, "group")],
                         ids=["ctrl-c", "SIGTERM", "SIGTERM-group", "SIGKILL-group"])
def test_client_leaves_no_process(swarm, sig, target):
    boot, _, root = swarm
    cmd = [sys.executable, forkserver.script(CLIENT), *visible_maddrs(boot)]  # forked (tests/forkserver.py)
    client = ServerProcess(cmd, root / f"client-{sig.name}-{target}.log", name="client",
                           env={"PYTHONPATH": str(REPO)})
    try:
        client.expect("READY", time.monotonic() + START_DEADLINE)
        before = session_processes(client.proc.pid)
        assert "p2pd" in [p.name() for p in before], before
        deliver(client.proc, sig, target)
        client.proc.wait(STOP_LIMIT)
        left = processes_left(client.proc.pid, before)
        assert not left, f"left behind: {left}"
    finally:
        client.stop(timeout=1.0)


def test_server_sees_the_end_of_its_input_after_the_parent_forked(tmp_path):
    """A server asked to stop by closing its stdin stops at once, though the parent forked a process meanwhile.

    The demo's client starts its DHT node (a fork of the orchestrator) after the servers: the fork
    inherited every server's stdin pipe, so no server saw its input end, each stop waited the whole
    timeout and the server was signalled (under load, killed while it announced OFFLINE).
    """
    server = ServerProcess([sys.executable, "-c", UNTIL_END_OF_INPUT], tmp_path / "server.log", name="reader",
                           stdin=True)
    forked = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,), daemon=True)
    try:
        server.expect("READY", time.monotonic() + START_DEADLINE)
        forked.start()  # as hivemind starts a DHT node: it holds what this process held, until it exits
        started = time.monotonic()
        code = server.stop(timeout=10.0)
        took = time.monotonic() - started
        assert code == 0 and took < 5.0, (code, took, server.log_tail())
        assert "END" in server.log_tail()
    finally:
        server.kill()
        if forked.is_alive():
            forked.kill()
        forked.join(5)
