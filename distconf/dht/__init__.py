"""Peer discovery on a hivemind DHT: records, announce, discover, route.

Importing this package needs only pydantic; hivemind is imported when a function that
talks to a DHT is called. Every DHT helper here dials only the addresses its caller
gives; `start_local_dht` listens on 127.0.0.1 only.

A swarm is open: any peer may write anything. Every node `start_local_dht` starts
refuses malformed records at the door (`distconf.dht.validators`, `distconf.dht.guard`);
discovery isolates bad records and keys; ``signed_records=True`` makes server records
owned by their peer (see docs/security.md and each module's docstring).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from distconf.dht.announce import BlockAnnouncer, announce_blocks, default_expiration
from distconf.dht.discovery import (
    RemoteSpan,
    SkippedRecord,
    SwarmState,
    find_block_servers,
    find_models,
    find_servers_by_prefix,
    read_model_listing,
)
from distconf.dht.liveness import ping_peers
from distconf.dht.peerids import is_peer_id
from distconf.dht.records import (
    CHAIN_DELIMITER,
    MAX_NUM_BLOCKS,
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
    "MAX_NUM_BLOCKS",
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
    "SwarmRecordValidator",
    "SwarmState",
    "announce_blocks",
    "block_uid",
    "default_expiration",
    "find_block_servers",
    "find_models",
    "find_servers_by_prefix",
    "is_peer_id",
    "make_route",
    "parse_block_uid",
    "ping_peers",
    "raise_join_error",
    "read_model_listing",
    "route_summary",
    "start_local_dht",
    "visible_maddrs",
]

LOOPBACK_MADDRS = ("/ip4/127.0.0.1/tcp/0",)
"""Listen addresses used by `start_local_dht`: loopback only, any free port."""


def start_local_dht(
    initial_peers: list[str] | tuple[str, ...] = (), *, startup_timeout: float = 60.0,
    signed_records: bool = False, record_scope: str = "swarm", **kwargs: Any
) -> DHT:
    """Start a ``hivemind.DHT`` listening on 127.0.0.1 (unless ``host_maddrs`` says otherwise), dialing only
    ``initial_peers``.

    Waits up to ``startup_timeout`` seconds for the node to be ready (then kills it and
    raises `TimeoutError`). ``kwargs`` go to ``hivemind.DHT`` (e.g.
    ``client_mode=True``, ``num_workers``, ``record_validators``). The caller should call
    ``.shutdown()`` (bounded: it kills a node that does not stop); nodes still running at
    interpreter exit are shut down then.

    The node is a `distconf.dht.node_process.NodeProcess`: its process and its p2p daemon
    ignore signals sent to the caller's process group, leaving the caller to stop them in
    order (a server announces OFFLINE through the node first), and they exit by
    themselves if the caller dies.

    The node is hardened against hostile peers: it installs a `SwarmRecordValidator`
    (malformed server and listing records are never stored or returned) and the guard of
    `distconf.dht.guard` (per-record isolation, bounded records per key).

    :param signed_records: own records (swarms without Petals 2.x clients): the node gets
        an RSA identity (its peer id is the hash of its RSA key; pass ``identity_path`` to
        keep one, else a fresh key is used), hivemind's ``RSASignatureValidator`` signs its
        records, and it accepts only server records signed by the peer they name.
    :param record_scope: ``"swarm"`` (every key but ``_petals.models`` holds server
        records: a swarm's own DHT) or ``"listed"`` (only models discovered or announced
        through this node are checked: a DHT shared with other hivemind applications).
    """
    from distconf.dht.node_process import NodeProcess
    from distconf.dht.validators import SwarmRecordValidator

    kwargs.setdefault("host_maddrs", list(LOOPBACK_MADDRS))
    kwargs.pop("start", None)
    kwargs.pop("await_ready", None)
    validators = list(kwargs.pop("record_validators", ()))
    cleanup = None
    if signed_records:
        from distconf.dht.identity import rsa_identity

        key, kwargs["identity_path"], cleanup = rsa_identity(kwargs.get("identity_path"))
        if cleanup is not None:
            kwargs.setdefault("check_if_identity_free", False)  # a fresh key cannot be taken
        from hivemind.dht.crypto import RSASignatureValidator

        validators.insert(0, RSASignatureValidator(key))
    validators.append(SwarmRecordValidator(signed=signed_records, scope=record_scope))
    dht = NodeProcess(initial_peers=list(initial_peers), start=False, record_validators=validators, **kwargs)
    try:
        dht.run_in_background(await_ready=True, timeout=startup_timeout)
        dht.run_coroutine(_guard_node, return_future=True).result(timeout=startup_timeout)
    except TimeoutError as exc:  # concurrent.futures.TimeoutError is TimeoutError on 3.11+
        dht.kill_now()
        raise TimeoutError(f"DHT node not ready after {startup_timeout} s") from exc
    except BaseException as exc:
        dht.kill_now()
        raise_join_error(exc, initial_peers, kwargs.get("identity_path"))
        raise
    finally:
        if cleanup is not None:
            cleanup()
    return dht


def raise_join_error(exc: BaseException, initial_peers: Sequence[str], identity_path: str | None = None) -> None:
    """Raise the one-line error a user should see for ``exc``, a daemon that failed to join; else return.

    `distconf.errors.SwarmJoinError` (naming each initial peer and why it could not be reached) when no
    bootstrap peer answered; `distconf.dht.identity.IdentityError` when the identity is taken by a peer
    that is online.
    """
    from distconf.dht.bootstrap import BOOTSTRAP_FAILURE, explain_unreachable
    from distconf.errors import SwarmJoinError

    text = str(exc)
    if BOOTSTRAP_FAILURE in text:
        raise SwarmJoinError(list(initial_peers), explain_unreachable(list(initial_peers))) from None
    if identity_path is not None and "is already taken by another peer" in text:
        from distconf.dht.identity import IdentityError

        raise IdentityError(f"{identity_path}: this identity's peer is online in the swarm already (another "
                            "server started with the same --identity-path?)") from None


async def _guard_node(_dht: DHT, node: Any) -> bool:
    from distconf.dht.guard import install_guard
    from distconf.dht.hivemind_compat import lazy_peer_id_text

    install_guard(node)
    lazy_peer_id_text()  # a speed-up, not a guard (see distconf.dht.hivemind_compat)
    return True


def __getattr__(name: str) -> Any:
    if name == "SwarmRecordValidator":  # subclasses a hivemind class: imported on first use
        from distconf.dht.validators import SwarmRecordValidator

        return SwarmRecordValidator
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def visible_maddrs(dht: DHT, latest: bool = False) -> list[str]:
    """The DHT's full multiaddrs (``/ip4/127.0.0.1/tcp/PORT/p2p/PEER``) as strings.

    ``latest``: ask the daemon again (circuit addresses appear once a relay has reserved a slot).
    """
    return [str(m) for m in dht.get_visible_maddrs(latest=latest)]
