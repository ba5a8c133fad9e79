"""The network lab does what it says: link delays as asked, NAT that keeps outsiders out, nothing left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from dhthelpers import wait_for

from distconf.tools.netlab import Lab, LabUnavailable
from distconf.tools.netlab.system import PREFIX, lab_namespaces, sweep_stale

pytestmark = pytest.mark.swarm


@pytest.fixture(scope="module")
def lab():
    try:
        lab = Lab()
    except LabUnavailable as exc:
        pytest.skip(str(exc))
    with lab:
        yield lab


@pytest.fixture(scope="module")
def hosts(lab):
    a, b = lab.host("a"), lab.host("b")
    home = lab.home("home")
    n = lab.host("n", home=home)
    return a, b, home, n


@pytest.mark.parametrize("one_way_ms", [5, 25, 50])
def test_round_trip_is_twice_the_one_way_delay_asked_within_10_percent(lab, hosts, one_way_ms):
    a, b, *_ = hosts
    lab.default_link(delay_ms=one_way_ms)
    median, low, _ = lab.round_trip_ms(a, b, count=30)
    assert abs(median - 2 * one_way_ms) <= 0.1 * 2 * one_way_ms, (median, low)


def test_a_link_set_by_name_differs_from_the_default_and_each_direction_counts(lab, hosts):
    a, b, *_ = hosts
    lab.default_link(delay_ms=1)
    lab.link(a, b, delay_ms=20, both_ways=False)  # a -> b only
    median, _, _ = lab.round_trip_ms(a, b, count=10)
    assert 19 <= median <= 25, median  # 20 ms one way + 1 ms back
    lab.clear_links()
    median, _, _ = lab.round_trip_ms(a, b, count=10)
    assert median < 5, median


def test_bandwidth_is_capped_at_the_link_rate(lab, hosts):
    a, b, *_ = hosts
    lab.default_link(delay_ms=2)
    fast = lab.throughput_mbit(a, b, size=2 << 20)
    lab.default_link(delay_ms=2, rate_mbit=8)
    slow = lab.throughput_mbit(a, b, size=2 << 20)
    lab.default_link()
    assert 4 <= slow <= 8.0, slow  # IP and TCP headers ride on the same 8 Mbit/s
    assert fast > 2 * slow, (fast, slow)


def test_lossy_link_drops_about_the_share_asked(lab, hosts):
    a, b, *_ = hosts
    lab.default_link(loss=0.3)
    before = lab.stats()["links"].get("a>b", {"carried": 0, "dropped": 0})

    def counted() -> tuple[int, int] | None:
        after = lab.stats()["links"].get("a>b", {"carried": 0, "dropped": 0})
        carried, dropped = after["carried"] - before["carried"], after["dropped"] - before["dropped"]
        return (carried, dropped) if carried + dropped >= sent else None

    sent = lab.send_datagrams(a, b, count=400)  # UDP: no retransmits, no back-off (TCP's took 84 s once, at 30 %)
    carried, dropped = wait_for(counted, timeout=10) or (0, 0)
    assert carried + dropped >= sent, (carried, dropped)
    assert 0.2 <= dropped / (carried + dropped) <= 0.4, (carried, dropped)  # 400 draws: sd 0.023
    lab.default_link(loss=0.1)
    assert lab.throughput_mbit(a, b, size=64 << 10) > 0  # TCP retransmits: a transfer still completes
    lab.default_link()


def test_jitter_spreads_round_trips_without_moving_their_median(lab, hosts):
    a, b, *_ = hosts
    lab.default_link(delay_ms=10, jitter_ms=3)
    median, low, high = lab.round_trip_ms(a, b, count=40)
    lab.default_link()
    assert 17 <= median <= 23, median
    assert high - low > 4, (low, high)


def test_a_host_behind_nat_dials_out_but_cannot_be_dialled(lab, hosts):
    a, b, home, n = hosts
    lab.default_link(delay_ms=1)
    median, _, _ = lab.round_trip_ms(n, b, count=3)  # out through its router: works
    assert median < 10
    # From outside: the private address has no route, the router drops what nobody inside asked for.
    assert lab.dial(a, n.address, 7001, timeout=2) == "Network is unreachable"
    assert lab.dial(a, home.address, 7001, timeout=2) == "TimeoutError"
    # The NAT'd host itself listens (the echo server is inside it): only NAT keeps a out.
    assert lab.round_trip_ms(n, n, count=1)[0] < 5


def test_lab_addresses_are_documentation_and_private_ranges_only(lab, hosts):
    import ipaddress

    a, b, home, n = hosts
    for address in (a.address, b.address, home.address):
        assert ipaddress.ip_address(address) in ipaddress.ip_network("2001:db8::/32")  # never routed outside
    assert ipaddress.ip_address(n.address).is_private


def _namespaces_of(pid: int) -> list[str]:
    return [name for name in lab_namespaces() if name.startswith(f"{PREFIX}{pid}-")]


CHILD = textwrap.dedent("""
    import subprocess, sys, time
    from distconf.tools.netlab import Lab
    with Lab() as lab:
        host = lab.host("x")
        sleeper = host.popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print(sleeper.pid, flush=True)
        time.sleep(600)
""")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_lab_removes_its_namespaces_and_processes(lab, sig):
    # Ctrl-C reaches the child even when this test runs in a background job (which ignores SIGINT)
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        sleeper = int(child.stdout.readline())
        assert _namespaces_of(child.pid)
        child.send_signal(sig)
        child.wait(30)
    finally:
        child.kill()
        child.stdout.close()
    assert _namespaces_of(child.pid) == []
    with pytest.raises(ProcessLookupError):
        os.kill(sleeper, 0)


def test_a_killed_labs_namespaces_are_swept_by_the_next(lab):
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        int(child.stdout.readline())
        child.kill()
        child.wait(10)
    finally:
        child.stdout.close()
    left = _namespaces_of(child.pid)
    assert left  # SIGKILL leaves them

    def swept() -> bool:
        sweep_stale()  # what every new Lab() does first
        return not _namespaces_of(child.pid)

    wait_for(swept, timeout=10, interval=0.05)
    assert _namespaces_of(child.pid) == []


def test_without_root_the_lab_says_why(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(LabUnavailable, match="needs root"):
        Lab()
