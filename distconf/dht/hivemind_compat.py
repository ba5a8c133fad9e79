"""Every use of hivemind's internals, in three modules, checked against the hivemind they were written for.

The rest of distconf uses hivemind's public API only (``hivemind.DHT``, ``hivemind.P2P``,
``PeerID``, ``MSGPackSerializer``, record validators). Everything that reaches further
(underscore names, internal modules, monkey-patches) lives here, in
`distconf.dht.hivemind_rpc_compat` and in `distconf.dht.hivemind_p2p_compat`. It was written against
hivemind 1.1.12 (`TESTED_HIVEMIND`) for the range `SUPPORTED_HIVEMIND`, the pin in
``pyproject.toml``: importing this module with any other hivemind installed raises
`HivemindVersionError`, saying what to install. To widen the range, re-read each item
below against the new hivemind's source, then run ``tests/test_hivemind_compat.py`` (one
test per item).

The module sits in the dht layer so that dht, rpc, server and client can all use it; it
imports hivemind only when a function is called. Its items are numbered across the three modules
(this one, `distconf.dht.hivemind_rpc_compat` and `distconf.dht.hivemind_p2p_compat`); all are checked by
the one version rule below.

Patches (each applies in the process that calls it; we call them in our DHT processes)

1. `guard_msgpack_depth` (the msgpack depth guard): in `distconf.dht.hivemind_rpc_compat`.
2. `filter_dictionaries` replaces ``DHTProtocol._validate_dictionary`` on one protocol
   object. *Why*: hivemind refuses a whole dictionary (every server of a block) when one
   of its records is invalid; the replacement lets the caller drop records in place and
   keeps the rest. It relies on ``rpc_store`` and ``call_find`` calling it with ``(key
   bytes, DictionaryDHTValue)`` and then using what remains of the dictionary. *If
   hivemind changes it*: the filter is never called, so one bad record hides a block's
   servers again, or (if the dictionary is copied first) bad records pass.
3. `cap_stored_subkeys` wraps ``store_subkey`` of one ``DHTLocalStorage`` object (the
   node's ``protocol.storage`` and ``protocol.cache``). *Why*: without a cap a peer can
   store any number of subkeys under a swarm key, and every reader downloads them all.
   *If hivemind changes it*: stores that bypass ``store_subkey`` are not capped.
4. `expire_dictionaries_by_records` wraps ``hivemind.dht.node._SearchState.add_candidate``
   (a private class; process-wide). *Why*: a search trusts the responding peer's claimed
   expiration of a dictionary; a claim of ``+inf`` ends a "latest" search at once and
   hides every record other peers hold. The wrap takes the expiration from the
   dictionary's own (validated) records and ignores empty dictionaries. *If hivemind
   changes it*: a renamed class or method raises ``AttributeError`` at install; other
   search logic could make a false claim end searches again.
5. `bound_dictionary_decoding` replaces the classmethod ``DictionaryDHTValue.unpackb``
   (process-wide). *Why*: a peer holding thousands of records under one key sends them
   all, and hivemind stores each one by one before any validation; we keep the first
   ``limit``. A copy of hivemind 1.1.12's body with a slice. *If hivemind changes the
   packed layout* (``[maxsize, latest_expiration_time, items]``): decoding dictionaries
   fails, so every server lookup comes back empty (the round-trip test fails first).
6. `lazy_peer_id_text` replaces ``PeerID.__init__`` and ``PeerID.to_base58`` and adds a
   ``__getstate__`` (process-wide; a speed-up, not a security rule). *Why*: every search
   response names up to 20 neighbours per key and hivemind base58-encodes each new
   ``PeerID`` in pure Python, about a third of a client's CPU during a discovery, for text
   that is almost never read. Pickled, a ``PeerID`` still carries its text, so processes
   without the patch read it as usual. *If hivemind changes it*: a ``PeerID`` that reads
   ``_b58_str`` directly, or new slots, break ``str(peer_id)`` (the test compares with the
   unpatched class).

Reads of private state (no patch)

7. `composite_validators` lists ``CompositeValidator._validators`` (no public accessor).
   *If it changes*: the guard no longer sees installed validators and adds its own twice.
8. `rsa_private_key_from_der` builds a ``hivemind.utils.crypto.RSAPrivateKey`` through its
   ``__setstate__`` (hivemind has no constructor from stored bytes) and checks the key
   type through ``_private_key``. *If it changes*: signed nodes cannot reuse an identity file.
9. ``distconf.dht.wire.TUPLE_EXT_CODE`` (our bounded decoder) mirrors
   ``MSGPackSerializer._TUPLE_EXT_TYPE_CODE``; the tests check that they agree.
10. `forget_p2p_replica` detaches ``DHT._p2p_replica``, the one replica hivemind's
    ``DHT.replicate_p2p`` keeps per DHT object (there is no public way to close it), so a
    caller can shut it down on the loop that made it. *If it changes*: the replica is left
    to the garbage collector, which closes it outside any event loop (warnings at exit).
11. `p2p_message_limits` reads the p2p daemon's message limits (``DEFAULT_MAX_MSG_SIZE``,
    ``MAX_UNARY_PAYLOAD_SIZE``) from the internal module
    ``hivemind.p2p.p2p_daemon_bindings.control``. *If they move*: it raises
    ``ImportError``; if they change, our streaming chunk size follows them.

Process control and speed (in `distconf.dht.hivemind_rpc_compat`)

12. `isolate_p2p_daemon`: p2pd in a process group of its own, dying with its DHT process.
13. `coalesce_p2p_writes`: one write per stream message.

Those three are patches of every process that talks to peers (servers, clients, DHT
nodes); they live there to keep each module one job. So does item 20:

20. `renew_future_locks`: new ``MPFuture`` locks once a killed DHT process may have held one.

Across networks (in `distconf.dht.hivemind_p2p_compat`)

14. `static_relays`: trusted relays as static relays (no 3-minute boot delay).
15. `daemon_peer_ids_as_multihash`: ``/p2p/`` in binary multiaddrs as the daemon reads it.
16. `connect_peer`, `disconnect_peer`: the daemon's CONNECT and DISCONNECT.
17. `scalar_headers_for_numpy`: hivemind's 8-bit compressions decode on NumPy 2.4.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from distconf.versions import declared_range, installed_version, version_in_range

if TYPE_CHECKING:  # pragma: no cover
    from hivemind import DHT, P2P
    from hivemind.dht.protocol import DHTProtocol
    from hivemind.dht.storage import DHTLocalStorage
    from hivemind.utils.crypto import RSAPrivateKey

__all__ = [
    "SUPPORTED_HIVEMIND",
    "TESTED_HIVEMIND",
    "HivemindVersionError",
    "bound_dictionary_decoding",
    "cap_stored_subkeys",
    "check_hivemind_version",
    "composite_validators",
    "expire_dictionaries_by_records",
    "filter_dictionaries",
    "forget_p2p_replica",
    "lazy_peer_id_text",
    "p2p_message_limits",
    "rsa_private_key_from_der",
]

SUPPORTED_HIVEMIND = declared_range("hivemind")
"""hivemind versions this module was written for: the pin in ``pyproject.toml`` (its one home)."""
TESTED_HIVEMIND = "1.1.12"
"""The hivemind version each item of this module was read against and tested with."""

_MARK = "_distconf_patch"  # set on every replacement function, so each patch is applied once
_lock = threading.Lock()


class HivemindVersionError(ImportError):
    """The installed hivemind is outside `SUPPORTED_HIVEMIND` (or missing)."""


def check_hivemind_version(version: str | None = None) -> str:
    """Return the installed hivemind version (or ``version``); `HivemindVersionError` outside the range."""
    if version is None:
        version = installed_version("hivemind")
        if version is None:
            raise HivemindVersionError(f"distconf needs hivemind{SUPPORTED_HIVEMIND}; hivemind is not installed")
    if not version_in_range(version, SUPPORTED_HIVEMIND):
        raise HivemindVersionError(
            f"distconf patches hivemind internals written for hivemind{SUPPORTED_HIVEMIND} (tested with "
            f"{TESTED_HIVEMIND}), but hivemind {version} is installed: pip install 'hivemind{SUPPORTED_HIVEMIND}'")
    return version


check_hivemind_version()


def _marked(function: Any) -> bool:
    return getattr(function, _MARK, False)


def _mark(function: Any) -> Any:
    setattr(function, _MARK, True)
    return function


# ----------------------------------------------------------------------------- 2. dictionary filter
def filter_dictionaries(protocol: DHTProtocol, drop_invalid: Callable[[bytes, Any], None]) -> None:
    """Let ``drop_invalid(key_bytes, dictionary)`` remove records from every dictionary ``protocol`` receives.

    Replaces hivemind's all-or-nothing check: the dictionary is always kept, with what
    ``drop_invalid`` left in it (in stores by peers and in search responses).
    """

    def _validate_dictionary(key_bytes: bytes, dictionary: Any) -> bool:
        drop_invalid(key_bytes, dictionary)
        return True  # False would make hivemind drop the whole dictionary

    protocol._validate_dictionary = _mark(_validate_dictionary)  # type: ignore[method-assign]


# ----------------------------------------------------------------------------- 3. subkey cap
def cap_stored_subkeys(storage: DHTLocalStorage, cap: Callable[[bytes], int | None],
                       on_refused: Callable[[], None] = lambda: None) -> None:
    """Make ``storage`` refuse a new subkey under a key that holds ``cap(key bytes)`` subkeys already.

    ``cap`` returns None for keys without a cap. Subkeys already held may always be
    refreshed. ``on_refused`` is called for each refusal. Calling again replaces the cap.
    """
    from hivemind.dht.storage import DictionaryDHTValue

    unguarded = getattr(storage.store_subkey, "__wrapped__", storage.store_subkey)

    def store_subkey(key: Any, subkey: Any, value: bytes, expiration_time: float) -> bool:
        limit = cap(key.to_bytes())
        if limit is not None:
            current = storage.get(key)
            if (current is not None and isinstance(current.value, DictionaryDHTValue)
                    and subkey not in current.value and len(current.value) >= limit):
                on_refused()
                return False
        return unguarded(key, subkey, value, expiration_time)

    store_subkey.__wrapped__ = unguarded  # type: ignore[attr-defined]
    storage.store_subkey = _mark(store_subkey)  # type: ignore[method-assign]


# ----------------------------------------------------------------------------- 4. search expiration
def expire_dictionaries_by_records() -> None:
    """Make DHT searches take a dictionary's expiration from its records, not from the peer's claim.

    A dictionary with no record is ignored. Process-wide; idempotent.
    """
    from hivemind.dht import node as hivemind_node
    from hivemind.dht.storage import DictionaryDHTValue
    from hivemind.utils.timed_storage import ValueWithExpiration

    search_state = hivemind_node._SearchState
    with _lock:
        unguarded = search_state.add_candidate
        if _marked(unguarded):
            return

        def add_candidate(self: Any, candidate: Any, source_node_id: Any) -> None:
            if candidate is not None and isinstance(candidate.value, DictionaryDHTValue):
                latest = max((item.expiration_time for _, item in candidate.value.items()), default=None)
                if latest is None:
                    return  # nothing (valid and unexpired) in it
                if not candidate.expiration_time <= latest:
                    candidate = ValueWithExpiration(candidate.value, latest)
            unguarded(self, candidate, source_node_id)

        search_state.add_candidate = _mark(add_candidate)


# ----------------------------------------------------------------------------- 5. dictionary decoding
def bound_dictionary_decoding(limit: int) -> None:
    """Decode at most ``limit`` records of any dictionary a peer sends. Process-wide; the first limit stays."""
    from hivemind.dht.storage import DictionaryDHTValue
    from hivemind.utils.serializer import MSGPackSerializer

    with _lock:
        if _marked(DictionaryDHTValue.unpackb):
            return

        def unpackb(cls: type, raw: bytes) -> Any:
            maxsize, latest_expiration_time, items = MSGPackSerializer.loads(raw)
            with cls(maxsize).freeze() as new_dict:
                for key, value, expiration_time in items[:limit]:
                    new_dict.store(key, value, expiration_time)
                new_dict.latest_expiration_time = latest_expiration_time
                return new_dict

        DictionaryDHTValue.unpackb = classmethod(_mark(unpackb))  # type: ignore[method-assign]


# ----------------------------------------------------------------------------- 6. PeerID text
def lazy_peer_id_text() -> None:
    """Let hivemind's ``PeerID`` compute its base58 text when first asked, not when created.

    A performance patch (see the module docstring, item 6). Process-wide; idempotent.
    """
    import base58
    from hivemind.p2p import PeerID

    with _lock:
        if _marked(PeerID.__init__):
            return

        def __init__(self: Any, peer_id_bytes: bytes) -> None:
            self._bytes = peer_id_bytes

        def to_base58(self: Any) -> str:
            text = self.__dict__.get("_b58_str")
            if text is None:
                text = self._b58_str = base58.b58encode(self._bytes).decode()
            return text

        def __getstate__(self: Any) -> dict[str, Any]:
            to_base58(self)
            return dict(self.__dict__)

        PeerID.to_base58 = to_base58  # type: ignore[method-assign]
        PeerID.__getstate__ = __getstate__  # type: ignore[method-assign]
        PeerID.__init__ = _mark(__init__)  # type: ignore[method-assign]


# ----------------------------------------------------------------------------- 7, 8. private state
def composite_validators(validator: Any) -> list[Any]:
    """The validators inside a hivemind ``CompositeValidator`` (``[]`` for anything else)."""
    return list(getattr(validator, "_validators", ()))


def rsa_private_key_from_der(der: bytes) -> RSAPrivateKey:
    """A hivemind ``RSAPrivateKey`` from a DER private key; `ValueError` if it is not RSA."""
    from cryptography.hazmat.primitives.asymmetric import rsa
    from hivemind.utils.crypto import RSAPrivateKey

    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key.__setstate__({"_private_key": der})  # hivemind's own unpickling path
    if not isinstance(key._private_key, rsa.RSAPrivateKey):
        raise ValueError("not an RSA private key")
    return key


# ----------------------------------------------------------------------------- 10, 11. P2P
def forget_p2p_replica(dht: DHT) -> P2P | None:
    """The P2P replica ``dht.replicate_p2p()`` made (None if none), detached: the caller shuts it down."""
    replica = getattr(dht, "_p2p_replica", None)
    if replica is not None:
        dht._p2p_replica = None
    return replica


def p2p_message_limits() -> tuple[int, int]:
    """``(DEFAULT_MAX_MSG_SIZE, MAX_UNARY_PAYLOAD_SIZE)``: the p2p daemon's largest message, largest unary payload."""
    from hivemind.p2p.p2p_daemon_bindings import control

    return control.DEFAULT_MAX_MSG_SIZE, control.MAX_UNARY_PAYLOAD_SIZE
