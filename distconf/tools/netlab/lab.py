"""A network lab on one machine: hosts on an emulated internet, homes behind NAT routers, links with delay.

Each host is a Linux network namespace. Public hosts sit directly on the lab's internet; a *home* is a
NAT router (its own namespace, nftables masquerade, no inbound connections) with hosts on its LAN
behind it. The internet between them is one user-space process (`distconf.tools.netlab.wire`) that
carries every packet between hosts with the one-way delay, jitter, bandwidth and loss of the link it
crosses, all settable at any time::

    with Lab() as lab:
        a, b = lab.host("a"), lab.host("b")
        home = lab.home("home")
        n = lab.host("n", home=home)          # behind home's NAT: can dial out, cannot be dialled
        lab.link(a, b, delay_ms=25)           # both directions; lab.default_link(...) for every other pair
        server = b.popen(["distconf", "serve", ...])   # a process inside host b's namespace
        print(a.address, n.address, home.address)

Addresses exist only inside the namespaces the lab creates: the internet is ``internet`` (by default
``2001:db8:d15c::/48``, in the IPv6 documentation prefix that is never routed on the real internet, and
which libp2p counts as public, as it should for an internet; an IPv4 network may be given instead), home
LANs are private (``fd00:…/64`` or ``192.168.K.0/24``). Nothing inside the lab can reach the machine's
own network, and nothing outside can reach the lab.

Everything the lab creates (processes it started, namespaces, devices, the wire process) is removed by
`Lab.close` (the ``with`` block's end, an exception or Ctrl-C included); a lab killed outright is swept
by the next one (`distconf.tools.netlab.system.sweep_stale`). `Lab()` raises
`distconf.tools.netlab.system.LabUnavailable` with the reason when the machine cannot host it.
"""

from __future__ import annotations

import atexit
import ipaddress
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from typing import Any

from distconf.tools.netlab.hosts import Home, Host
from distconf.tools.netlab.links import LinkSpec
from distconf.tools.netlab.system import (
    PREFIX,
    check_lab_support,
    delete_namespace,
    kill_namespace_processes,
    run,
    sweep_stale,
)

__all__ = ["DEFAULT_INTERNET", "Home", "Host", "Lab", "Link"]

logger = logging.getLogger(__name__)

Link = LinkSpec
"""One direction of a link: ``delay_ms``, ``jitter_ms``, ``rate_mbit`` (0: unlimited), ``loss``, ``queue_packets``."""

DEFAULT_INTERNET = "2001:db8:d15c::/48"
"""The lab internet's addresses: IPv6 documentation space (RFC 3849), never routed outside; public to libp2p."""
STOP_GRACE = 5.0
"""Seconds a process the lab started has to exit after SIGTERM at close, before SIGKILL."""


class Lab:
    """Hosts, homes and links (see the module docstring); a context manager that removes what it made."""

    def __init__(self, internet: str = DEFAULT_INTERNET, default: Link | None = None) -> None:
        check_lab_support()
        swept = sweep_stale()
        if swept:
            logger.info("removed %d namespaces left by labs that were killed: %s", len(swept), ", ".join(swept))
        self.internet = ipaddress.ip_network(internet)
        self._addresses = self.internet.hosts()
        next(self._addresses)  # ::1 / .1 stays unused
        self._namespaces: list[str] = []
        self._processes: list[subprocess.Popen[Any]] = []
        self.hosts: dict[str, Host] = {}
        self.homes: dict[str, Home] = {}
        self.number = next(_lab_numbers)
        """Distinguishes the namespaces of labs made one after another by one process."""
        self._closed = False
        self._lock = threading.Lock()
        self._previous_sigterm = _exit_on_sigterm()
        _open_labs.add(self)
        try:
            self._wire = subprocess.Popen([sys.executable, "-m", "distconf.tools.netlab.wire"],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
            hello = self._read_answer()
            self.realtime = bool(hello.get("realtime"))
            """Whether the wire runs at a real-time priority (its timers then keep ~0.1 ms under load)."""
            if default is not None:
                self.default_link(**asdict(default))
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ building

    def host(self, name: str, *, home: Home | None = None) -> Host:
        """A new host: on the internet, or on ``home``'s LAN behind its NAT."""
        self._check_name(name)
        namespace = self._namespace(name)
        if home is None:
            address = str(next(self._addresses))
            self._wan(name, namespace, address)
        else:
            address = str(home.lan[len(home.hosts) + 2])
            index = len(self._namespaces)
            run(["ip", "link", "add", "name", "eth0", "netns", namespace, "type", "veth",
                 "peer", "name", f"lan{index}", "netns", home.namespace])
            run(["ip", "-n", home.namespace, "link", "set", f"lan{index}", "master", "br0", "up"])
            self._address(namespace, "eth0", address, home.lan.prefixlen)
            run(["ip", "-n", namespace, "link", "set", "eth0", "up"])
            run(["ip", "-n", namespace, "route", "add", "default", "via", str(home.lan[1])])
        host = Host(self, name, namespace, address, home)
        if home is not None:
            home.hosts.append(host)
        self.hosts[name] = host
        return host

    def home(self, name: str) -> Home:
        """A new home: a NAT router on the internet with an empty private LAN (add hosts with ``host(home=)``)."""
        self._check_name(name)
        namespace = self._namespace(name)
        address = str(next(self._addresses))
        self._wan(name, namespace, address)
        index = len(self.homes) + 1
        if self.internet.version == 6:
            lan = ipaddress.ip_network(f"fd00:d15c:{index:x}::/64")
        else:
            lan = ipaddress.ip_network(f"192.168.{index}.0/24")
        run(["ip", "-n", namespace, "link", "add", "br0", "type", "bridge"])
        self._address(namespace, "br0", str(lan[1]), lan.prefixlen)
        run(["ip", "-n", namespace, "link", "set", "br0", "up"])
        family = "ip6" if lan.version == 6 else "ip"
        sysctl = "net.ipv6.conf.all.forwarding=1" if lan.version == 6 else "net.ipv4.ip_forward=1"
        run(["ip", "netns", "exec", namespace, "sysctl", "-qw", sysctl])
        # Masquerade what leaves by the internet side; let in only replies to what went out.
        rules = f"""
table {family} nat {{
    chain postrouting {{ type nat hook postrouting priority srcnat; oifname "wan0" masquerade; }}
}}
table {family} filter {{
    chain forward {{ type filter hook forward priority filter; policy drop;
        ct state established,related accept; iifname "br0" accept; }}
    chain input {{ type filter hook input priority filter; policy accept;
        iifname "wan0" ct state established,related accept; iifname "wan0" drop; }}
}}
"""
        run(["ip", "netns", "exec", namespace, "nft", "-f", "-"], stdin=rules)
        home = Home(self, name, namespace, address, lan)
        self.homes[name] = home
        return home

    def link(self, a: Host | Home, b: Host | Home, *, both_ways: bool = True, **spec: Any) -> None:
        """Set the link from ``a`` to ``b`` (and back, unless ``both_ways=False``): `Link` fields by name."""
        for src, dst in ((a, b), (b, a)) if both_ways else ((a, b),):
            self._send({"op": "link", "src": _wire_name(src), "dst": _wire_name(dst), **spec})

    def default_link(self, **spec: Any) -> None:
        """Set every link not set by name with `link` (`Link` fields by name; the rest take their defaults)."""
        self._send({"op": "link", "src": None, "dst": None, **spec})

    def track(self, process: subprocess.Popen[Any]) -> None:
        """Stop ``process`` (SIGTERM to its group, then SIGKILL) when the lab closes."""
        self._processes.append(process)

    def clear_links(self) -> None:
        """Forget the links set by name with `link`: every link takes the default again."""
        self._send({"op": "clear"})

    def stats(self) -> dict[str, Any]:
        """Packets carried and dropped per link (``"a>b"``), and packets for addresses no host owns."""
        return self._send({"op": "stats"})

    # ------------------------------------------------------------------ measuring the lab itself

    def round_trip_ms(self, src: Host, dst: Host, count: int = 30, port: int = 7001) -> tuple[float, float, float]:
        """``(median, min, max)`` ms of ``count`` one-byte TCP round trips from ``src`` to ``dst``."""
        with self._served(dst, "echo", port):
            out = src.run(_measure("rtt", dst.address, port, count), timeout=60 + count).stdout.split()
        median, low, high = (float(x) for x in out)
        return median, low, high

    def throughput_mbit(self, src: Host, dst: Host, size: int = 1 << 20, port: int = 7002) -> float:
        """Mbit/s of a ``size``-byte TCP transfer from ``src`` to ``dst`` (until the last byte is read)."""
        with self._served(dst, "sink", port):
            return float(src.run(_measure("send", dst.address, port, size), timeout=120).stdout)

    def send_datagrams(self, src: Host, dst: Host, count: int = 400, port: int = 7003) -> int:
        """Send ``count`` one-byte UDP datagrams from ``src`` to ``dst`` (nobody listens: the link's counts tell what
        it carried and dropped); returns ``count``."""
        return int(src.run(_measure("datagrams", dst.address, port, count), timeout=30 + count / 100).stdout)

    def dial(self, src: Host, address: str, port: int, timeout: float = 2.0) -> str:
        """Whether ``src`` can open a TCP connection to ``address:port``: ``"connected"`` or the error."""
        return src.run(_measure("dial", address, port, timeout), timeout=timeout + 30).stdout.strip()

    def _served(self, host: Host, what: str, port: int) -> Any:
        import contextlib

        @contextlib.contextmanager
        def serving() -> Any:
            listen = "::" if host.ip_version == 6 else "0.0.0.0"
            server = host.popen(_measure(what, listen, port), stdout=subprocess.PIPE, text=True)
            try:
                assert server.stdout is not None
                if server.stdout.readline().strip() != "ready":
                    raise RuntimeError(f"the {what} server on {host.name} did not start")
                yield server
            finally:
                try:
                    server.wait(10)
                except subprocess.TimeoutExpired:
                    server.kill()
                    server.wait(5)
                if server.stdout:
                    server.stdout.close()

        return serving()

    # ------------------------------------------------------------------ teardown

    def close(self) -> None:
        """Stop the processes the lab started, delete its namespaces, stop the wire. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        _open_labs.discard(self)
        _restore_sigterm(self._previous_sigterm)
        for process in self._processes:
            _signal_group(process, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE
        for process in self._processes:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(process, signal.SIGKILL)
        for namespace in self._namespaces:
            kill_namespace_processes(namespace)
        for process in self._processes:
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                logger.warning("process %d in the lab did not die", process.pid)
        for namespace in reversed(self._namespaces):
            delete_namespace(namespace)
        wire: subprocess.Popen[str] | None = getattr(self, "_wire", None)
        if wire is not None:
            try:
                if wire.stdin:
                    wire.stdin.close()
                wire.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                wire.kill()
                wire.wait(5)
            if wire.stdout:
                wire.stdout.close()

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _check_name(self, name: str) -> None:
        if not name or not name.replace("_", "").isalnum() or len(name) > 24:
            raise ValueError(f"lab names are letters, digits and _ (at most 24), got {name!r}")
        if name in self.hosts or name in self.homes:
            raise ValueError(f"the lab has a host or home named {name!r} already")

    def _namespace(self, name: str) -> str:
        namespace = f"{PREFIX}{os.getpid()}-{self.number}-{name}"
        run(["ip", "netns", "add", namespace])
        self._namespaces.append(namespace)
        run(["ip", "-n", namespace, "link", "set", "lo", "up"])
        return namespace

    def _address(self, namespace: str, device: str, address: str, prefixlen: int) -> None:
        extra = ["nodad"] if ipaddress.ip_address(address).version == 6 else []
        run(["ip", "-n", namespace, "addr", "add", f"{address}/{prefixlen}", "dev", device, *extra])

    def _wan(self, name: str, namespace: str, address: str) -> None:
        run(["ip", "-n", namespace, "tuntap", "add", "dev", "wan0", "mode", "tun"])
        self._send({"op": "attach", "host": name, "netns": f"/run/netns/{namespace}", "device": "wan0",
                    "addresses": [address]})
        self._address(namespace, "wan0", address, self.internet.prefixlen)
        run(["ip", "-n", namespace, "link", "set", "wan0", "up"])

    def _send(self, command: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            if self._closed:
                raise RuntimeError("the lab is closed")
            assert self._wire.stdin is not None
            self._wire.stdin.write(json.dumps(command) + "\n")
            self._wire.stdin.flush()
            return self._read_answer()

    def _read_answer(self) -> dict[str, Any]:
        assert self._wire.stdout is not None
        line = self._wire.stdout.readline()
        if not line:
            raise RuntimeError(f"the lab's wire process exited (code {self._wire.poll()})")
        answer = json.loads(line)
        if not answer.get("ok"):
            raise RuntimeError(f"the lab's wire refused a command: {answer.get('error')}")
        return answer


_open_labs: set[Lab] = set()
_lab_numbers = itertools.count(1)


@atexit.register
def _close_open_labs() -> None:
    for lab in list(_open_labs):
        lab.close()


def _exit_on_sigterm() -> Any:
    """Make SIGTERM unwind the lab's ``with`` block (as Ctrl-C does) while the default would kill outright."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        return None

    def terminate(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, terminate)


def _restore_sigterm(previous: Any) -> None:
    if previous is not None and threading.current_thread() is threading.main_thread() and not _open_labs:
        signal.signal(signal.SIGTERM, previous)


def _wire_name(node: Host | Home) -> str:
    if isinstance(node, Host) and node.home is not None:
        return node.home.name  # a home host's packets cross the internet as its router's
    return node.name


def _signal_group(process: subprocess.Popen[Any], sig: int) -> None:
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            process.send_signal(sig)
        except ProcessLookupError:
            pass


def _measure(*args: Any) -> list[str]:
    return [sys.executable, "-m", "distconf.tools.netlab.measure", *(str(a) for a in args)]
