"""The client's connection to a swarm: a client-mode DHT node, its P2P replica, DHT pings.

`SwarmClient` joins the swarm and runs coroutines on the process-wide background loop
(`distconf.rpc.calls.BackgroundLoop.shared`), so the rest of the client is plain synchronous code. The RPC
calls themselves (``rpc_info``, ``rpc_forward``, ``rpc_backward``, ``rpc_inference``) are
`distconf.rpc.calls`, run with ``swarm.run(call_...(swarm.p2p, peer_id, ...))``.
"""

from __future__ import annotations

import logging
from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from distconf.dht import start_local_dht
from distconf.dht.hivemind_compat import forget_p2p_replica
from distconf.dht.liveness import ping_peers
from distconf.loader.config_protocol import DistributedConfig
from distconf.loader.naming import config_num_blocks
from distconf.rpc.calls import BackgroundLoop

if TYPE_CHECKING:  # pragma: no cover
    from hivemind import DHT
    from hivemind.p2p import P2P

__all__ = ["SwarmClient", "release_dht"]

logger = logging.getLogger(__name__)
T = TypeVar("T")


class SwarmClient:
    """A client-mode DHT node joined through ``config.initial_peers`` plus the P2P handle for RPCs.

    Call a server with `distconf.rpc.calls` on this P2P, e.g.
    ``swarm.run(call_info(swarm.p2p, peer_id, uid, timeout=t), timeout=t + 1)``.

    :param config: a distributed config (its ClientConfig fields: ``initial_peers``,
        ``daemon_startup_timeout``, ``dht_prefix``).
    :param dht: an already running ``hivemind.DHT`` to use instead of starting one (not
        shut down by `shutdown`).
    """

    def __init__(self, config: DistributedConfig, dht: DHT | None = None) -> None:
        self.config = config
        self.dht_prefix = config.dht_prefix
        if not self.dht_prefix:
            raise ValueError(f"{type(config).__name__} has no dht_prefix: pass dht_prefix=... "
                             "or save it in config.json")
        self.num_blocks = config_num_blocks(config)
        self._own_dht = dht is None
        if dht is None:
            peers = list(config.initial_peers or ())
            if not peers:
                raise ValueError("initial_peers is empty: give the multiaddr of a peer of the swarm "
                                 "(initial_peers=[...] or DISTCONF_INITIAL_PEERS)")
            dht = start_local_dht(peers, startup_timeout=float(config.daemon_startup_timeout), client_mode=True,
                                  num_workers=8)
        self.dht = dht
        try:
            self.p2p: P2P = self.run(dht.replicate_p2p(), timeout=float(config.daemon_startup_timeout))
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------ running coroutines
    @staticmethod
    def run(coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the shared background loop and wait (at most ``timeout`` s) for its result."""
        return BackgroundLoop.shared().run(coro, timeout=timeout)

    def ping(self, peers: Sequence[str], timeout: float) -> dict[str, float]:
        """Round-trip time to each peer in seconds, ``inf`` for a peer that did not answer in ``timeout``."""
        if not peers:
            return {}
        return ping_peers(self.dht, peers, timeout)

    def shutdown(self) -> None:
        """Close the P2P handle and stop the DHT node, if this client started them.

        A DHT given by the caller keeps its P2P replica: hivemind shares one replica per
        DHT object, so closing it would cut off every other user of that DHT.
        """
        p2p = getattr(self, "p2p", None)
        if p2p is not None and self._own_dht:
            self.p2p = None
            try:
                self.run(p2p.shutdown(), timeout=5.0)
            except Exception as exc:
                logger.debug("closing the P2P handle: %r", exc)
        dht = getattr(self, "dht", None)
        if self._own_dht and dht is not None and dht.is_alive():
            dht.shutdown()


def release_dht(dht: DHT, timeout: float = 10.0) -> None:
    """Close the P2P replica clients made of ``dht`` (on the loop that made it), then shut ``dht`` down.

    Lets a caller that shared one DHT between several models end it cleanly: a replica
    left to the garbage collector is closed outside any event loop.
    """
    replica = forget_p2p_replica(dht)  # hivemind keeps one replica per DHT object
    if replica is not None:
        try:
            SwarmClient.run(replica.shutdown(), timeout=timeout)
        except Exception as exc:
            logger.debug("closing the P2P replica: %r", exc)
    if dht.is_alive():
        dht.shutdown()
