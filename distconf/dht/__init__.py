"""Peer discovery on a hivemind DHT: records, announce, discover, route.

Importing this package needs only pydantic; hivemind is imported when a function that
talks to a DHT is called. Every DHT helper here dials only the addresses its caller
gives; `start_local_dht` listens on 127.0.0.1 only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from distconf.dht.announce import BlockAnnouncer, announce_blocks, default_expiration
from distconf.dht.discovery import (
    RemoteSpan,
    SkippedRecord,
    SwarmState,
    find_block_servers,
    find_models,
    find_servers_by_prefix,
)
from distconf.dht.records import (
    CHAIN_DELIMITER,
    MODELS_REGISTRY_KEY,
    UID_DELIMITER,
    ModelInfo,
    RecordError,
    ServerInfo,
    ServerState,
    block_uid,
    parse_block_uid,
)
from distconf.dht.routing import NoRouteError, make_route, route_summary

if TYPE_CHECKING:  # pragma: no cover
    from hivemind import DHT

__all__ = [
    "CHAIN_DELIMITER",
    "LOOPBACK_MADDRS",
    "MODELS_REGISTRY_KEY",
    "UID_DELIMITER",
    "BlockAnnouncer",
    "ModelInfo",
    "NoRouteError",
    "RecordError",
    "RemoteSpan",
    "ServerInfo",
    "ServerState",
    "SkippedRecord",
    "SwarmState",
    "announce_blocks",
    "block_uid",
    "default_expiration",
    "find_block_servers",
    "find_models",
    "find_servers_by_prefix",
    "make_route",
    "parse_block_uid",
    "route_summary",
    "start_local_dht",
    "visible_maddrs",
]

LOOPBACK_MADDRS = ("/ip4/127.0.0.1/tcp/0",)
"""Listen addresses used by `start_local_dht`: loopback only, any free port."""


def start_local_dht(
    initial_peers: list[str] | tuple[str, ...] = (), *, startup_timeout: float = 60.0, **kwargs: Any
) -> DHT:
    """Start a ``hivemind.DHT`` listening on 127.0.0.1 only (dialing only ``initial_peers``).

    Waits up to ``startup_timeout`` seconds for the node to be ready (then shuts it down
    and raises `TimeoutError`). ``kwargs`` go to ``hivemind.DHT`` (e.g.
    ``client_mode=True``, ``num_workers``). The caller must call ``.shutdown()``.
    """
    from hivemind import DHT

    kwargs.setdefault("host_maddrs", list(LOOPBACK_MADDRS))
    kwargs.pop("start", None)
    kwargs.pop("await_ready", None)
    dht = DHT(initial_peers=list(initial_peers), start=False, **kwargs)
    try:
        dht.run_in_background(await_ready=True, timeout=startup_timeout)
    except TimeoutError as exc:  # concurrent.futures.TimeoutError is TimeoutError on 3.11+
        _stop(dht)
        raise TimeoutError(f"DHT node not ready after {startup_timeout} s") from exc
    except BaseException:
        _stop(dht)
        raise
    return dht


def _stop(dht: DHT) -> None:
    if dht.is_alive():
        dht.terminate()
        dht.join(5)


def visible_maddrs(dht: DHT) -> list[str]:
    """The DHT's full multiaddrs (``/ip4/127.0.0.1/tcp/PORT/p2p/PEER``) as strings."""
    return [str(m) for m in dht.get_visible_maddrs()]
