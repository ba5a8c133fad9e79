"""Why initial peers cannot be reached: each address dialled over plain TCP, its failure named.

hivemind's p2p daemon says only "failed to connect to bootstrap peers" when none of them answers.
`explain_unreachable` dials each one's TCP address itself, bounded, and names what happened
(connection refused, timed out, network unreachable, no such host), so a user reads which address is
wrong and why in one line (`distconf.errors.SwarmJoinError`).
"""

from __future__ import annotations

import socket
from collections.abc import Sequence

__all__ = ["BOOTSTRAP_FAILURE", "explain_unreachable", "tcp_endpoint"]

BOOTSTRAP_FAILURE = "failed to connect to bootstrap peers"
"""What hivemind's daemon says (inside ``P2PDaemonError``) when no initial peer could be reached."""
DIAL_TIMEOUT = 3.0


def tcp_endpoint(maddr: str) -> tuple[str, int] | None:
    """``(host, port)`` of a ``/ip4|ip6|dns|dns4|dns6/HOST/tcp/PORT/...`` multiaddr, else None."""
    parts = maddr.strip("/").split("/")
    if len(parts) < 4 or parts[0] not in ("ip4", "ip6", "dns", "dns4", "dns6") or parts[2] != "tcp":
        return None
    try:
        return parts[1], int(parts[3])
    except ValueError:
        return None


def _dial(maddr: str, timeout: float) -> str | None:
    """None if a TCP connection opens, else why not."""
    endpoint = tcp_endpoint(maddr)
    if endpoint is None:
        return "not a TCP address distconf can dial (/ip4, /ip6 or /dns with /tcp)"
    host, port = endpoint
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except socket.gaierror as exc:
        return f"cannot resolve {host}: {exc.strerror}"
    except TimeoutError:
        return f"no answer in {timeout:g} s (a firewall, or a host behind NAT)"
    except OSError as exc:
        return (exc.strerror or type(exc).__name__).lower()


def explain_unreachable(peers: Sequence[str], timeout: float = DIAL_TIMEOUT) -> str:
    """One sentence naming each initial peer and why it could not be reached (dials them all over TCP)."""
    reasons = []
    for peer in peers:
        why = _dial(peer, timeout)
        if why is None:
            why = "its port answers, but not as the peer named (a wrong /p2p/ id, or not a distconf or Petals peer)"
        reasons.append(f"{peer}: {why}")
    return "; ".join(reasons) if reasons else "no initial peers given"
