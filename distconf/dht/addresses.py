"""Where a server listens and what it announces: Petals' flags, and never an address others cannot use.

`plan_addresses` turns ``--host-maddrs``, ``--announce-maddrs``, ``--public-ip``, ``--port`` and ``--host``
(distconf's shorthand for one listen address), together with the swarm's initial peers, into the
addresses the p2p daemon listens on and the ones it announces:

- **listen**: ``--host-maddrs`` as given; else ``--host``; else every interface (``0.0.0.0`` and ``::``,
  as Petals) when the swarm is on a network (an initial peer, ``--public-ip`` or ``--announce-maddrs``
  is not loopback); else ``127.0.0.1`` only. Nothing listens beyond loopback unless the user's flags or
  peers point at a network.
- **announce**: ``--announce-maddrs`` as given; else ``--public-ip`` on ``--port``; else the listen
  addresses with each wildcard replaced by this machine's addresses, leaving out loopback (unless the
  whole swarm is on this machine) and link-local ones. A daemon left to itself also announces
  ``127.0.0.1`` and private addresses that other peers then dial in vain.

When announced addresses must name a port and ``--port`` is 0, one free port is chosen first.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["ANY_IPV4", "ANY_IPV6", "AddressPlan", "NetworkOptions", "is_loopback_maddr", "local_addresses",
           "plan_addresses"]


ANY_IPV4, ANY_IPV6 = "0.0.0.0", "::"
"""The wildcard listen addresses: every interface of this machine."""


@dataclass(frozen=True)
class NetworkOptions:
    """A server's network flags (Petals' names): listen and announce addresses, identity, relays."""

    host: str | None = None
    port: int = 0
    host_maddrs: tuple[str, ...] | None = None
    announce_maddrs: tuple[str, ...] | None = None
    public_ip: str | None = None
    identity_path: str | None = None
    use_relay: bool = True
    use_auto_relay: bool = True
    reachability_check: bool = True


@dataclass(frozen=True)
class AddressPlan:
    """What the daemon listens on, what it announces (None: the daemon's own choice), and whether the
    whole swarm is on this machine (loopback only)."""

    listen: tuple[str, ...]
    announce: tuple[str, ...] | None
    local_only: bool

    @property
    def port(self) -> int:
        """The TCP port of the first listen address (0: any)."""
        return _port(self.listen[0]) if self.listen else 0


def plan_addresses(options: NetworkOptions, initial_peers: Sequence[str]) -> AddressPlan:
    """The addresses to listen on and announce (see the module docstring); `ValueError` for clashing flags."""
    if options.port and options.host_maddrs:
        raise ValueError("--port and --host-maddrs cannot be used together: put the port in the multiaddrs")
    if options.public_ip and options.announce_maddrs:
        raise ValueError("--public-ip and --announce-maddrs cannot be used together")
    if options.public_ip and not options.port:
        raise ValueError("--public-ip needs --port: the port forwarded to this machine, e.g. --port 31337")
    if not 0 <= options.port <= 65535:
        raise ValueError(f"--port must be 0..65535, got {options.port}")
    if options.public_ip:
        _ip(options.public_ip, "--public-ip")
    given = [*initial_peers, *(options.announce_maddrs or ()), *(options.host_maddrs or ())]
    networked = bool(options.public_ip) or any(not is_loopback_maddr(m) for m in given) or (
        options.host is not None and not _is_loopback_ip(options.host))
    if options.host_maddrs:
        listen = list(options.host_maddrs)
    elif options.host is not None:
        listen = [f"/ip{_ip(options.host, '--host').version}/{options.host}/tcp/{options.port}"]
    elif networked:
        listen = [f"/ip4/{ANY_IPV4}/tcp/{options.port}", f"/ip6/{ANY_IPV6}/tcp/{options.port}"]
    else:
        listen = [f"/ip4/127.0.0.1/tcp/{options.port}"]
    local_only = all(is_loopback_maddr(m) for m in listen) and not networked
    if options.announce_maddrs:
        return AddressPlan(tuple(listen), tuple(options.announce_maddrs), local_only)
    if local_only:
        return AddressPlan(tuple(listen), None, True)
    if any(_port(m) == 0 for m in listen):
        port = _free_port(listen)
        listen = [_with_port(m, port) if _port(m) == 0 else m for m in listen]
    if options.public_ip:
        ip = _ip(options.public_ip, "--public-ip")
        return AddressPlan(tuple(listen), (f"/ip{ip.version}/{ip}/tcp/{options.port}",), False)
    announce = [m for m in _expand(listen) if not is_loopback_maddr(m)]
    if not announce:
        raise ValueError(f"this machine has no address other peers can dial among {listen}: give --public-ip "
                         "and --port, or --announce-maddrs")
    return AddressPlan(tuple(listen), tuple(announce), False)


def is_loopback_maddr(maddr: str) -> bool:
    """Whether a multiaddr's address is a loopback one (``/ip4/127.x``, ``/ip6/::1``, ``/dns/localhost``)."""
    parts = maddr.strip("/").split("/")
    if len(parts) < 2:
        return False
    if parts[0] in ("dns", "dns4", "dns6"):
        return parts[1] == "localhost" or parts[1].endswith(".localhost")
    return parts[0] in ("ip4", "ip6") and _is_loopback_ip(parts[1])


def local_addresses() -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """This machine's interface addresses (in its network namespace), link-local ones left out."""
    import psutil

    found = []
    for addresses in psutil.net_if_addrs().values():
        for entry in addresses:
            if entry.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                ip = ipaddress.ip_address(entry.address.split("%", 1)[0])
            except ValueError:
                continue
            if not ip.is_link_local and ip not in found:
                found.append(ip)
    return found


def _expand(listen: Iterable[str]) -> list[str]:
    """``listen`` with ``0.0.0.0`` / ``::`` replaced by each local address of that family."""
    out: list[str] = []
    for maddr in listen:
        parts = maddr.strip("/").split("/")
        if parts[0] in ("ip4", "ip6") and ipaddress.ip_address(parts[1]).is_unspecified:
            version = 4 if parts[0] == "ip4" else 6
            for ip in local_addresses():
                if ip.version == version:
                    out.append("/" + "/".join([parts[0], str(ip), *parts[2:]]))
        else:
            out.append(maddr)
    return list(dict.fromkeys(out))


def _ip(text: str, flag: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        raise ValueError(f"{flag} must be an IPv4 or IPv6 address, got {text!r}") from None


def _is_loopback_ip(text: str) -> bool:
    try:
        return ipaddress.ip_address(text).is_loopback
    except ValueError:
        return text == "localhost"


def _port(maddr: str) -> int:
    parts = maddr.strip("/").split("/")
    for proto, value in zip(parts[::2], parts[1::2]):
        if proto in ("tcp", "udp"):
            return int(value)
    return 0


def _with_port(maddr: str, port: int) -> str:
    parts = maddr.strip("/").split("/")
    for i in range(0, len(parts) - 1, 2):
        if parts[i] in ("tcp", "udp"):
            parts[i + 1] = str(port)
    return "/" + "/".join(parts)


def _free_port(listen: Sequence[str], attempts: int = 20) -> int:
    """A TCP port free on every listen address (the daemon binds it a moment later)."""
    for _ in range(attempts):
        sockets: list[socket.socket] = []
        try:
            port = 0
            for maddr in listen:
                parts = maddr.strip("/").split("/")
                family = socket.AF_INET6 if parts[0] == "ip6" else socket.AF_INET
                sock = socket.socket(family, socket.SOCK_STREAM)
                sockets.append(sock)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind((parts[1], port))
                port = sock.getsockname()[1]
            return port
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise OSError(f"no TCP port is free on all of {list(listen)}")
