"""Small network measurements run inside lab hosts: round trips and throughput over TCP, datagrams over UDP.

``python -m distconf.tools.netlab.measure echo ADDR PORT`` serves (it prints ``ready`` once listening,
and exits when its one client leaves); ``rtt ADDR PORT N`` prints the median, min and max round trip of
N one-byte exchanges in ms; ``sink ADDR PORT`` receives; ``send ADDR PORT BYTES`` prints the Mbit/s it
sent at, counted until the receiver has read the last byte; ``datagrams ADDR PORT N`` sends N one-byte
UDP datagrams, 1 ms apart, and prints N; ``dial ADDR PORT TIMEOUT`` prints ``connected`` or the error.
The processes run at a real-time priority when they may, so that a busy machine does not add its
scheduling delays to what the lab's links do.
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import time

__all__ = ["main"]


def _realtime() -> None:
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(5))
    except (OSError, AttributeError):
        pass


def _family(address: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in address else socket.AF_INET


def _listen(address: str, port: int) -> socket.socket:
    server = socket.socket(_family(address), socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((address, port))
    server.listen(1)
    print("ready", flush=True)
    return server


def _connect(address: str, port: int, timeout: float = 10.0) -> socket.socket:
    sock = socket.create_connection((address, port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def echo(address: str, port: int) -> None:
    """Echo what one client sends until it leaves; sends one byte back when a ``send`` is done."""
    with _listen(address, port) as server:
        conn, _ = server.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)


def sink(address: str, port: int) -> None:
    """Read everything one client sends; answer one byte when it half-closes."""
    with _listen(address, port) as server:
        conn, _ = server.accept()
        with conn:
            while conn.recv(1 << 20):
                pass
            conn.sendall(b"k")


def rtt(address: str, port: int, count: int) -> None:
    """Print ``median min max`` of ``count`` one-byte round trips (ms)."""
    times = []
    with _connect(address, port) as sock:
        for _ in range(count):
            start = time.perf_counter()
            sock.sendall(b"x")
            sock.recv(1)
            times.append((time.perf_counter() - start) * 1e3)
    print(f"{statistics.median(times):.3f} {min(times):.3f} {max(times):.3f}", flush=True)


def send(address: str, port: int, size: int) -> None:
    """Send ``size`` bytes and print the rate in Mbit/s (until the receiver confirms the last byte)."""
    block = b"\0" * 65536
    # on a lossy link TCP backs off for seconds per lost SYN or segment (the caller bounds 120 s): with 30 % loss,
    # the 4 SYNs a 10 s connect allows all fail about once in 120 runs; 40 s allows 6
    with _connect(address, port, timeout=40.0) as sock:
        sock.settimeout(70.0)
        start = time.perf_counter()
        left = size
        while left > 0:
            sent = sock.send(block[: min(left, len(block))])
            left -= sent
        sock.shutdown(socket.SHUT_WR)
        sock.recv(1)
        seconds = time.perf_counter() - start
    print(f"{size * 8 / seconds / 1e6:.3f}", flush=True)


def datagrams(address: str, port: int, count: int) -> None:
    """Send ``count`` one-byte UDP datagrams, 1 ms apart, and print ``count`` (nothing retransmits or backs off: a
    link's loss shows in its counts in bounded time)."""
    with socket.socket(_family(address), socket.SOCK_DGRAM) as sock:
        for _ in range(count):
            sock.sendto(b"x", (address, port))
            time.sleep(0.001)
    print(count, flush=True)


def dial(address: str, port: int, timeout: float) -> None:
    """Print ``connected`` if a TCP connection opens within ``timeout`` s, else the error's name."""
    try:
        with _connect(address, port, timeout):
            print("connected", flush=True)
    except OSError as exc:
        print(type(exc).__name__ if exc.errno is None else os.strerror(exc.errno), flush=True)


def main(argv: list[str] | None = None) -> int:
    """Run one measurement named by ``argv`` (see the module docstring)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    _realtime()
    what, address, port = args[0], args[1], int(args[2])
    if what == "echo":
        echo(address, port)
    elif what == "sink":
        sink(address, port)
    elif what == "rtt":
        rtt(address, port, int(args[3]))
    elif what == "send":
        send(address, port, int(args[3]))
    elif what == "datagrams":
        datagrams(address, port, int(args[3]))
    elif what == "dial":
        dial(address, port, float(args[3]))
    else:
        print(f"unknown measurement {what!r}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
