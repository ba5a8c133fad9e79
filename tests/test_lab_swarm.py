"""The real model across hosts of the network lab: a flat network, failover, NAT and relays, identities.

Hosts are Linux network namespaces (`distconf.tools.netlab`) on an emulated internet with 10 ms one-way
delay per link: servers ``a`` (blocks 0:15, the swarm's first peer and the relay), ``b`` and ``d``
(15:30, public), a client host ``c``, a host ``e`` for restarts, and a home network behind a NAT router
with hosts ``n`` and ``m``.
Skipped with the reason where the machine cannot host the lab (not root, no ``ip``/``nft``).
"""

from __future__ import annotations

import ipaddress
import os
import signal
import stat
import time
from pathlib import Path
from typing import Any

import pytest
from dhthelpers import wait_for
from lab_swarm import group_pid, lab_address, namespace_pids, open_lab, ready, run_client, server_env, start_server
from real_helpers import open_real_source

from distconf.dht.addresses import is_loopback_maddr
from distconf.server.block_server import RELAY_PENALTY
from distconf.tools import real_model as rm
from distconf.tools.serving import stop_all

pytestmark = pytest.mark.swarm

ONE_WAY_MS = 10


class Swarm:
    """The lab, its hosts and the servers started on them."""

    def __init__(self, lab: Any, logs: Path, env: dict[str, str]) -> None:
        self.lab, self.logs, self.env = lab, logs, env
        self.servers: list[Any] = []
        self.a, self.b, self.c, self.d, self.e = (lab.host(name) for name in "abcde")
        self.home = lab.home("home")
        self.n, self.m = lab.host("n", home=self.home), lab.host("m", home=self.home)
        lab.default_link(delay_ms=ONE_WAY_MS)

    def serve(self, host: Any, name: str, *args: str) -> Any:
        server = start_server(host, self.logs, name, self.env, *args)
        self.servers.append(server)
        return server


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Any:
    lab = open_lab()
    with lab:
        swarm = Swarm(lab, tmp_path_factory.mktemp("lab"), server_env(request.config))
        # the README's recipe: the first server with --public-ip and --port, the others with --initial-peers
        a = swarm.serve(swarm.a, "a", "--new-swarm", "--public-ip", swarm.a.address, "--port", "31337",
                        "--blocks", "0:15")
        swarm.boot = lab_address(ready(a))
        b = swarm.serve(swarm.b, "b", "--initial-peers", swarm.boot, "--blocks", "15:30")
        d = swarm.serve(swarm.d, "d", "--initial-peers", swarm.boot, "--blocks", "15:30", "--host-maddrs",
                        swarm.d.maddr(31338))
        swarm.first = [a, b, d]
        for server in (b, d):
            ready(server)
        try:
            yield swarm
        finally:
            stop_all([s for s in swarm.servers if s.alive])


@pytest.fixture(scope="module")
def expected(request: pytest.FixtureRequest) -> list[int]:
    """The local model's greedy answer tokens (fp32)."""
    source = open_real_source(request.config)
    return rm.greedy_answer(rm.local_model(source.checkpoint_dir), source.load_tokenizer())[1]


def test_servers_on_lab_addresses_announce_only_addresses_others_can_dial(swarm):
    for server, host in zip(swarm.first, (swarm.a, swarm.b, swarm.d)):
        addresses = server.ready["addresses"]
        assert addresses and not any(is_loopback_maddr(m) for m in addresses), addresses
        assert all(f"/{host.address}/" in m for m in addresses), (host.address, addresses)
    assert swarm.first[0].ready["addresses"] == [f"/ip6/{swarm.a.address}/tcp/31337/p2p/{swarm.first[0].peer_id}"]
    assert swarm.first[2].ready["addresses"][0].startswith(f"/ip6/{swarm.d.address}/tcp/31338/p2p/")
    new_swarm_line = next(line for line in swarm.first[0].log_path.read_text().splitlines()
                          if line.startswith("new swarm:"))
    assert new_swarm_line == f"new swarm: --initial-peers {swarm.boot}"  # what the README tells to copy


def test_greedy_chat_answer_across_three_hosts_equals_the_local_model(swarm, expected):
    result = run_client(swarm.c, swarm.env, peers=[swarm.boot])
    assert "error" not in result, result
    assert result["tokens"] == expected
    assert result["text"] == rm.ANSWER


def test_a_server_behind_nat_serves_through_a_relay(swarm, expected):
    relayed = swarm.serve(swarm.n, "n", "--initial-peers", swarm.boot, "--blocks", "15:30")
    record = ready(relayed)
    assert not any(is_loopback_maddr(m) for m in record["addresses"])
    a_peer = swarm.first[0].peer_id
    result = run_client(swarm.c, swarm.env, peers=[swarm.boot], allowed_servers=[a_peer, relayed.peer_id])
    assert "error" not in result, result
    assert result["tokens"] == expected
    records = result["records"]
    assert records[relayed.peer_id]["using_relay"] is True
    assert records[a_peer]["using_relay"] is False
    # Petals' relay penalty: x 0.2 on the throughput each server derives from its own measured speed (both serve
    # 15 blocks), compared per measured request rate: each measured its own speed under whatever load there was
    direct, relayed_record = records[swarm.first[1].peer_id], records[relayed.peer_id]
    assert relayed_record["throughput"] / relayed_record["forward_rps"] == pytest.approx(
        RELAY_PENALTY * direct["throughput"] / direct["forward_rps"], rel=1e-3)
    log = relayed.log_path.read_text()
    assert "reached relayed through" in log


@pytest.mark.parametrize("claim", [(), ("--public-ip", "ROUTER", "--port", "31339")], ids=["lan-address", "no-forward"])
def test_a_server_behind_nat_without_relays_is_never_announced_and_exits_2(swarm, claim):
    """Behind NAT with relays off: announcing its LAN address (dials fail at once), or its router's public address
    with a port nobody forwarded (dials time out): never announced, one line, exit 2."""
    claim = tuple(swarm.home.address if a == "ROUTER" else a for a in claim)
    server = swarm.serve(swarm.m, "m", "--initial-peers", swarm.boot, "--blocks", "15:30", "--no-relay", *claim)
    code = server.proc.wait(180)
    server.stop()
    out = server.log_path.read_text()
    assert code == 2, out[-2000:]
    errors = [line for line in out.splitlines() if line.startswith("distconf serve:")]
    assert len(errors) == 1 and "peers cannot reach this server" in errors[0] and "--no-relay" in errors[0]
    assert "--public-ip" in errors[0]
    assert "Traceback" not in out and "DISTCONF_READY" not in out and "SERVING" not in out


def test_identity_path_keeps_the_peer_id_across_restarts(swarm, tmp_path):
    key = tmp_path / "server.key"
    args = ("--initial-peers", swarm.boot, "--blocks", "0:2", "--identity-path", str(key))
    first = swarm.serve(swarm.e, "id1", *args)
    peer = ready(first)["peer_id"]
    assert first.stop() == 0
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    second = swarm.serve(swarm.e, "id2", *args)
    assert ready(second)["peer_id"] == peer
    assert second.stop() == 0
    key.chmod(0o644)
    third = swarm.serve(swarm.e, "id3", *args)
    assert third.proc.wait(120) == 2
    third.stop()
    errors = [line for line in third.log_path.read_text().splitlines() if line.startswith("distconf serve:")]
    assert len(errors) == 1 and "too open" in errors[0], errors


def test_a_server_nobody_can_dial_is_one_clear_error_in_bounded_time(swarm):
    """Told to skip the check and relays, a server behind NAT announces itself and nobody can dial it: a client
    routed only through it (allowed_servers) bans it at its first failed dial and ends, within its retries,
    with one error naming it and why."""
    undialable = swarm.serve(swarm.m, "u", "--initial-peers", swarm.boot, "--blocks", "15:30",
                             "--skip-reachability-check", "--no-relay")
    peer = ready(undialable)["peer_id"]
    start = time.monotonic()
    result = run_client(swarm.c, swarm.env, peers=[swarm.boot], allowed_servers=[swarm.first[0].peer_id, peer])
    elapsed = time.monotonic() - start
    undialable.stop()
    assert "error" in result and peer in result["error"] and "failed after 4 attempt(s)" in result["error"], result
    assert "\n" not in result["error"]
    assert elapsed < 90, elapsed  # model load, 4 attempts and 1 + 2 + 4 s of backoff


def test_a_failover_across_hosts_gives_the_same_tokens(swarm, expected):
    pids = {s.peer_id: group_pid(s) for s in swarm.first[1:] if s.alive}
    result = run_client(swarm.c, swarm.env, peers=[swarm.boot], allowed_servers=[swarm.first[0].peer_id, *pids],
                        kill_after=3, pids=pids, client={"ban_timeout": 600})
    assert "error" not in result, result
    assert result["killed"] and result["killed"][0] in pids
    assert result["failovers"] == 1
    assert result["tokens"] == expected


def test_a_server_whose_peers_vanished_stops_within_10_s_and_leaves_nothing(swarm):
    survivor = next(s for s in swarm.first[1:] if s.alive)
    host = swarm.b if survivor is swarm.first[1] else swarm.d
    for other in (swarm.a, swarm.c, swarm.home):  # its peers' hosts drop off the network
        swarm.lab.link(host, other, loss=1.0)
    swarm.first[0].kill()
    start = time.monotonic()
    os.killpg(group_pid(survivor), signal.SIGTERM)
    survivor.proc.wait(30)
    wait_for(lambda: not namespace_pids(host), timeout=15 - (time.monotonic() - start), interval=0.05)
    elapsed = time.monotonic() - start
    assert survivor.proc.returncode == 0
    assert namespace_pids(host) == [] and elapsed <= 10, (elapsed, namespace_pids(host))
    swarm.lab.clear_links()


def test_lab_internet_addresses_are_public_to_libp2p_and_never_routed(swarm):
    for host in (swarm.a, swarm.b, swarm.d):
        ip = ipaddress.ip_address(host.address)
        assert ip in ipaddress.ip_network("2001:db8::/32") and not ip.is_loopback
