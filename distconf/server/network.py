"""A server's place on the network: addresses, identity, reachability, relays, before anything is announced.

`start_network` runs what Petals' server does at start, in order: plan the listen and announce
addresses (`distconf.dht.addresses`), create or check the identity (`distconf.dht.identity`), ask
peers to dial back a temporary daemon (`distconf.dht.reachability.check_direct_reachability`), then
start the DHT node either as a full peer (and answer other servers' checks) or, when peers cannot
dial it, in DHT client mode behind libp2p circuit relays (the initial peers that answered), checked
end to end (`distconf.dht.relay_path.check_relayed_path`). A server that nobody can reach ends
here with `distconf.errors.UnreachableServerError`: it never announces itself.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from distconf.dht import raise_join_error, start_local_dht, visible_maddrs
from distconf.dht.addresses import AddressPlan, NetworkOptions, plan_addresses
from distconf.errors import UnreachableServerError

__all__ = ["NodeNetwork", "start_network"]

logger = logging.getLogger(__name__)

CHECK_TIMEOUT = 120.0
RELAY_ATTEMPTS = 3
"""Nodes a server behind NAT starts, at most, until a relay carries its relayed-path check."""
"""Seconds the reachability check at start may take (a daemon start, and peers dialling back)."""


@dataclass
class NodeNetwork:
    """A started DHT node with its RPC loop, and how peers reach it."""

    dht: Any
    rpc: Any
    using_relay: bool = False
    relay: str | None = None  # the relay that carried the relayed-path check
    reachability: Any = None  # the `ReachabilityService` a directly reachable server runs

    def close(self) -> None:
        """Stop the RPC loop and the DHT node (a node that was not kept)."""
        if self.rpc is not None:
            self.rpc.shutdown()
        self.dht.shutdown()


def start_network(options: NetworkOptions, peers: Sequence[str], *, num_workers: int) -> NodeNetwork:
    """Start the node where peers can reach it (see the module docstring); the caller shuts it down."""
    from distconf.dht.reachability import ReachabilityService, check_direct_reachability
    from distconf.rpc.calls import BackgroundLoop, RpcLoop

    plan = plan_addresses(options, peers)
    if options.identity_path is not None:
        from distconf.dht.identity import load_identity

        logger.info("identity %s: peer id %s", options.identity_path, load_identity(options.identity_path))
    found = None
    if peers and options.reachability_check and not plan.local_only:
        try:
            found = BackgroundLoop.shared().run(check_direct_reachability(peers, plan.listen, plan.announce),
                                                timeout=CHECK_TIMEOUT)
        except Exception as exc:
            raise_join_error(exc, peers)
            raise
        logger.info("reachability: %d of %d peers that answered could dial this server directly", found.dialled,
                    found.answered)
    relayed = found is not None and found.reachable is False
    if relayed:
        assert found is not None
        why = ("--no-relay" if not options.use_relay else "--no-auto-relay" if not options.use_auto_relay
               else None if found.relays else "no initial peer answered that could relay")
        if why is not None:
            raise UnreachableServerError(_unreachable(plan, f"relays are off ({why})"))
    kwargs: dict[str, Any] = {"host_maddrs": list(plan.listen), "announce_maddrs": plan.announce,
                              "identity_path": options.identity_path, "use_relay": options.use_relay,
                              "num_workers": num_workers}
    if relayed:
        assert found is not None
        node = _start_relayed(list(peers), kwargs, plan, found)
    else:
        node = NodeNetwork(start_local_dht(list(peers), **kwargs), None)
        try:
            node.rpc = RpcLoop(node.dht)
            if not plan.local_only:
                node.reachability = ReachabilityService(node.rpc.p2p)
                node.rpc.run(node.reachability.start(), timeout=30)
        except BaseException:
            node.close()
            raise
    how = f"relayed through {node.relay}" if relayed else "directly" if not plan.local_only else "on this machine"
    logger.info("network: listening on %s; announcing %s; reached %s", " ".join(plan.listen),
                " ".join(visible_maddrs(node.dht, latest=relayed)), how)
    return node


def _start_relayed(peers: list[str], kwargs: dict[str, Any], plan: AddressPlan, found: Any) -> NodeNetwork:
    """Start the node in DHT client mode behind ``found.relays``, once a relay carries a session to it.

    Each attempt lets the relays confirm their reachability first (`confirm_relays`), then starts a
    node (a new daemon: a reservation is taken at once with static relays) and checks its relayed path;
    a relay that cut the check short gets another attempt with a new node. `UnreachableServerError`
    after `RELAY_ATTEMPTS`.
    """
    from distconf.dht.relay_path import check_relayed_path, confirm_relays
    from distconf.rpc.calls import BackgroundLoop, RpcLoop

    logger.info("peers cannot dial this server directly: it will serve through a relay (%s)", " ".join(found.relays))
    kwargs = {**kwargs, "client_mode": True, "use_auto_relay": True, "trusted_relays": list(found.relays),
              "force_reachability": "private"}
    problems: dict[str, str] = {}
    for attempt in range(RELAY_ATTEMPTS):
        if found.observed is not None:
            with contextlib.suppress(Exception):  # a help to the relays, not a requirement
                BackgroundLoop.shared().run(confirm_relays(found.relays, found.observed), timeout=60)
        node = NodeNetwork(start_local_dht(peers, **kwargs), None, using_relay=True)
        try:
            node.rpc = RpcLoop(node.dht)
            path = node.rpc.run(check_relayed_path(node.rpc.p2p, found.relays), timeout=120)
        except BaseException:
            node.close()
            raise
        if path.relay is not None:
            node.relay = path.relay
            return node
        node.close()
        problems.update(path.problems)
        logger.info("relayed path, attempt %d of %d: %s", attempt + 1, RELAY_ATTEMPTS,
                    "; ".join(f"{r}: {why}" for r, why in path.problems.items()))
        if not path.limited:
            break
    summary = "; ".join(f"{relay}: {why}" for relay, why in problems.items()) or "no relay answered"
    raise UnreachableServerError(_unreachable(plan, f"no relay carried a session ({summary})"))


def _unreachable(plan: AddressPlan, relay_problem: str) -> str:
    """The one line a server nobody can reach ends with: what was tried, and the fix."""
    return (f"peers cannot reach this server: they cannot dial it directly at {' '.join(plan.announce or plan.listen)} "
            f"(behind NAT or a firewall?) and {relay_problem}. Forward a TCP port to this machine and start with "
            "--public-ip YOUR_PUBLIC_IP --port THAT_PORT (or --announce-maddrs), or let it use relays")
