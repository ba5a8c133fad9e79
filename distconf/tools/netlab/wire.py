"""The lab's internet: one process that carries IP packets between hosts' TUN devices, with each link's delay.

This kernel has no ``netem`` qdisc, so delay, jitter, loss and bandwidth are emulated here, in user
space. Every host on the lab's internet (a public host, or the outside of a home router) has a TUN
device; this process holds all of them, reads each packet a host sends, looks up the host that owns
its destination address, and writes it to that host's TUN device once the link from the sender to the
receiver has carried it:

- **bandwidth** (``rate_mbit``): the link sends one packet at a time; a packet leaves when the one
  before it has left plus its own ``size x 8 / rate`` (a FIFO; ``queue_packets`` waiting at most, then
  the next is dropped, as a router's tail-drop queue);
- **delay** and **jitter** (``delay_ms``, ``jitter_ms``): it then arrives ``delay`` later, plus a
  normal draw of standard deviation ``jitter`` (clipped at zero), never before the link's previous
  packet (links do not reorder, unlike netem);
- **loss** (``loss``): a packet is dropped with that probability before it is queued.

A packet for an address no host owns is dropped (the hosts route only the lab's prefix to this device,
so their kernels refuse other destinations at once, as "network unreachable").

It is started by `distconf.tools.netlab.lab.Lab` (``python -m distconf.tools.netlab.wire``) and reads
commands, one JSON object per line, on stdin; it answers each with one JSON line on stdout and exits
when stdin closes (so it never outlives the lab that started it):

- ``{"op": "attach", "host": NAME, "netns": PATH, "device": DEV, "addresses": [IP, ...]}``: open the
  TUN device ``DEV`` inside the network namespace at ``PATH`` and route ``addresses`` to it;
- ``{"op": "link", "src": NAME|null, "dst": NAME|null, "delay_ms": ..., ...}``: set the link from
  ``src`` to ``dst`` (null: the default for every pair not set);
- ``{"op": "clear"}``: forget the links set by name (every link takes the default);
- ``{"op": "stats"}``: packets carried and dropped per link.

The process asks for a real-time scheduling class (root only) so that its timers keep their ~0.1 ms
accuracy on a loaded machine; it never spins, so it cannot starve the machine.
"""

from __future__ import annotations

import ctypes
import fcntl
import heapq
import json
import os
import random
import select
import struct
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from distconf.tools.netlab.links import LinkSpec

__all__ = ["main"]

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
CLONE_NEWNET = 0x40000000
EARLY_WAKE = 0.001
"""epoll's timeout has millisecond granularity: it wakes this much early and sleeps the rest precisely."""


@dataclass
class _LinkState:
    spec: LinkSpec
    free_at: float = 0.0  # when the link has finished sending what it holds
    last_arrival: float = 0.0  # no packet arrives before the previous one (FIFO)
    queued: int = 0
    carried: int = 0
    dropped: int = 0


@dataclass
class _Wire:
    fds: dict[str, int] = field(default_factory=dict)  # host -> TUN fd
    owners: dict[bytes, str] = field(default_factory=dict)  # packed address -> host
    links: dict[tuple[str, str], _LinkState] = field(default_factory=dict)
    default: LinkSpec = field(default_factory=LinkSpec)
    explicit: set[tuple[str, str]] = field(default_factory=set)  # links set by name (the default leaves them)
    due: list[tuple[float, int, str, bytes, _LinkState]] = field(default_factory=list)
    seq: int = 0
    unroutable: int = 0

    def link(self, src: str, dst: str) -> _LinkState:
        state = self.links.get((src, dst))
        if state is None:
            state = self.links[(src, dst)] = _LinkState(self.default)
        return state

    def send(self, src: str, packet: bytes, now: float) -> None:
        dst = self.owners.get(_destination(packet))
        if dst is None:
            self.unroutable += 1
            return
        link = self.link(src, dst)
        spec = link.spec
        if (spec.loss and random.random() < spec.loss) or link.queued >= spec.queue_packets:
            link.dropped += 1
            return
        leaves = max(now, link.free_at)
        if spec.rate_mbit:
            leaves += len(packet) * 8 / (spec.rate_mbit * 1e6)
        link.free_at = leaves
        delay = spec.delay_ms / 1e3
        if spec.jitter_ms:
            delay = max(0.0, random.gauss(delay, spec.jitter_ms / 1e3))
        arrives = max(leaves + delay, link.last_arrival)
        link.last_arrival = arrives
        link.queued += 1
        self.seq += 1
        heapq.heappush(self.due, (arrives, self.seq, dst, packet, link))

    def deliver_due(self, now: float) -> None:
        while self.due and self.due[0][0] <= now:
            _, _, dst, packet, link = heapq.heappop(self.due)
            link.queued -= 1
            link.carried += 1
            try:
                os.write(self.fds[dst], packet)
            except OSError:  # the host's device is down (its namespace is going away)
                link.dropped += 1


def _destination(packet: bytes) -> bytes:
    version = packet[0] >> 4 if packet else 0
    if version == 4:
        return packet[16:20]
    if version == 6:
        return packet[24:40]
    return b""


def _pack_address(text: str) -> bytes:
    import ipaddress

    return ipaddress.ip_address(text).packed


def _open_tun(netns: str, device: str) -> int:
    """Open (attach to) the TUN device ``device`` inside the namespace at path ``netns``."""
    libc = ctypes.CDLL(None, use_errno=True)
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    target = os.open(netns, os.O_RDONLY)
    try:
        if libc.setns(target, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns {netns}")
        try:
            fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
            fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", device.encode(), IFF_TUN | IFF_NO_PI))
        finally:
            if libc.setns(home, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back")
    finally:
        os.close(target)
        os.close(home)
    return fd


def _realtime() -> bool:
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
        return True
    except (OSError, AttributeError):
        return False


def _answer(data: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(data) + "\n")
    sys.stdout.flush()


def _command(wire: _Wire, poller: select.epoll, hosts_by_fd: dict[int, str], line: str) -> None:
    try:
        cmd = json.loads(line)
        op = cmd.get("op")
        if op == "attach":
            fd = _open_tun(cmd["netns"], cmd["device"])
            wire.fds[cmd["host"]] = fd
            hosts_by_fd[fd] = cmd["host"]
            for address in cmd["addresses"]:
                wire.owners[_pack_address(address)] = cmd["host"]
            poller.register(fd, select.EPOLLIN)
            _answer({"ok": True})
        elif op == "link":
            spec = LinkSpec.from_json(cmd)
            src, dst = cmd.get("src"), cmd.get("dst")
            if src is None and dst is None:
                wire.default = spec
                for key, state in wire.links.items():
                    if key not in wire.explicit:
                        state.spec = spec
            elif src is None or dst is None:
                raise ValueError("a link names both src and dst, or neither (the default)")
            else:
                wire.explicit.add((src, dst))
                wire.link(src, dst).spec = spec
            _answer({"ok": True})
        elif op == "clear":
            wire.explicit.clear()
            for state in wire.links.values():
                state.spec = wire.default
            _answer({"ok": True})
        elif op == "stats":
            links = {f"{src}>{dst}": {"carried": s.carried, "dropped": s.dropped}
                     for (src, dst), s in wire.links.items()}
            _answer({"ok": True, "links": links, "unroutable": wire.unroutable})
        else:
            _answer({"ok": False, "error": f"unknown op {op!r}"})
    except Exception as exc:  # a bad command is answered, the wire keeps running
        _answer({"ok": False, "error": f"{type(exc).__name__}: {exc}"})


def main() -> int:
    """Run the wire until stdin closes (see the module docstring)."""
    realtime = _realtime()
    wire = _Wire()
    poller = select.epoll()
    hosts_by_fd: dict[int, str] = {}
    stdin = sys.stdin.fileno()
    os.set_blocking(stdin, False)
    poller.register(stdin, select.EPOLLIN)
    pending = b""
    _answer({"ok": True, "ready": True, "realtime": realtime})
    while True:
        now = time.monotonic()
        wire.deliver_due(now)
        if wire.due:
            wait = wire.due[0][0] - now
            if wait < EARLY_WAKE:
                time.sleep(max(wait, 0.0))  # nanosleep: precise; packets wait in the TUN queues meanwhile
                continue
            timeout = wait - EARLY_WAKE
        else:
            timeout = -1
        for fd, _events in poller.poll(timeout):
            if fd == stdin:
                chunk = os.read(stdin, 65536)
                if not chunk:
                    return 0
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if line.strip():
                        _command(wire, poller, hosts_by_fd, line.decode())
                continue
            src = hosts_by_fd[fd]
            now = time.monotonic()
            for _ in range(64):  # a burst, then let the timers run
                try:
                    packet = os.read(fd, 65536)
                except BlockingIOError:
                    break
                except OSError:  # the device went away with its namespace
                    poller.unregister(fd)
                    break
                wire.send(src, packet, now)


if __name__ == "__main__":
    sys.exit(main())
